"""generate: demollm on the configured workload. Prefill all prompts in one step, then decode one
token per sequence per step; tokens, latencies and throughput go to the run."""

from __future__ import annotations

import json
import statistics

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
    runs: list[Generation] = []
    if cfg.benchmark.enabled:
        engine.generate(requests, cfg.prompt.output_len, params, cfg.seed)  # warm-up
        runs = [
            engine.generate(requests, cfg.prompt.output_len, params, cfg.seed)
            for _ in range(cfg.benchmark.iterations)
        ]
    else:
        runs = [engine.generate(requests, cfg.prompt.output_len, params, cfg.seed)]
    generation = runs[-1]
    state.generation = generation

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
        f"(p90 {metrics['latency/decode_p90_ms']:.2f}), {metrics['throughput/decode_tok_s']:.1f} tok/s"
        + (f"; median of {len(runs)} timed runs after a warm-up" if len(runs) > 1 else ""),
    ]
    if isinstance(engine.runner, PagedRunner):
        cache = engine.runner.cache
        metrics["memory/kv_cache_mb"] = cache.bytes / 2**20
        notes.append(
            f"KV cache: {cache.num_pages} pages of {cache.page_size} tokens, {cache.bytes / 2**20:.1f} MiB"
        )
    return StageResult(metrics=metrics, artifacts=[tokens_file], notes=notes)
