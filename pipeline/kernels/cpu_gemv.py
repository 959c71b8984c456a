"""bfloat16 GEMV on CPU with AVX-512 BF16 (cpu_gemv.cpp), compiled at first use and cached.

Why: this CPU's bfloat16 `F.linear` (oneDNN's matmul) reads decode-size weights at 26-33 GB/s
where a float32 reduction reads 40-80 GB/s; a bfloat16 decode step of mistral3 ran at 90-95 % of
oneDNN's GEMV rate, about half the read bandwidth (`make bench`, 2026-12-01). For a single row of x
(batch 1) the kernel streams the weight at 33-36 GB/s where oneDNN reads 29-31, accumulating in
float32 and rounding to bfloat16 once at the end, as F.linear does; for 2-4 rows the same scheme
read 21-28 GB/s against oneDNN's 29-32 (measured side by side, 2026-12-01), so those stay with
F.linear. Built by torch.utils.cpp_extension (a C++ compiler and ninja) into torch's extension
cache: about 40 s the first time on this machine, then loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")


@functools.cache
def unsupported() -> str:
    """Why the kernel cannot be built and run here (one line), or '' when it can."""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return "no /proc/cpuinfo flags to check for AVX512-BF16"
    if "avx512_bf16" not in flags:
        return "this CPU has no AVX512-BF16 (vdpbf16ps)"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH to build the kernel"
    _venv_bin_on_path()
    if shutil.which("ninja") is None:
        return "no ninja on PATH to build the kernel (pip install ninja)"
    return ""


def _venv_bin_on_path() -> None:
    """The interpreter's own bin folder on PATH: pip's ninja lives there, and a venv's python run
    by its path (as `make` does) does not put it on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def _extension():
    reason = unsupported()
    if reason:
        raise RuntimeError(f"cpu_gemv: {reason}")
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]  # a changed source builds anew
    return load(
        name=f"pipeline_cpu_gemv_{digest}",
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
    )


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv takes x @ weight^T: bfloat16 on CPU, one row of x, an [N, K] weight with unit
    last stride, the kernel buildable here."""
    return (
        x.dtype == weight.dtype == torch.bfloat16
        and x.device.type == weight.device.type == "cpu"
        and x.numel() == x.shape[-1] > 0
        and weight.dim() == 2
        and weight.is_contiguous()
        and not unsupported()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] (one row) times weight [N, K]^T -> [..., N], bfloat16 on CPU."""
    out = _extension().gemv(x.reshape(-1), weight)  # [N]
    return out.view(*x.shape[:-1], out.shape[0])
