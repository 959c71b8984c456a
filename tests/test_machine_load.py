"""The noise verdict: other processes' load during a timed block, and the spread of its steps."""

from __future__ import annotations

import subprocess
import sys
import time

from pipeline.runtime.machine_load import MachineLoad, noise_verdict, quantile


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
