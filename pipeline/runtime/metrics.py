"""What a generation measured, as metrics and one-line notes: latency, throughput, achieved weight
bandwidth, and the engine's own resources (KV cache, CUDA graphs)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from torch import nn

from pipeline.backends import piecewise
from pipeline.backends.cudagraph import CUDAGraphRunner
from pipeline.runtime.engine import DemoLLM, Generation
from pipeline.runtime.executors import PagedExecutor
from pipeline.runtime.machine_load import quantile
from pipeline.runtime.requests import Request


def generation_metrics(runs: list[Generation], decode_bytes: int, lookahead: int) -> dict[str, float]:
    """Decode: median, p10 and p90 over the timed runs' steady decode steps (decode_steps_ms);
    prefill: the median over the timed runs (p10 and p90 when there are several)."""
    prefill = [1000 * g.prefill_s for g in runs]
    steps = decode_steps_ms(runs, lookahead)
    decode = statistics.median(steps) if steps else float("nan")
    last = runs[-1]
    metrics = {
        "latency/prefill_ms": statistics.median(prefill),
        "latency/decode_ms": decode,
        "latency/decode_p10_ms": quantile(steps, 0.1) if steps else float("nan"),
        "latency/decode_p90_ms": quantile(steps, 0.9) if steps else float("nan"),
        "throughput/decode_tok_s": statistics.median(g.decode_tok_s for g in runs),
        # Weights read per step / step time: how close decode runs to the memory bandwidth.
        "throughput/decode_gbs": decode_bytes / (decode / 1000) / 1e9,
        "generation/requests": len(last.tokens),
        "generation/tokens": sum(len(t) for t in last.tokens.values()),
        "generation/prefill_steps": sum(s.kind == "prefill" for s in last.steps),
        **request_metrics(runs),
    }
    if len(runs) > 1:
        metrics |= {
            "latency/prefill_p10_ms": quantile(prefill, 0.1),
            "latency/prefill_p90_ms": quantile(prefill, 0.9),
        }
    return metrics


def decode_steps_ms(runs: list[Generation], lookahead: int) -> list[float]:
    """Every timed decode step but each run's last `lookahead`: those were computed while earlier
    tokens were awaited, so their intervals are near 0 where the host computes (CPU) and would
    pass for a fast step."""
    steps = []
    for g in runs:
        times = g.decode_step_s
        steps += [1000 * s for s in (times[:-lookahead] if lookahead and len(times) > lookahead else times)]
    return steps


def request_metrics(runs: list[Generation]) -> dict[str, float]:
    """What each request saw, over the requests of every timed run: time in the queue, to its first
    token, per output token after it (median, p10, p90), and requests finished per second."""
    timings = [t for g in runs for t in g.requests.values()]
    queue = [1000 * t.queue_s for t in timings]
    ttft = [1000 * t.ttft_s for t in timings]
    tpot = [1000 * t.tpot_s for t in timings if t.tpot_s is not None]
    metrics = {"throughput/requests_s": statistics.median(len(g.requests) / g.wall_s for g in runs)}
    for name, values in (("queue", queue), ("ttft", ttft), ("tpot", tpot)):
        if values:
            metrics |= {
                f"latency/{name}_ms": statistics.median(values),
                f"latency/{name}_p10_ms": quantile(values, 0.1),
                f"latency/{name}_p90_ms": quantile(values, 0.9),
            }
    return metrics


def generation_notes(
    engine: DemoLLM, requests: list[Request], metrics: dict[str, float], timed_runs: int, warmed_up: bool
) -> list[str]:
    return [
        f"{type(engine.executor).__name__}: {len(requests)} requests, prompts of "
        f"{sorted({len(r.prompt) for r in requests})} tokens, {metrics['generation/tokens']} tokens generated",
        f"prefill {metrics['latency/prefill_ms']:.1f} ms; decode {metrics['latency/decode_ms']:.2f} ms/step "
        f"(p10 {metrics['latency/decode_p10_ms']:.2f}, p90 {metrics['latency/decode_p90_ms']:.2f}), "
        f"{metrics['throughput/decode_tok_s']:.1f} tok/s, "
        f"weights read at {metrics['throughput/decode_gbs']:.1f} GB/s"
        + (f"; median of {timed_runs} timed runs" if timed_runs > 1 else "")
        + ("; after a warm-up generation" if warmed_up else ""),
        f"per request: queue {metrics['latency/queue_ms']:.1f} ms, time to first token "
        f"{metrics['latency/ttft_ms']:.1f} ms (p90 {metrics['latency/ttft_p90_ms']:.1f})"
        + (f", {metrics['latency/tpot_ms']:.2f} ms per output token" if "latency/tpot_ms" in metrics else "")
        + f"; {metrics['generation/prefill_steps']} prefill step(s), {metrics['throughput/requests_s']:.2f} requests/s",
    ]


def resource_metrics(
    model: nn.Module, engine: DemoLLM, piecewise_reports: list[dict]
) -> tuple[dict[str, float], list[str]]:
    """The KV cache the engine allocated and, per CUDA-graph runner, its replays and memory; per
    piecewise runner's report, its buckets (piecewise_metrics)."""
    metrics: dict[str, float] = {}
    notes: list[str] = []
    for runner in (m for m in model.modules() if isinstance(m, CUDAGraphRunner)):
        metrics["capture/cuda_graph_replays"] = runner.replays
        metrics["capture/uncaptured_steps"] = runner.fallbacks
        metrics["memory/cuda_graph_buffers_mb"] = runner.memory_bytes() / 2**20
        metrics["memory/cuda_graph_pool_mb"] = runner.pool_bytes / 2**20
        notes.append(
            f"CUDA graphs of decode steps: {runner.replays} replays, {runner.fallbacks} steps they left "
            f"uncaptured, buckets captured {sorted(runner.graphs)}, "
            f"{runner.pool_bytes / 2**20:.1f} MiB reserved by the captures"
        )
    for runner, report in zip(piecewise.runners(model), piecewise_reports, strict=True):
        piece_metrics, piece_notes = piecewise_metrics(report)
        if not runner.use_graphs:  # padded segments without CUDA graphs: no graph memory to report
            del piece_metrics["memory/cuda_graph_pool_mb"]
        for key, value in piece_metrics.items():  # the decode runner's share, where there is one
            metrics[key] = metrics.get(key, 0.0) + value if key.startswith(("memory/", "capture/")) else value
        if runner.use_graphs:
            metrics["memory/cuda_graph_buffers_mb"] = (
                metrics.get("memory/cuda_graph_buffers_mb", 0.0) + runner.buffer_bytes() / 2**20
            )
        notes += piece_notes
    if isinstance(engine.executor, PagedExecutor):
        cache = engine.executor.cache
        metrics["memory/kv_cache_mb"] = cache.bytes / 2**20
        notes.append(
            f"KV cache: {cache.num_pages} pages of {cache.page_size} tokens, {cache.bytes / 2**20:.1f} MiB"
        )
    return metrics, notes


