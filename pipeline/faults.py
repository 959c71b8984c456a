"""Fault injection for tests: `PIPELINE_INJECT_FAULT=<point>` makes that point raise, so failure
handling (fallbacks, FAILED runs, what is kept) is tested without a real broken compiler or GPU."""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


def maybe_fail(point: str) -> None:
    if os.environ.get("PIPELINE_INJECT_FAULT") == point:
        raise InjectedFault(f"fault injected at {point} (PIPELINE_INJECT_FAULT)")
