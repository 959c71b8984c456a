"""Where each part stands against the machine: per module slice (parts.module_slices) and
phase, the work its weights do in the profiled step and the least time the machine needs for it,
from limits measured beside the profiled steps (stages/profile.py): the read limit
(machine_load.read_limit_gbs) and the GEMM rate at each of the part's own GEMM shapes as the step
runs them (its weights as the graph holds them, fused or not; machine_load.gemm_tflops, the best
of its repeats).

A part's roof is the longer of two times, each a lower bound on its work:
- read: the bytes it must read once (its weights, or in mixture-of-experts layers the experts the
  step's tokens can reach at most; and for attention the KV cache the step's sequences hold,
  reached through a sliding window where the config has one) over the read limit;
- GEMM: each weight's 2 x m x k x n FLOPs over the machine's rate at that shape, summed. m is the
  tokens the step fed (one per sequence in decode; the lm_head's rows kept). Each side of the
  measured GEMM is at least GEMM_FLOOR, since a tiny model's GEMM times its call, not the machine;
  decode's GEMMs take the prefill's rates (a GEMM with more rows runs at least as fast).
`% of roof` is roof time / the part's device time. A part faster than its roof is a roof error
(the limits were measured too low, or the part's kernel beats the library's), printed with both
figures, never as a percent above 100.

Counted: the decoder layers' attention (projections and KV cache; QK^T and PV are not counted, so
the bound stays one), MLP and lm_head. A vision tower's or projector's tokens are patches, not the
prompt's, and the embedding (one row read per token), the norms (a vector) and a container's own
time read no weights of their own at a known rate: those rows give time and weights only.
Sizes are MiB (2^20 bytes); rates GB/s (10^9 bytes per second) and TFLOP/s.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.profiler.parts import MEASURABLE_US, module_slices, part_of, slice_of
from pipeline.profiler.rows import Phases, RoofRow

GEMM_FLOOR = 64  # smallest side of a measured GEMM
COUNTED = ("attention", "mlp", "lm_head")


@dataclass
class StepShape:
    tokens: int  # tokens the step fed: a GEMM's rows
    rows: int  # rows its lm_head computed (sequences completing a prompt, or decoding)
    context: float  # tokens whose keys and values its attention reads, summed over sequences
    sequences: int


@dataclass
class Roofs:
    read_gbs: float  # the read limit, measured beside the profiled steps
    steps: dict[str, dict[str, float]]  # phase -> StepShape's fields
    gemm_tflops: dict[str, float] = field(default_factory=dict)  # "m,k,n" -> the best rate measured
    kv_token_bytes: int = 0  # one token's keys and values in one attention layer
    experts_per_token: int = 0  # routed experts per token (0: a dense model)
    window: int = 0  # the sliding window of the attention (0: none)

    def shape(self, phase: str) -> StepShape:
        return StepShape(**self.steps[phase])


def measured_shape(m: int, k: int, n: int) -> str:
    """The key of the GEMM a [m, k] x [k, n] product is set against."""
    return ",".join(str(max(GEMM_FLOOR, side)) for side in (m, k, n))


_LAYER = re.compile(r"\.layers\.(\d+)\.")
_LEFT_OUT = re.compile(r"norm|^ln_|_ln$|embed")


def _counted(slice_: str) -> bool:
    return not (slice_.endswith(" (self)") or _LEFT_OUT.search(slice_.rsplit(".", 1)[-1]))


@dataclass
class PartWork:
    """What a part's weights do in one step."""

    weight_bytes: int = 0  # every weight it holds
    read_bytes: float = 0.0  # what the step must read at least: weights it reaches, KV cache
    kv_bytes: float = 0.0
    flops: float = 0.0
    gemms: list[tuple[int, int, int, float]] = field(default_factory=list)  # (m, k, n, how many)
    layers: set[str] = field(default_factory=set)


