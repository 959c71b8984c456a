"""generate: demollm on the configured workload. Prefill all prompts in one step, then decode one
token per sequence per step; tokens, latencies and throughput go to the run."""

from __future__ import annotations

import json
import statistics

from pipeline.backends.compile import compiled_frames
from pipeline.backends.cudagraph import CUDAGraphRunner
from pipeline.errors import StageFailure
from pipeline.runtime.engine import DemoLLM, Generation, PagedRunner
from pipeline.runtime.requests import build_requests
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState, StageResult


def eos_ids(hf_config) -> set[int]:
    text_config = getattr(hf_config, "text_config", None) or hf_config
    eos = text_config.eos_token_id
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))


def run(state: RunState) -> StageResult:
    cfg = state.cfg
    requests = build_requests(cfg, state.hf_config, state.dtype, state.device, state.tokenizer)
    try:
        engine = DemoLLM(state.model, state.hf_config, cfg.runtime, state.device, eos_ids(state.hf_config))
    except ValueError as exc:
        raise StageFailure(str(exc)) from exc
    params = SamplingParams(**cfg.runtime.sampling)
    # A compiling or graph-capturing backend compiles the step shapes it first meets: warm up once so
    # the measured run times steps, not compilation (benchmark mode always warms up).
    warm_up = cfg.benchmark.enabled or state.backend != "torch-simple"
    if warm_up:
        engine.generate(requests, cfg.prompt.output_len, params, cfg.seed)
    iterations = cfg.benchmark.iterations if cfg.benchmark.enabled else 1
    runs: list[Generation] = [
        engine.generate(requests, cfg.prompt.output_len, params, cfg.seed) for _ in range(iterations)
    ]
    generation = runs[-1]
    state.engine, state.generation = engine, generation

    folder = state.run_dir / "generation"
    folder.mkdir(parents=True, exist_ok=True)
    tokens_file = folder / "tokens.json"
    entries = [
        {"seq_id": r.seq_id, "prompt_len": len(r.prompt), "tokens": generation.tokens[r.seq_id]}
        for r in requests
    ]
    tokens_file.write_text("[\n" + ",\n".join(json.dumps(e) for e in entries) + "\n]\n")  # a request a line
    prefill = [1000 * g.prefill_s for g in runs]
    decode = [g.decode_ms for g in runs]
    metrics = {
        "latency/prefill_ms": statistics.median(prefill),
        "latency/decode_ms": statistics.median(decode),
        "latency/decode_p90_ms": statistics.median(g.decode_p90_ms for g in runs),
        "throughput/decode_tok_s": statistics.median(g.decode_tok_s for g in runs),
        # Weights read per step / step time: how close decode runs to the memory bandwidth.
        "throughput/decode_gbs": state.model_info.decode_bytes / (statistics.median(decode) / 1000) / 1e9,
        "generation/requests": len(requests),
        "generation/tokens": sum(len(t) for t in generation.tokens.values()),
    }
    if len(runs) > 1:
        metrics |= {
            "latency/prefill_ms_min": min(prefill),
            "latency/prefill_ms_max": max(prefill),
            "latency/decode_ms_min": min(decode),
            "latency/decode_ms_max": max(decode),
        }
    runner = type(engine.runner).__name__
    notes = [
        f"{runner}: {len(requests)} requests, prompts of {sorted({len(r.prompt) for r in requests})} tokens, "
        f"{metrics['generation/tokens']} tokens generated",
        f"prefill {metrics['latency/prefill_ms']:.1f} ms; decode {metrics['latency/decode_ms']:.2f} ms/step "
        f"(p90 {metrics['latency/decode_p90_ms']:.2f}), {metrics['throughput/decode_tok_s']:.1f} tok/s, "
        f"weights read at {metrics['throughput/decode_gbs']:.1f} GB/s"
        + (f"; median of {len(runs)} timed runs" if len(runs) > 1 else "")
        + ("; after a warm-up generation" if warm_up else ""),
    ]
    if state.backend in ("torch-compile", "torch-opt"):
        metrics["capture/recompiles"] = compiled_frames() - state.compiled_frames
        notes.append(f"recompilations during generation: {int(metrics['capture/recompiles'])}")
    runners = [m for m in state.model.modules() if isinstance(m, CUDAGraphRunner)]
    for graph_runner in runners:
        metrics["capture/cuda_graph_replays"] = graph_runner.replays
        metrics["capture/uncaptured_steps"] = graph_runner.fallbacks
        metrics["memory/cuda_graph_buffers_mb"] = graph_runner.memory_bytes() / 2**20
        metrics["memory/cuda_graph_pool_mb"] = graph_runner.pool_bytes / 2**20
        notes.append(
            f"CUDA graphs: {graph_runner.replays} replays, {graph_runner.fallbacks} uncaptured steps "
            f"(prefill), buckets captured {sorted(graph_runner.graphs)}, "
            f"{graph_runner.pool_bytes / 2**20:.1f} MiB reserved by the captures"
        )
    if isinstance(engine.runner, PagedRunner):
        cache = engine.runner.cache
        metrics["memory/kv_cache_mb"] = cache.bytes / 2**20
        notes.append(
            f"KV cache: {cache.num_pages} pages of {cache.page_size} tokens, {cache.bytes / 2**20:.1f} MiB"
        )
    return StageResult(metrics=metrics, artifacts=[tokens_file], notes=notes)
