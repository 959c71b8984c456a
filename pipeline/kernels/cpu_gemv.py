"""bfloat16 GEMV on CPU (cpu_gemv.cpp), compiled at first use for this CPU's instruction set and
cached.

Why: a decode step's linears read each weight once for a few rows of x, so they run at the rate a
weight streams from memory, and PyTorch's bfloat16 matmul can be far from it:
- with AVX512-BF16, oneDNN's bf16 matmul reads decode-size weights well below a float32
  reduction's rate; the kernel's vdpbf16ps path takes 1-4 rows of x a pass and streams near it;
- on an AVX2-only CPU (no oneDNN bf16) F.linear falls back to ATen's loops, several times slower
  than the read bandwidth; the kernel's AVX2 path reads one row at the reduction's rate and stays
  faster than F.linear up to a hundred rows or more. Yet only decode-size calls (up to
  linear_choice.DECODE_ROWS rows) take it: with prefills through it as well, mistral3's bfloat16
  image call moved past the correctness check's tolerance (the kernel and F.linear are equally
  close to a float64 product, one rounding each, so it is the summation order compounding through
  the model), and a run that fails its check measures nothing.
So which of the kernel and F.linear runs a decode-size call is timed per shape on the host itself
(pipeline::bf16_linear through linear_choice.py), not written down from one host. Llama-4 stores
its experts [K, N] (x @ W); `gemv_kn` streams them in that layout (each thread its own rows of W
into float32 partial sums), where ATen's bf16 matmul on an AVX2-only CPU reads well under 1 GB/s.
The figures are in BENCHMARKS.md (decode in bfloat16).
Built by torch.utils.cpp_extension (a C++ compiler and ninja) into torch's extension cache: tens of
seconds the first time, then loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from pipeline.kernels import host, linear_choice

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")


def cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    return frozenset(host.cpuinfo_field("flags").split())


def isa() -> str:
    """The instruction set the kernel is built for here: 'avx512_bf16', 'avx2' or '' (neither)."""
    flags = cpu_flags()
    if {"avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx2", "fma"} <= flags:
        return "avx512_bf16"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return ""


# compiler flags per instruction set; the AVX-512 build keeps the AVX2 paths (2-4 rows, [K, N])
_CFLAGS = {
    "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma"],
}


@functools.cache
def unsupported() -> str:
    """Why the kernel cannot be built and run here (one line), or '' when it can."""
    if not cpu_flags():
        return "no /proc/cpuinfo flags to check for AVX2 and FMA"
    if not isa():
        return "this CPU has neither AVX512-BF16 nor AVX2 with FMA"
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
        name=f"pipeline_cpu_gemv_{isa()}_{digest}",
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-fopenmp", *_CFLAGS[isa()]],  # OpenMP: at::parallel_for is a header
        extra_ldflags=["-fopenmp"],
    )


@functools.cache
def onednn_bf16() -> bool:
    """Whether PyTorch runs bfloat16 matmuls through oneDNN here (it needs AVX-512)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x times weight (either layout): bfloat16 on CPU, at most
    linear_choice.DECODE_ROWS rows of x, a contiguous 2-D weight, the kernel buildable here."""
    return (
        x.dtype == weight.dtype == torch.bfloat16
        and x.device.type == weight.device.type == "cpu"
        and 0 < linear_choice.rows(x) <= linear_choice.DECODE_ROWS
        and weight.dim() == 2
        and weight.is_contiguous()
        and not unsupported()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times weight [N, K]^T -> [..., N] (F.linear), bfloat16 on CPU."""
    out = _extension().gemv(x.reshape(-1, x.shape[-1]), weight)  # [B, N]
    return out.view(*x.shape[:-1], out.shape[-1])


def gemv_kn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times weight [K, N] -> [..., N] (x @ weight), bfloat16 on CPU."""
    out = _extension().gemv_kn(x.reshape(-1, x.shape[-1]), weight)  # [B, N]
    return out.view(*x.shape[:-1], out.shape[-1])
