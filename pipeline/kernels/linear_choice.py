"""The faster kernel for a decode-size linear on CPU: each candidate timed on the call's own tensors
the first time a shape comes on this host, the winner kept for every later call and process here.

Why: which kernel reads a weight fastest at one to a few rows depends on the host, by more than a
rule written on one host holds on the next:
- float32: oneDNN's inner product beat MKL's F.linear at every decode size on some hosts; on
  others MKL read the same weights faster at one and two rows and oneDNN won at four, so oneDNN on
  every linear made a batch-1 decode step slower than Hugging Face's.
- bfloat16: the GEMV kernel (cpu_gemv.py) against oneDNN's bf16 matmul (F.linear) wins or loses
  by rows and shape, and F.linear is ATen's own loops where PyTorch has no oneDNN bf16; Llama-4's
  [K, N] experts: the kernel's [K, N] GEMV lost to oneDNN's matmul on one AVX-512 host and beat
  it by 2-3x on another (ops._expert_gemv).
Only calls of at most DECODE_ROWS rows are timed: they read the weight once and are bound by how
fast it streams, the quantity that differs between kernels and hosts. A prefill's GEMM keeps the
transform's kernel (every new prompt length would cost a timing of its own, each a second or more
of GEMM at mistral3's widths).

The choices are kept on disk per host (CPU model and flags, torch version, threads), in
$PIPELINE_KERNEL_CACHE or ~/.cache/pipeline, and every later process on the host reads them: two
kernels sum in different orders, and a choice timed anew in each process made the bench's three
processes of llama4_scout route different experts from the same random weights.
Delete the file to time them again.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pipeline.kernels import host

DECODE_ROWS = 8  # the decode batches; also the GEMV kernel's largest row count
REPEATS = 3  # timed calls of each candidate, taking turns, after one untimed call each
CACHE_ENV = "PIPELINE_KERNEL_CACHE"

# "kind|dtype|rows|N|K" -> index of the faster candidate; read from cache_path() at first use
_chosen: dict[str, int] | None = None


def rows(x: torch.Tensor) -> int:
    """Rows of x [..., K] as a linear sees them."""
    return x.numel() // max(x.shape[-1], 1)


GEMV_SOURCE = Path(__file__).with_name("cpu_gemv.cpp")  # the pipeline's own kernel, a candidate


def cache_path() -> Path:
    """This host's file of choices: the same CPU, torch, thread count and GEMV kernel source time
    the same (a changed kernel is timed again)."""
    machine = "|".join(
        (
            host.cpuinfo_field("model name"),
            host.cpuinfo_field("flags"),
            torch.__version__,
            str(torch.get_num_threads()),
            hashlib.sha256(GEMV_SOURCE.read_bytes()).hexdigest(),
        )
    )
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pipeline")
    return root / f"linear_choice-{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json"


def fastest(key: tuple, candidates: Sequence[Callable[[], torch.Tensor]]) -> int:
    """Index of the faster candidate for `key` (kind, dtype, rows, N, K): this host's earlier
    choice, else timed now (each candidate once untimed, for its first-call set-up, then REPEATS
    times taking turns, the medians compared) and kept."""
    global _chosen
    if _chosen is None:
        _chosen = _read(cache_path())
    name = "|".join(map(str, key))
    if name not in _chosen:
        for run in candidates:
            run()
        times: list[list[float]] = [[] for _ in candidates]
        for _ in range(REPEATS):
            for run, samples in zip(candidates, times, strict=True):
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
        medians = [statistics.median(samples) for samples in times]
        _chosen[name] = medians.index(min(medians))
        _write(cache_path(), name, _chosen[name])
    return _chosen[name]


def _read(path: Path) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _write(path: Path, name: str, choice: int) -> None:
    """Add one choice to the file, keeping what other processes wrote meanwhile; written whole
    and renamed into place, so a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = _read(path) | {name: choice}
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(kept, indent=1, sort_keys=True))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only home: the choice still holds for this process
