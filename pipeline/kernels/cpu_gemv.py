"""bfloat16 GEMV on CPU (cpu_gemv.cpp), compiled at first use for this CPU's instruction set and
cached.

Why: a decode step's linears read each weight once for a few rows of x, so they run at the rate a
weight streams from memory, and PyTorch's bfloat16 matmul is far from it on this machine's CPUs:
- on a host with AVX512-BF16 (2026-12-01), oneDNN's bf16 matmul read decode-size weights at
  26-33 GB/s where a float32 reduction read 40-80; the kernel's vdpbf16ps path streamed one row at
  33-36 GB/s, and 2-4 rows (then through the AVX2 path) read 21-28 GB/s against oneDNN's 29-32;
  on an AMX Xeon (2026-12-03; a reduction read 30) the vdpbf16ps path, now taking 1-4 rows, read
  28-31 GB/s at one row and 23-28 at four where oneDNN read 15-23, and lost at eight (two passes
  of four: 11-13);
- on an AVX2-only host (the same VM on 2026-12-02, a Zen 1 EPYC: no AVX-512, no oneDNN bf16),
  F.linear falls back to ATen's loops: 11 GB/s at one row and 2.9 GB/s at four ([16384, 5120],
  [5120, 8192], [32768, 5120]) where a float32 reduction reads 21-22 and oneDNN's float32 GEMV
  24-26. The kernel's AVX2 path reads 20.9-21.4 GB/s at one row (the reduction's rate), 15-17 at
  two, 9.7-9.9 at four (near the FMA units' limit: oneDNN's float32 GEMV reads 8.5 at four rows),
  and stays 3x faster than F.linear up to 128 rows ([5120, 5120]: 184 ms against 584). Yet only
  decode-size calls (up to linear_choice.DECODE_ROWS rows) take it: with prefills through it
  as well, mistral3's bfloat16 image call moved by 0.31 in the logits from the eager model's
  (the correctness check's tolerance 0.16; the kernel and F.linear are equally close to a float64
  product, one rounding each, so it is the summation order compounding through the model), and a
  run that fails its check measures nothing.
So which of the kernel and F.linear runs a decode-size call is timed per shape on the host itself
(pipeline::bf16_linear through linear_choice.py), not written down from one of these hosts.
Llama-4 stores its experts [K, N] (x @ W); `gemv_kn` streams them in that layout (each thread its
own rows of W into float32 partial sums): 20.7-21.7 GB/s at one row, 10.2-10.5 at four, where
ATen's bf16 matmul took 1.9 s for one [5120, 16384] expert (0.09 GB/s) on the AVX2 host.
Built by torch.utils.cpp_extension (a C++ compiler and ninja) into torch's extension cache: about
40 s the first time on this machine, then loaded.
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
