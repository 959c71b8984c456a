"""The waterfall's data (pipeline/waterfall.py measures it): the steps from eager to captured, each
profiled once per round, each step's change and share of the whole change per phase, the step at
which each part first drifted, and the printed table.

Statistics, per phase:
- a step's time: the median of its rounds, with p10-p90;
- a step's change: (the previous step's ms - its ms) taken within each round, where the host's
  drift is shared, then the median and p10-p90 of those; NOISY when that p10-p90 holds 0 (the
  change is inside the rounds' spread), as the bench marks rows;
- the whole change: the sum of the steps' median changes, so the steps add up to it;
- a step's share: its median change over the absolute whole change, with its own sign. A step
  that costs time is negative whether the whole is a gain or a loss, so the shares add up to +1
  for a gain and -1 for a loss.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.runtime.machine_load import quantile

PHASES = ("prefill", "decode")
# An untouched part whose median moved by more than its rounds' spread and this fraction of its
# time says the host, not a step, changed it.
UNTOUCHED_TOLERANCE = 0.10


@dataclass
class Stat:
    """The median and p10-p90 of a figure's rounds."""

    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        return cls(statistics.median(values), quantile(values, 0.1), quantile(values, 0.9))

    @property
    def holds_zero(self) -> bool:
        return self.p10 <= 0.0 <= self.p90


@dataclass
class Step:
    name: str
    cost_s: float  # apply seconds of its transforms, or the capture stage's compile seconds
    memory_mib: float  # memory it added
    drifted: list[str] = field(default_factory=list)  # parts past tolerance at this step
    nodes: int = 0  # nodes of the captured graphs after it (0: eager)
    # phase -> device ms per step, one value per round
    phase_ms: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    # phase -> part (parts.PARTS) -> device ms per step, one value per round
    part_ms: dict[str, dict[str, list[float]]] = field(default_factory=lambda: {p: {} for p in PHASES})

    def add_round(self, phase_ms: dict[str, float], part_ms: dict[str, dict[str, float]]) -> None:
        for phase in PHASES:
            self.phase_ms[phase].append(phase_ms[phase])
            for part, ms in part_ms[phase].items():
                self.part_ms[phase].setdefault(part, []).append(ms)

    def time(self, phase: str) -> Stat:
        return Stat.of(self.phase_ms[phase])

    def part_median(self, phase: str) -> dict[str, float]:
        return {part: statistics.median(ms) for part, ms in self.part_ms[phase].items()}


@dataclass
class Waterfall:
    steps: list[Step] = field(default_factory=list)
    last_memory: float = 0.0
    # Parts no step changes (outside every graph, rewritten by no model-scope pass): set by the
    # waterfall before its rounds
    untouched: list[str] = field(default_factory=list)
    # The profile's captured-vs-eager ratio per phase, where the profile stage measured one
    profile_speedup: dict[str, float] = field(default_factory=dict)
    # What each step runs, beside steps (pipeline/waterfall.py): None for eager, else a snapshot of
    # the model's graphs and module tables; never serialized
    programs: list[Any] = field(default_factory=list, repr=False)

    @property
    def rounds(self) -> int:
        return min((len(s.phase_ms["decode"]) for s in self.steps), default=0)

    def changes(self, phase: str) -> list[Stat | None]:
        """Each step's change (previous - this, ms per step) within each round; None for eager."""
        out: list[Stat | None] = [None]
        for before, after in itertools.pairwise(self.steps):
            out.append(
                Stat.of([b - a for b, a in zip(before.phase_ms[phase], after.phase_ms[phase], strict=True)])
            )
        return out

    def whole(self, phase: str) -> float:
        """The whole change (ms per step, > 0 a gain): the sum of the steps' median changes."""
        return sum(c.median for c in self.changes(phase)[1:])

    def shares(self, phase: str) -> list[float | None]:
        """Each step's median change over the absolute whole change, with its own sign; None for
        eager. They add up to +1 for a gain, -1 for a loss (0 each when nothing changed)."""
        total = abs(self.whole(phase))
        return [None] + [c.median / total if total else 0.0 for c in self.changes(phase)[1:]]

    def noisy(self, phase: str) -> list[bool]:
        """Per step: its change is inside the rounds' spread (its p10-p90 holds 0)."""
        return [False] + [c.holds_zero for c in self.changes(phase)[1:]]

    def speedup(self, phase: str) -> Stat:
        """eager / last step, within each round."""
        first, last = self.steps[0], self.steps[-1]
        return Stat.of(
            [e / c for e, c in zip(first.phase_ms[phase], last.phase_ms[phase], strict=True) if c > 0]
        )

    def first_drift(self) -> dict[str, str]:
        """Part -> the step at which it first passed tolerance."""
        first: dict[str, str] = {}
        for step in self.steps:
            for part in step.drifted:
                first.setdefault(part, step.name)
        return first

    def warnings(self) -> list[str]:
        """What the rounds cannot vouch for: an untouched part that moved beyond its spread (the host
        changed it), and a profile captured-vs-eager ratio outside the waterfall's p10-p90."""
        said = []
        for phase in PHASES:
            eager = self.steps[0]
            for part in self.untouched:
                base = eager.part_ms[phase].get(part)
                if not base or statistics.median(base) <= 0:
                    continue
                for step in self.steps[1:]:
                    values = step.part_ms[phase].get(part, [0.0] * len(base))
                    moved = Stat.of([b - v for b, v in zip(base, values, strict=True)])
                    spread = max(
                        Stat.of(base).p90 - Stat.of(base).p10, Stat.of(values).p90 - Stat.of(values).p10
                    )
                    if abs(moved.median) > max(spread, UNTOUCHED_TOLERANCE * statistics.median(base)):
                        said.append(
                            f"{phase}: {part}, which no step touches, went {statistics.median(base):.3f} -> "
                            f"{statistics.median(values):.3f} ms at {step.name}: the host was too noisy to "
                            "attribute the steps"
                        )
                        break
            if phase in self.profile_speedup and len(self.steps) > 1:
                seen, spread = self.profile_speedup[phase], self.speedup(phase)
                if not spread.p10 <= seen <= spread.p90:
                    said.append(
                        f"{phase}: the profile's captured-vs-eager line ({seen:.2f}x) is outside the "
                        f"waterfall's eager -> {self.steps[-1].name} over {self.rounds} rounds "
                        f"({spread.median:.2f}x, p10-p90 {spread.p10:.2f}-{spread.p90:.2f}x): the host was noisy"
                    )
        return said

    def as_dict(self) -> dict[str, Any]:
        """waterfall.json: the steps' rounds, and what they give (times, changes, shares, warnings)."""
        return {
            "rounds": self.rounds,
            "steps": [asdict(s) for s in self.steps],
            "time": {phase: [asdict(s.time(phase)) for s in self.steps] for phase in PHASES},
            "change": {
                phase: [None if c is None else asdict(c) for c in self.changes(phase)] for phase in PHASES
            },
            "shares": {phase: self.shares(phase) for phase in PHASES},
            "noisy": {phase: self.noisy(phase) for phase in PHASES},
            "speedup": {phase: asdict(self.speedup(phase)) for phase in PHASES},
            "untouched": self.untouched,
            "profile_speedup": self.profile_speedup,
            "first_drift": self.first_drift(),
            "warnings": self.warnings(),
        }


