"""The machine's limits, measured in the same run as the rows that are compared with them."""

from __future__ import annotations

import statistics
import time

import torch

from pipeline.devices import sync
from pipeline.runtime.machine_load import read_gbs


class ReadLimit:
    """A large float32 reduction: bytes read / time, best of repeats (the limit is what the
    machine can do; slower repeats are interference). The buffer is allocated once, before any
    model is loaded (a buffer allocated into freshly freed memory read 4x lower here), and re-read
    whenever a round asks: the limit drifts 45-80 GB/s within half an hour on this machine, so it
    is measured beside the samples it divides."""

    def __init__(self, gib: float = 1.0, device: torch.device | None = None):
        self.device = device or torch.device("cpu")
        self.buffer = torch.ones(int(gib * 2**30) // 4, device=self.device)
        self.buffer.sum()  # pages touched

    def measure(self) -> float:
        return read_gbs(self.buffer)


def gemm_tflops(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """[m, k] x [k, n] at the model's shapes: 2mkn FLOPs / median time, the faster of ATen's matmul
    and, on CPU, oneDNN's inner product (the kernel onednn_linear runs; twice MKL's matmul here):
    the limit is the best GEMM the machine's libraries do, not the default one."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    kernels = [lambda: a @ b]
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        weight = b.t().contiguous()  # [n, k], as nn.Linear stores it
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], ""))
    best = 0.0
    for kernel in kernels:
        kernel()
        times = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            kernel()
            sync(device)
            times.append(time.perf_counter() - start)
        best = max(best, 2 * m * k * n / statistics.median(times) / 1e12)
    return best


def gemv_read_gbs(weight: torch.Tensor, repeats: int = 5) -> float:
    """A decode-step GEMV, [1, K] x weight [N, K]^T, with the kernel demollm's linears run for the
    weight's dtype (oneDNN's inner product for float32 on CPU, F.linear otherwise): weight bytes /
    time, best of repeats after a warm-up. The read rate one large matrix-vector product reaches;
    decode cannot read weights faster than its GEMVs do."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():

        def kernel():
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    else:

        def kernel():
            return torch.nn.functional.linear(x, weight)

    with torch.no_grad():
        kernel()
        times = []
        for _ in range(repeats):
            sync(weight.device)
            start = time.perf_counter()
            kernel()
            sync(weight.device)
            times.append(time.perf_counter() - start)
    return weight.numel() * weight.element_size() / min(times) / 1e9
