"""Where each part stands against the machine: per module bucket (breakdown.module_buckets) and
phase, the weights it holds and the rates its device time reaches with them, against a roofline of
the run's own limits: the read limit it measured (`throughput/read_limit_gbs`) and the machine's
GEMM rate at the model's MLP shape (machine_load.gemm_tflops).

A step feeds each weight of a decoder part every token it runs (the prefill's prompt tokens, or
one per sequence in decode; the lm_head the rows it keeps, one per sequence), so a part does
2 x weights x tokens FLOPs over its weight bytes read once. Its roof is the lower of the GEMM rate
and that intensity times the read limit: a decode step's GEMVs are bound by the read, a long
prefill's GEMMs by the GEMM rate. `% of roof` is the part's FLOP/s against that roof; the part
furthest below its roof is the one to look at.

The counts are dense: a mixture of experts' part counts every expert (the routed ones are a
subset), the attention's own products (QK^T, PV) are not counted, and a vision tower's or
projector's tokens are patches, not the prompt's, so those get bytes and time only. The embedding
(one row read per token, not its table), the norms (a vector, no GEMM) and a container's own time
are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipeline.report.breakdown import MEASURABLE_US, bucket_of, module_buckets, part_of


@dataclass
class Roofs:
    read_gbs: float  # the read limit the run measured
    gemm_tflops: float  # the machine's GEMM rate at the model's shape and dtype
    prefill_tokens: int  # prompt tokens the profiled prefill step fed
    prefill_rows: int  # rows its lm_head computed (sequences completing their prompt)
    decode_batch: int  # sequences a profiled decode step ran (the most of any)


def weights(model: nn.Module, buckets: set[str]) -> dict[str, tuple[int, int]]:
    """Bucket -> (bytes, elements) of the parameters of its modules (a tied weight counts for each
    module that uses it: the lm_head reads its table whole)."""
    held: dict[str, tuple[int, int]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        bucket = bucket_of(name.rsplit(".", 1)[0] if "." in name else "", buckets)
        if bucket is not None:
            nbytes, count = held.get(bucket, (0, 0))
            held[bucket] = (nbytes + param.numel() * param.element_size(), count + param.numel())
    return held


def _tokens(bucket: str, tokens: int, rows: int) -> int | None:
    """The tokens a part's weights multiply in a step of `tokens` fed and `rows` kept."""
    part = part_of(bucket)
    if part == "lm_head":
        return rows
    return tokens if part in ("attention", "mlp") else None


_LEFT_OUT = re.compile(r"norm|^ln_|_ln$|embed")


def _counted(bucket: str) -> bool:
    return not (bucket.endswith(" (self)") or _LEFT_OUT.search(bucket.rsplit(".", 1)[-1]))


def roofline(phases: dict[str, Any], model: nn.Module, roofs: Roofs) -> dict[str, list[dict[str, Any]]]:
    """phase -> rows of the parts with weights and measurable time, furthest below the roof first:
    part, device_ms, weight_mb, gbs (weight bytes / time), tflops, bound (read or gemm) and
    pct_of_roof (None where FLOPs are not counted)."""
    steps = {"prefill": (roofs.prefill_tokens, roofs.prefill_rows), "decode": (roofs.decode_batch,) * 2}
    out: dict[str, list[dict[str, Any]]] = {}
    for phase, (tokens, rows_kept) in steps.items():
        if phase not in phases:
            continue
        times = module_buckets(phases[phase]["summary_stats"])
        rows = []
        for bucket, (nbytes, count) in weights(model, set(times)).items():
            us = times.get(bucket, 0.0)
            if us < MEASURABLE_US or not _counted(bucket):
                continue
            seconds = us * 1e-6
            row: dict[str, Any] = {"part": bucket, "device_ms": us / 1000, "weight_mb": nbytes / 2**20}
            row["gbs"] = nbytes / seconds / 1e9
            row.update(tflops=None, bound=None, pct_of_roof=None)
            if fed := _tokens(bucket, tokens, rows_kept):
                flops = 2 * count * fed
                read_roof = flops / nbytes * roofs.read_gbs / 1e3  # TFLOP/s the read limit allows
                row["tflops"] = flops / seconds / 1e12
                row["bound"] = "read" if read_roof < roofs.gemm_tflops else "gemm"
                row["pct_of_roof"] = 100 * row["tflops"] / min(read_roof, roofs.gemm_tflops)
            rows.append(row)
        rows.sort(key=lambda r: (r["pct_of_roof"] is None, r["pct_of_roof"] or 0.0))
        out[phase] = rows
    return out


def roofline_table(rows: list[dict[str, Any]], phase: str, roofs: Roofs) -> str:
    tokens = roofs.prefill_tokens if phase == "prefill" else roofs.decode_batch
    title = (
        f"{phase} ({tokens} token{'s' if tokens != 1 else ''} a step): each part against its roof (read limit "
        f"{roofs.read_gbs:.1f} GB/s, GEMM {roofs.gemm_tflops:.2f} TFLOP/s)"
    )
    header = f"{'part':<60} {'device ms':>10} {'weights MB':>11} {'GB/s':>8} {'TFLOP/s':>8} {'bound':>6} {'% of roof':>10}"
    lines = [title, header, "-" * len(header)]
    for r in rows:
        name = r["part"] if len(r["part"]) <= 60 else "..." + r["part"][-57:]
        line = f"{name:<60} {r['device_ms']:>10.3f} {r['weight_mb']:>11.2f} {r['gbs']:>8.2f}"
        if r["pct_of_roof"] is None:
            line += f" {'-':>8} {'-':>6} {'-':>10}"
        else:
            line += f" {r['tflops']:>8.4f} {r['bound']:>6} {r['pct_of_roof']:>9.1f}%"
        lines.append(line)
    return "\n".join(lines)