def work(model: nn.Module, slices: set[str], phase: str, roofs: Roofs) -> dict[str, PartWork]:
    """Slice -> its weights' work in the phase's profiled step (a tied weight counts for each
    module that uses it: the lm_head reads its table whole)."""
    step = roofs.shape(phase)
    out: dict[str, PartWork] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module = name.rsplit(".", 1)[0] if "." in name else ""
        slice_ = slice_of(module, slices)
        if slice_ is None:
            continue
        part = out.setdefault(slice_, PartWork())
        nbytes = param.numel() * param.element_size()
        part.weight_bytes += nbytes
        if (layer := _LAYER.search("." + module + ".")) is not None:
            part.layers.add(layer.group(1))
        if part_of(slice_) not in COUNTED or not _counted(slice_) or param.dim() < 2:
            part.read_bytes += nbytes  # a bias, or a part whose rate is not counted
            continue
        m = step.rows if part_of(slice_) == "lm_head" else step.tokens
        n, k = param.shape[-2], param.shape[-1]
        if param.dim() == 3 and roofs.experts_per_token:  # [E, n, k]: routed experts
            experts = param.shape[0]
            routed = m * roofs.experts_per_token
            reached = min(experts, routed)
            part.read_bytes += nbytes * reached / experts
            part.flops += 2 * routed * n * k
            part.gemms.append((math.ceil(routed / experts), k, n, reached))
        else:
            count = math.prod(param.shape[:-2])
            part.read_bytes += nbytes
            part.flops += 2 * m * n * k * count
            part.gemms.append((m, k, n, count))
    for slice_, part in out.items():
        if part_of(slice_) == "attention" and "cross" not in slice_ and roofs.kv_token_bytes:
            context = step.context
            if roofs.window:
                context = min(context, roofs.window * step.sequences)
            part.kv_bytes = context * roofs.kv_token_bytes * max(len(part.layers), 1)
            part.read_bytes += part.kv_bytes
    return out


_LAYER_CHILD = re.compile(r"^(.*\.layers)\.\d+\.([^.]+)")


def gemm_shapes(model: nn.Module, roofs: Roofs) -> dict[str, tuple[int, int, int, torch.Tensor | None]]:
    """The GEMMs the prefill's counted parts run, as the profile stage measures them: measured_shape
    -> (m, k, n, a weight of that shape to multiply, or None where a side is below GEMM_FLOOR and
    the measured GEMM is larger than any weight)."""
    if "prefill" not in roofs.steps:
        return {}
    slices = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        module = name.rsplit(".", 1)[0] if "." in name else ""
        child = _LAYER_CHILD.match(module)  # a decoder layer's child, as module_slices has it
        slices.add(f"{child.group(1)}.*.{child.group(2)}" if child else module)
    by_shape = {
        (param.shape[-1], param.shape[-2]): param
        for param in model.parameters()
        if param.dim() >= 2 and min(param.shape[-2:]) >= GEMM_FLOOR
    }
    shapes = {}
    for part in work(model, slices, "prefill", roofs).values():
        for m, k, n, _ in part.gemms:
            weight = by_shape.get((k, n))
            weight = weight.detach().reshape(-1, n, k)[0] if weight is not None else None
            sides = (max(GEMM_FLOOR, m), max(GEMM_FLOOR, k), max(GEMM_FLOOR, n))
            shapes[measured_shape(m, k, n)] = (*sides, weight)
    return shapes


def _gemm_s(gemms: list[tuple[int, int, int, float]], roofs: Roofs, decode: bool) -> float:
    """The least time the part's GEMMs take at the measured rates; a decode GEMM at the best rate
    measured for its weight's shape (at the prefill's rows: a GEMM with more rows runs at least as
    fast)."""
    by_weight: dict[tuple[int, int], float] = {}
    for key, rate in roofs.gemm_tflops.items():
        _, k, n = (int(side) for side in key.split(","))
        by_weight[(k, n)] = max(by_weight.get((k, n), 0.0), rate)
    total = 0.0
    for m, k, n, count in gemms:
        key = measured_shape(m, k, n)
        rate = (
            by_weight.get((max(GEMM_FLOOR, k), max(GEMM_FLOOR, n))) if decode else roofs.gemm_tflops.get(key)
        )
        if rate:
            total += 2 * m * k * n * count / (rate * 1e12)
    return total


