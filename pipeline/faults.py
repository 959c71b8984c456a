"""Fault injection for tests: `PIPELINE_INJECT_FAULT=<point>` makes that point raise, so failure
handling (fallbacks, FAILED runs, what is kept) is tested without a real broken compiler or GPU;
`PIPELINE_PAUSE_AT=<stage>` holds the run at the start of a stage, so a test can interrupt or kill
it exactly there."""

from __future__ import annotations

import os
import time


class InjectedFault(RuntimeError):
    pass


def maybe_fail(point: str) -> None:
    """`<point>` raises InjectedFault; `<point>_oom` raises the out-of-memory error CUDA would."""
    fault = os.environ.get("PIPELINE_INJECT_FAULT")
    if fault == point:
        raise InjectedFault(f"fault injected at {point} (PIPELINE_INJECT_FAULT)")
    if fault == f"{point}_oom":
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {point} by PIPELINE_INJECT_FAULT)")


def maybe_pause(stage: str, seconds: float = 120.0) -> None:
    if os.environ.get("PIPELINE_PAUSE_AT") == stage:
        time.sleep(seconds)
