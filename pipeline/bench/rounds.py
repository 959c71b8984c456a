"""Rounds: every runner that is compared with another, and the machine's limit, take turns.

On a shared machine both sides of a ratio drift, by more than any difference worth measuring: the
same decode step and the same large read move by tens of percent within an hour. So a round measures the
limit, then one sample of every runner, then the limit again (the round's limit is the mean of the
two); a ratio (runner / reference, runner / limit) is taken within each round, where the drift is
shared, and a row reports the median of those per-round ratios with their p10-p90 spread. Round 0
warms up (and compiles) and is dropped. A limit is measured like the samples it divides: a median
over as many repeats as a sample has steps, not the best of a few.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.runtime.machine_load import quantile

# A row whose per-round ratio spreads wider than this (p90 / p10) is marked noisy, not a result.
# Set from rounds of small_mistral with and without busy processes beside the bench: quiet rounds'
# ratios spread below it, disturbed ones above it.
NOISY_ROUND_SPREAD = 1.2

Sample = tuple[float, float]  # (decode step s, prefill s)


@dataclass
class Round:
    samples: dict[str, Sample] = field(default_factory=dict)
    # each limit's mean of the values measured before and after the samples
    limits: dict[str, float] = field(default_factory=dict)


def spread(values: list[float]) -> dict[str, float]:
    """median, p10, p90 (and n) of a list of values."""
    return {
        "median": statistics.median(values),
        "p10": quantile(values, 0.1),
        "p90": quantile(values, 0.9),
        "n": len(values),
    }


def is_noisy(values: dict[str, float]) -> bool:
    return values["p10"] > 0 and values["p90"] / values["p10"] > NOISY_ROUND_SPREAD


def take_turns(
    runners: dict[str, Callable[[], Sample]],
    repeats: int,
    limits: dict[str, Callable[[], float]] | None = None,
    warm_up: bool = True,
) -> tuple[list[Round], dict[str, str]]:
    """`repeats` rounds after a warm-up round (none when each sample is its own fresh process):
    each limit, one sample of each runner, each limit again. Returns the rounds and each failed
    runner's error (a runner that fails is reported, not allowed to hide the others)."""
    from pipeline.errors import short_cause

    limits = limits or {}
    rounds: list[Round] = []
    errors: dict[str, str] = {}
    warm_ups = 1 if warm_up else 0
    for number in range(repeats + warm_ups):
        kept = number >= warm_ups
        before = {name: measure() for name, measure in limits.items()} if kept else {}
        current = Round()
        for runner, sample in runners.items():
            if runner in errors:
                continue
            try:
                current.samples[runner] = sample()
            except Exception as exc:  # recorded in the table
                errors[runner] = short_cause(exc)
        if kept:
            current.limits = {name: (before[name] + measure()) / 2 for name, measure in limits.items()}
            rounds.append(current)
    return rounds, errors


def row(
    rounds: list[Round],
    runner: str,
    reference: str | None = None,
    read_bytes: int = 0,
    limits: dict[str, str] | None = None,
) -> dict:
    """One runner's row: decode and prefill ms, and per round its ratio to the reference runner
    (`vs_reference`: runner step / reference step) and its read rate as a percent of that
    round's limits (`limits`: figure -> the round's limit, e.g. {"read": "read"} gives
    `pct_of_read`; with read_bytes); each as a spread."""
    mine = [r for r in rounds if runner in r.samples]
    decode = [r.samples[runner][0] for r in mine]
    result = {
        "runner": runner,
        "decode_ms": spread([1000 * s for s in decode]),
        "prefill_ms": spread([1000 * r.samples[runner][1] for r in mine]),
    }
    if reference and reference != runner:
        paired = [r for r in mine if reference in r.samples]
        if paired:
            result["vs_reference"] = spread([r.samples[runner][0] / r.samples[reference][0] for r in paired])
    if read_bytes:
        result["gbs"] = spread([read_bytes / s / 1e9 for s in decode])
        for figure, limit in (limits or {}).items():
            result[f"pct_of_{figure}"] = spread(
                [100 * read_bytes / s / 1e9 / r.limits[limit] for s, r in zip(decode, mine, strict=True)]
            )
    # which of its results spread too wide to stand (the ratio to the reference, the percents of limits)
    result["noisy_figures"] = [
        k
        for k in ("vs_reference", *(f"pct_of_{f}" for f in limits or {}))
        if k in result and is_noisy(result[k])
    ]
    result["noisy"] = bool(result["noisy_figures"])
    return result


def shown(values: dict[str, float], digits: int = 2, unit: str = "") -> str:
    """`median (p10-p90)` as a table cell."""
    return f"{values['median']:.{digits}f}{unit} ({values['p10']:.{digits}f}-{values['p90']:.{digits}f})"
