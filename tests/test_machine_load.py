"""The noise verdict: other processes' load during a timed block, and the spread of its steps; the
read limit's two reads."""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest
import torch

from pipeline.runtime import machine_load
from pipeline.runtime.machine_load import MachineLoad, noise_verdict, quantile, read_gbs


def test_a_busy_process_beside_the_block_counts_as_other_load():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started
        with MachineLoad() as load:
            time.sleep(1.0)  # this process idles: what is busy is the other one
    finally:
        busy.kill()
        busy.wait()
    assert load.wall_s >= 1.0 and load.other_cores > 0.5


def test_noise_verdict():
    steady = [10.0] * 20
    assert noise_verdict(0.1, steady) == (False, "")
    noisy, why = noise_verdict(1.0, steady)  # both cores taken: steps slow but even
    assert noisy and "1.00 cores" in why
    noisy, why = noise_verdict(0.0, [10.0] * 10 + [30.0] * 3)
    assert noisy and "p90/p10" in why
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0 and quantile([1.0, 2.0], 0.9) == 1.9


@pytest.mark.parametrize("slowed", ["sum", "gemv"])
def test_the_read_limit_is_the_faster_of_the_reduction_and_the_gemv(monkeypatch, slowed):
    """Either read made slower, the limit is the other's rate: a buffer's limit is the best plain
    read of it, not whichever kernel drew a bad placement. The reads advance a clock of the test's
    own (1 ms a read, 50 ms slowed), so the rates are exact. The buffer's length is not a multiple
    of the GEMV's row, whose view leaves the tail out (and its bytes uncounted)."""
    buffer = torch.ones(1_000_000 + 5)  # 4 MB: 244 rows of 4096 and a tail
    now = types.SimpleNamespace(s=0.0)
    monkeypatch.setattr(machine_load, "time", types.SimpleNamespace(perf_counter=lambda: now.s))

    def taking(seconds, read):
        def timed(*args, **kwargs):
            now.s += seconds
            return read(*args, **kwargs)

        return timed

    sum_, linear = torch.Tensor.sum, torch.nn.functional.linear
    monkeypatch.setattr(torch.Tensor, "sum", taking(0.05 if slowed == "sum" else 0.001, sum_))
    monkeypatch.setattr(torch.nn.functional, "linear", taking(0.05 if slowed == "gemv" else 0.001, linear))
    read_bytes = {"sum": 244 * 4096 * 4, "gemv": buffer.numel() * 4}[slowed]  # the faster read's bytes
    assert read_gbs(buffer) == pytest.approx(read_bytes / 0.001 / 1e9)
