"""How busy the machine was with other work while a timed block ran, and whether a measurement is
trustworthy.

Other processes' CPU time during the block (system-wide busy CPU time less this process's own)
divided by the wall time: the mean number of cores others kept busy. With every core taken by
other processes, a tiny model's decode step waited out the scheduler's time slice each step, a
slow but steady step: the load is measured, not inferred from the spread. The
thresholds come from runs with and without busy processes beside them (docs/metrics.md, "Noise").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from pipeline.devices import sync

# A measurement is `noisy` when others kept this many cores busy on average during it ...
NOISY_OTHER_CORES = 0.5
# ... or when its steps spread this far (p90 / p10 of the timed decode steps).
NOISY_STEP_SPREAD = 1.5
MIN_SPREAD_STEPS = 5  # a spread of fewer steps says nothing


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            t = process.cpu_times()
        except psutil.Error:  # a peer that ended meanwhile
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _job_processes(peers: bool) -> list[psutil.Process]:
    """This process and, with peers (tensor-parallel ranks), its siblings: the other ranks its
    launcher started are the job's own work, not other processes."""
    me = psutil.Process()
    if not peers:
        return [me]
    try:
        return [me, *(p for p in me.parent().children() if p.pid != me.pid)]
    except (psutil.Error, AttributeError):  # no parent to ask
        return [me]


@dataclass
class MachineLoad:
    """with MachineLoad() as load: ...; then load.other_cores. peers: this process is one of a
    job's tensor-parallel ranks, whose sibling processes count as its own."""

    peers: bool = False
    wall_s: float = 0.0
    other_cores: float = 0.0

    def __enter__(self) -> MachineLoad:
        self._processes = _job_processes(self.peers)
        self._start = (time.perf_counter(), _busy_s(), _own_s(self._processes))
        return self

    def __exit__(self, *exc) -> None:
        wall0, busy0, own0 = self._start
        self.wall_s = time.perf_counter() - wall0
        others = (_busy_s() - busy0) - (_own_s(self._processes) - own0)
        self.other_cores = max(others, 0.0) / self.wall_s if self.wall_s > 0 else 0.0


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between the sorted values."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def noise_verdict(other_cores: float, step_ms: list[float]) -> tuple[bool, str]:
    """(noisy, why) for a timed block's load and its step times."""
    reasons = []
    if other_cores > NOISY_OTHER_CORES:
        reasons.append(f"other processes kept {other_cores:.2f} cores busy (> {NOISY_OTHER_CORES})")
    if len(step_ms) >= MIN_SPREAD_STEPS and quantile(step_ms, 0.1) > 0:
        spread = quantile(step_ms, 0.9) / quantile(step_ms, 0.1)
        if spread > NOISY_STEP_SPREAD:
            reasons.append(f"decode steps spread p90/p10 = {spread:.2f} (> {NOISY_STEP_SPREAD})")
    return bool(reasons), "; ".join(reasons)


# The GEMV read's row width: [rows, 4096] float32 rows of 16 KiB, as a wide linear's weight.
READ_ROW = 4096


def read_gbs(buffer: torch.Tensor, repeats: int = 3, pick: Callable[[list[float]], float] = min) -> float:
    """The read bandwidth now: bytes of `buffer` (float32, already touched) / time of the faster of
    two plain reads of it, a reduction (`sum`) and a one-row GEMV over it viewed as [rows, 4096]
    (F.linear: MKL's sgemv on CPU), each time picked from its repeats' (the best by default: slower
    repeats are interference).

    Why both: on some hosts the reduction read the first GiBs a process allocates markedly slower
    than later buffers while the GEMV read every buffer alike, so a reduction-only limit drew a
    speed from where its buffer landed (decode rows well over 100 % of it, by a different amount
    in each run). The limit is the rate the machine's libraries reach; which read
    reaches it differs by host."""
    rows = buffer.numel() // READ_ROW
    matrix = buffer[: rows * READ_ROW].view(rows, READ_ROW)  # [rows, 4096]
    x = torch.ones(1, READ_ROW, dtype=buffer.dtype, device=buffer.device)  # [1, 4096]
    reads = [(buffer.numel(), buffer.sum), (rows * READ_ROW, lambda: torch.nn.functional.linear(x, matrix))]
    best = 0.0
    for numel, read in reads:
        read()  # the GEMV's first call sets up its kernel
        times = []
        for _ in range(repeats):
            sync(buffer.device)
            start = time.perf_counter()
            read()
            sync(buffer.device)
            times.append(time.perf_counter() - start)
        best = max(best, numel * buffer.element_size() / pick(times) / 1e9)
    return best


def read_limit_gbs(device: torch.device, mib: int = 1024) -> float:
    """The read bandwidth measured at this moment, for a run's "% of bandwidth": a buffer larger
    than the caches (server CPUs have hundreds of MiB of L3), touched once, then read (well under a
    second)."""
    buffer = torch.ones(mib * 2**20 // 4, device=device)
    buffer.sum()
    return read_gbs(buffer)


def gemm_tflops(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 5,
    pick: Callable[[list[float]], float] = statistics.median,
    weight: torch.Tensor | None = None,
    warm_up: bool = True,
) -> float:
    """[m, k] x [k, n] at the model's shapes: 2mkn FLOPs / the picked time (the median by default;
    `min` for a roof: slower repeats are interference), the faster of ATen's linear and, on CPU,
    oneDNN's inner product (the kernel onednn_linear runs, often faster than MKL's): the limit is
    the best GEMM the machine's libraries do, not the default one. weight: an [n, k] tensor to
    multiply (a model's own, as nn.Linear stores it), else one of ones is made. warm_up=False:
    the first call is timed too (with pick=min a slower first call costs nothing but its time)."""
    a = torch.ones(m, k, dtype=dtype, device=device)
    if weight is None:
        weight = torch.ones(n, k, dtype=dtype, device=device)
    kernels = [lambda: torch.nn.functional.linear(a, weight)]
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and weight.is_contiguous():
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], ""))
    best = 0.0
    for kernel in kernels:
        if warm_up:
            kernel()
        times = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            kernel()
            sync(device)
            times.append(time.perf_counter() - start)
        best = max(best, 2 * m * k * n / pick(times) / 1e12)
    return best
