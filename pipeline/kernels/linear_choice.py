"""The faster kernel for a decode-size linear on CPU: each candidate timed on the call's own tensors
the first time a shape comes, the winner kept for the rest of the process.

Why: which kernel reads a weight fastest at one to a few rows depends on the host, by more than a
rule written on one host holds on the next:
- float32 on the Zen 1 host (AVX2, 2026-12-02/03): oneDNN's inner product made demollm's mistral3
  decode 0.73-0.78x Hugging Face eager, whose F.linear runs MKL's GEMM. On the AMX Xeon of
  2026-12-03, MKL's F.linear read [N, 5120] float32 weights at 30-54 GB/s at one and two rows
  against oneDNN's 22-48, and oneDNN won at four rows of the large ones (20.7 against 14.9 GB/s):
  demollm with oneDNN on every linear stepped 1.15x Hugging Face's time at batch 1, 0.71x at 4.
- bfloat16: the GEMV kernel (cpu_gemv.py) against oneDNN's bf16 matmul (F.linear) wins or loses
  by rows and shape, and F.linear is ATen's own loops where PyTorch has no oneDNN bf16.
Only calls of at most DECODE_ROWS rows are timed: they read the weight once and are bound by how
fast it streams, the quantity that differs between kernels and hosts. A prefill's GEMM keeps the
transform's kernel (every new prompt length would cost a timing of its own, each a second or more
of GEMM at mistral3's widths).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

DECODE_ROWS = 8  # the decode batches; also the GEMV kernel's largest row count
REPEATS = 3  # timed calls of each candidate, taking turns, after one untimed call each

# (kind, dtype, rows, N, K) -> index of the faster candidate
_chosen: dict[tuple, int] = {}


def rows(x: torch.Tensor) -> int:
    """Rows of x [..., K] as a linear sees them."""
    return x.numel() // max(x.shape[-1], 1)


def fastest(key: tuple, candidates: Sequence[Callable[[], torch.Tensor]]) -> int:
    """Index of the faster candidate for `key`, timed now if `key` is new (each candidate once
    untimed, for its first-call set-up, then REPEATS times taking turns, the median compared)."""
    if key not in _chosen:
        for run in candidates:
            run()
        times: list[list[float]] = [[] for _ in candidates]
        for _ in range(REPEATS):
            for run, samples in zip(candidates, times, strict=True):
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
        medians = [statistics.median(samples) for samples in times]
        _chosen[key] = medians.index(min(medians))
    return _chosen[key]
