"""The machine's limits, measured in the same run as the rows that are compared with them."""

from __future__ import annotations

import statistics
import time

import torch

import pipeline.ops  # noqa: F401  (registers pipeline::onednn_linear and bf16_linear)
from pipeline.devices import sync
from pipeline.runtime.machine_load import read_gbs


class ReadLimit:
    """A large float32 buffer read plainly (the faster of a reduction and a one-row GEMV over it,
    machine_load.read_gbs): bytes read / median time over `repeats` reads of each (about 1.4 s, as
    long as a decode sample: the best of three short reads picked a shared machine's fast phases,
    which the samples beside it did not see). The buffer is allocated once, before any model is
    loaded (a buffer allocated into freshly freed memory read several times lower), and re-read
    whenever a round asks: the limit drifts by tens of percent within an hour, so it is measured
    beside the samples it divides."""

    def __init__(self, gib: float = 1.0, device: torch.device | None = None, repeats: int = 15):
        self.device = device or torch.device("cpu")
        self.buffer = torch.ones(int(gib * 2**30) // 4, device=self.device)
        self.buffer.sum()  # pages touched
        self.repeats = repeats

    def measure(self) -> float:
        return read_gbs(self.buffer, self.repeats, statistics.median)


def _decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel demollm's linears run for the weight's dtype: pipeline::onednn_linear for float32
    on CPU (the onednn_linear transform: oneDNN's inner product, or F.linear where it was timed
    faster for the shape), pipeline::bf16_linear for bfloat16 on CPU (bf16_gemv: the GEMV kernel
    or F.linear, as timed), F.linear otherwise. x: [B, K]; weight: [N, K]."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return torch.ops.pipeline.onednn_linear(x, weight, None)
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        return torch.ops.pipeline.bf16_linear(x, weight, None)
    return torch.nn.functional.linear(x, weight)


class WeightPass:
    """Every weight a step reads, multiplied by a [batch, K] input with demollm's kernel, back to
    back: the limit a step of these weights meets when nothing but its linears runs. A step follows
    the linears it is made of more closely than a reduction or one GEMM does: the reduction's rate
    moved by up to 30 % within seconds where a step's GEMVs did not follow it.

    Decode (batch = the batch): weight bytes / median time over `repeats` passes (as many as a
    decode sample has steps, so that the pass sees the machine's fast and slow phases as a sample
    does). Prefill (batch = the prompt's tokens): the pass's seconds beside the prefill's."""

    def __init__(self, weights: list[torch.Tensor], batch: int, repeats: int = 8):
        self.weights = [
            w.detach() for w in weights if w.dim() == 2
        ]  # [N, K]; norms (1-D) left out: under 0.1 % of the bytes
        self.bytes = sum(w.numel() * w.element_size() for w in self.weights)
        self.inputs = {
            k: torch.randn(batch, k, dtype=self.weights[0].dtype, device=self.weights[0].device)
            for k in {w.shape[1] for w in self.weights}
        }
        self.repeats = repeats

    def seconds(self) -> float:
        """Median time of one pass over every weight."""
        device = self.weights[0].device
        times = []
        with torch.no_grad():
            for _ in range(self.repeats):
                sync(device)
                start = time.perf_counter()
                for weight in self.weights:
                    _decode_linear(self.inputs[weight.shape[1]], weight)
                sync(device)
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def measure(self) -> float:
        """GB/s: the weights' bytes over a pass's time."""
        return self.bytes / self.seconds() / 1e9