def piecewise_metrics(report: dict) -> tuple[dict[str, float], list[str]]:
    """A piecewise runner's report (backends/piecewise.py) as metrics and a table: per bucket used,
    its steps, real and padded tokens and mean step time; the steps left to the full graph, by
    reason; the bucket set that would have padded the same steps least."""
    rows = report["rows"]
    steps = sum(r["steps"] for r in rows)
    padded = sum(r["padded_tokens"] for r in rows)
    uncaptured = sum(report["uncaptured"].values())
    metrics = {
        "piecewise/steps": steps,
        "piecewise/padding_pct": 100 * report["padding_tokens"] / padded if padded else 0.0,
        "piecewise/suggested_padding_pct": 100 * report["suggested_padding_tokens"] / padded
        if padded
        else 0.0,
        "capture/uncaptured_steps": uncaptured,
        "memory/cuda_graph_pool_mb": report["pool_mb"],
    }
    for r in rows:
        prefix = f"piecewise/bucket_{r['bucket']}"
        metrics |= {f"{prefix}_steps": r["steps"], f"{prefix}_padded_tokens": r["padded_tokens"]}
        if r["mean_ms"] is not None:
            metrics[f"{prefix}_ms"] = r["mean_ms"]
    notes = [
        f"piecewise: {steps} prefill/mixed steps in token buckets (static segments {report['segments_run']}), "
        f"{report['decode_steps']} decode steps on the full graph, {uncaptured} steps left to the full graph"
    ]
    header = f"{'bucket':>7} {'steps':>6} {'tokens':>8} {'padded':>8} {'padding':>8} {'mean ms':>9} {'pool MiB':>9}"
    notes += [header, "-" * len(header)]
    for r in rows:
        mean = f"{r['mean_ms']:.2f}" if r["mean_ms"] is not None else "-"
        notes.append(
            f"{r['bucket']:>7} {r['steps']:>6} {r['tokens']:>8} {r['padded_tokens']:>8} "
            f"{r['padding_pct']:>7.1f}% {mean:>9} {r['pool_mb']:>9.1f}"
        )
    for reason, count in report["uncaptured"].items():
        notes.append(f"left to the full graph: {count} step(s), {reason}")
    if (
        report["suggested"] != report["buckets"]
        and report["suggested_padding_tokens"] < report["padding_tokens"]
    ):
        notes.append(
            f"suggested backend.piecewise_tokens=[{','.join(map(str, report['suggested']))}], fitted to "
            f"{report['suggested_from_steps']} step(s): {report['suggested_padding_tokens']} padding tokens "
            f"instead of {report['padding_tokens']} on these steps, runtime.max_num_tokens kept last, below "
            "it no more buckets and no larger a sum of sizes (the pool grows with it); fit it on a "
            "workload of the prompt lengths you serve (docs/capture-backends.md)"
        )
    return metrics, notes


def write_tokens(path: Path, requests: list[Request], generation: Generation) -> None:
    """The generated token ids and what each request waited, a request a line."""

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(1000 * seconds, 3)

    entries = [
        {
            "seq_id": r.seq_id,
            "prompt_len": len(r.prompt),
            "queue_ms": ms(generation.requests[r.seq_id].queue_s),
            "ttft_ms": ms(generation.requests[r.seq_id].ttft_s),
            "tpot_ms": ms(generation.requests[r.seq_id].tpot_s),
            "tokens": generation.tokens[r.seq_id],
        }
        for r in requests
    ]
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in entries) + "\n]\n")