def load(path: Path) -> Waterfall:
    """A saved waterfall.json: its steps' rounds; what they give is computed again from them."""
    saved = json.loads(Path(path).read_text())
    return Waterfall(
        steps=[Step(**step) for step in saved["steps"]],
        untouched=saved.get("untouched", []),
        profile_speedup=saved.get("profile_speedup", {}),
    )


def table(waterfall: Waterfall) -> str:
    """One row per step: per phase the median device ms per step with p10-p90, the change within a
    round and the share of the whole with its sign (NOISY where the change is inside the spread);
    cost, memory, nodes, and the parts that first drifted there."""
    header = (
        f"{'step':<24} "
        + " ".join(f"{phase + ' ms (p10-p90)':>26} {'share':>6}" for phase in PHASES)
        + f" {'cost s':>7} {'+MiB':>8} {'nodes':>6}  first drift here"
    )
    lines = [
        f"waterfall: each step from Hugging Face eager to the captured model, {waterfall.rounds} interleaved "
        "rounds (device ms per step: median, p10-p90)",
        header,
        "-" * len(header),
    ]
    shares = {phase: waterfall.shares(phase) for phase in PHASES}
    noisy = {phase: waterfall.noisy(phase) for phase in PHASES}
    first = waterfall.first_drift()
    for i, step in enumerate(waterfall.steps):
        cells = []
        for phase in PHASES:
            t = step.time(phase)
            share = shares[phase][i]
            mark = "-" if share is None else ("NOISY" if noisy[phase][i] else f"{100 * share:+.0f}%")
            cells.append(f"{t.median:>9.3f} ({t.p10:>7.3f}-{t.p90:<7.3f}) {mark:>6}")
        drift = ", ".join(p for p, where in first.items() if where == step.name)
        lines.append(
            f"{step.name:<24} {' '.join(cells)} {step.cost_s:>7.2f} {step.memory_mib:>8.1f} "
            f"{step.nodes or '-':>6}  {drift}".rstrip()
        )
    first_step, last = waterfall.steps[0], waterfall.steps[-1]
    summary = []
    for phase in PHASES:
        s = waterfall.speedup(phase)
        verdict = "faster" if s.median >= 1 else "slower"
        summary.append(
            f"{phase} {s.median:.2f}x within a round (p10-p90 {s.p10:.2f}-{s.p90:.2f}x: {verdict}; medians "
            f"{first_step.time(phase).median:.3f} -> {last.time(phase).median:.3f} ms)"
        )
    lines.append(f"change, eager -> {last.name}: {'; '.join(summary)}")
    lines.append(
        "share: a step's change within a round (median) over the whole change, with its own sign "
        "(adds up to +100% for a gain, -100% for a loss); NOISY: its change is inside the rounds' spread"
    )
    lines += [f"!!! {warning}" for warning in waterfall.warnings()]
    return "\n".join(lines)
