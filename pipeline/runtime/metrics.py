"""What a generation measured, as metrics and one-line notes: latency, throughput, achieved weight
bandwidth, and the engine's own resources (KV cache, CUDA graphs)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from torch import nn

from pipeline.backends.cudagraph import CUDAGraphRunner
from pipeline.runtime.engine import DemoLLM, Generation, PagedRunner
from pipeline.runtime.requests import Request


def generation_metrics(runs: list[Generation], decode_bytes: int) -> dict[str, float]:
    """Medians over the timed generations (min and max when there are several)."""
    prefill = [1000 * g.prefill_s for g in runs]
    decode = [g.decode_ms for g in runs]
    last = runs[-1]
    metrics = {
        "latency/prefill_ms": statistics.median(prefill),
        "latency/decode_ms": statistics.median(decode),
        "latency/decode_p90_ms": statistics.median(g.decode_p90_ms for g in runs),
        "throughput/decode_tok_s": statistics.median(g.decode_tok_s for g in runs),
        # Weights read per step / step time: how close decode runs to the memory bandwidth.
        "throughput/decode_gbs": decode_bytes / (statistics.median(decode) / 1000) / 1e9,
        "generation/requests": len(last.tokens),
        "generation/tokens": sum(len(t) for t in last.tokens.values()),
    }
    if len(runs) > 1:
        metrics |= {
            "latency/prefill_ms_min": min(prefill),
            "latency/prefill_ms_max": max(prefill),
            "latency/decode_ms_min": min(decode),
            "latency/decode_ms_max": max(decode),
        }
    return metrics


def generation_notes(
    engine: DemoLLM, requests: list[Request], metrics: dict[str, float], timed_runs: int, warmed_up: bool
) -> list[str]:
    return [
        f"{type(engine.runner).__name__}: {len(requests)} requests, prompts of "
        f"{sorted({len(r.prompt) for r in requests})} tokens, {metrics['generation/tokens']} tokens generated",
        f"prefill {metrics['latency/prefill_ms']:.1f} ms; decode {metrics['latency/decode_ms']:.2f} ms/step "
        f"(p90 {metrics['latency/decode_p90_ms']:.2f}), {metrics['throughput/decode_tok_s']:.1f} tok/s, "
        f"weights read at {metrics['throughput/decode_gbs']:.1f} GB/s"
        + (f"; median of {timed_runs} timed runs" if timed_runs > 1 else "")
        + ("; after a warm-up generation" if warmed_up else ""),
    ]


def resource_metrics(model: nn.Module, engine: DemoLLM) -> tuple[dict[str, float], list[str]]:
    """The KV cache the engine allocated and, per CUDA-graph runner, its replays and memory."""
    metrics: dict[str, float] = {}
    notes: list[str] = []
    for runner in (m for m in model.modules() if isinstance(m, CUDAGraphRunner)):
        metrics["capture/cuda_graph_replays"] = runner.replays
        metrics["capture/uncaptured_steps"] = runner.fallbacks
        metrics["memory/cuda_graph_buffers_mb"] = runner.memory_bytes() / 2**20
        metrics["memory/cuda_graph_pool_mb"] = runner.pool_bytes / 2**20
        notes.append(
            f"CUDA graphs: {runner.replays} replays, {runner.fallbacks} uncaptured steps "
            f"(prefill), buckets captured {sorted(runner.graphs)}, "
            f"{runner.pool_bytes / 2**20:.1f} MiB reserved by the captures"
        )
    if isinstance(engine.runner, PagedRunner):
        cache = engine.runner.cache
        metrics["memory/kv_cache_mb"] = cache.bytes / 2**20
        notes.append(
            f"KV cache: {cache.num_pages} pages of {cache.page_size} tokens, {cache.bytes / 2**20:.1f} MiB"
        )
    return metrics, notes


def write_tokens(path: Path, requests: list[Request], generation: Generation) -> None:
    """The generated token ids, a request a line."""
    entries = [
        {"seq_id": r.seq_id, "prompt_len": len(r.prompt), "tokens": generation.tokens[r.seq_id]}
        for r in requests
    ]
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in entries) + "\n]\n")