def roofline(phases: Phases, model: nn.Module, roofs: Roofs) -> dict[str, list[RoofRow]]:
    """phase -> rows of the parts with weights and measurable time, furthest below the roof first:
    part, device_ms, weight_mib, kv_mib (attention's KV cache read), gbs (bytes read / time: counted
    parts only), tflops, bound (read or gemm), roof_ms, pct_of_roof, roof_error (the part beat the
    roof: no percent)."""
    out: dict[str, list[RoofRow]] = {}
    for phase in ("prefill", "decode"):
        if phase not in phases or phase not in roofs.steps:
            continue
        times = module_slices(phases[phase].summary_stats)
        rows = []
        for slice_, part in work(model, set(times), phase, roofs).items():
            us = times.get(slice_, 0.0)
            if us < MEASURABLE_US or not _counted(slice_) or not part.weight_bytes:
                continue
            seconds = us * 1e-6
            row = RoofRow(slice_, us / 1000, part.weight_bytes / 2**20, part.kv_bytes / 2**20)
            if part.flops and part_of(slice_) in COUNTED:
                read_s = part.read_bytes / (roofs.read_gbs * 1e9)
                gemm_s = _gemm_s(part.gemms, roofs, phase == "decode")
                roof_s = max(read_s, gemm_s)
                row.gbs = part.read_bytes / seconds / 1e9
                row.tflops = part.flops / seconds / 1e12
                row.bound = "read" if read_s >= gemm_s else "gemm"
                row.roof_ms = roof_s * 1000
                if seconds < roof_s:
                    row.roof_error = True
                else:
                    row.pct_of_roof = 100 * roof_s / seconds
            rows.append(row)
        rows.sort(key=lambda r: (not r.roof_error, r.pct_of_roof is None, r.pct_of_roof or 0.0))
        out[phase] = rows
    return out


def roofline_table(rows: list[RoofRow], phase: str, roofs: Roofs) -> str:
    step = roofs.shape(phase)
    title = (
        f"{phase} ({step.tokens} token{'s' if step.tokens != 1 else ''} fed, {step.context:.0f} in the KV cache "
        f"read a step): each part against its roof (read limit {roofs.read_gbs:.1f} GB/s; GEMM rates at "
        f"{len(roofs.gemm_tflops)} shapes, {min(roofs.gemm_tflops.values(), default=0):.2f}-"
        f"{max(roofs.gemm_tflops.values(), default=0):.2f} TFLOP/s)"
    )
    header = (
        f"{'part':<56} {'device ms':>10} {'weights MiB':>12} {'KV MiB':>8} {'GB/s':>8} {'TFLOP/s':>8} "
        f"{'bound':>6} {'roof ms':>9} {'% of roof':>10}"
    )
    lines = [title, header, "-" * len(header)]
    for r in rows:
        name = r.part if len(r.part) <= 56 else "..." + r.part[-53:]
        line = f"{name:<56} {r.device_ms:>10.3f} {r.weight_mib:>12.2f} {r.kv_mib:>8.2f}"
        if r.roof_ms is None:
            line += f" {'-':>8} {'-':>8} {'-':>6} {'-':>9} {'-':>10}"
        else:
            line += f" {r.gbs:>8.2f} {r.tflops:>8.4f} {r.bound:>6} {r.roof_ms:>9.3f}"
            line += (
                f"  ROOF ERROR: {r.device_ms:.3f} ms < roof {r.roof_ms:.3f} ms"
                if r.roof_error
                else f" {r.pct_of_roof:>9.1f}%"
            )
        lines.append(line)
    lines.append(
        "weights: every weight the part holds; KV: the keys and values its attention reads; GB/s: the "
        "bytes the step must read (the weights it reaches, the KV cache) / its device time"
    )
    return "\n".join(lines)
