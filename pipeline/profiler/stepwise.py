"""The waterfall's data (pipeline/waterfall.py measures it): the steps from eager to captured,
each step's share of the whole change per phase, the step at which each part first drifted, and
the printed table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

PHASES = ("prefill", "decode")


@dataclass
class Step:
    name: str
    cost_s: float  # apply seconds of its transforms, or the capture stage's compile seconds
    memory_mb: float  # memory it added
    phase_ms: dict[str, float]  # phase -> device ms per step
    part_ms: dict[str, dict[str, float]]  # phase -> part -> device ms per step
    drifted: list[str] = field(default_factory=list)  # parts past tolerance at this step
    nodes: int = 0  # nodes of the captured graphs after it (0: eager)


@dataclass
class Waterfall:
    steps: list[Step] = field(default_factory=list)
    last_memory: float = 0.0

    def shares(self, phase: str) -> list[float | None]:
        """Each step's share of the phase's whole gain (eager -> last), None for eager itself."""
        times = [s.phase_ms[phase] for s in self.steps]
        total = times[0] - times[-1]
        return [None] + [(before - after) / total if total else 0.0 for before, after in pairwise(times)]

    def first_drift(self) -> dict[str, str]:
        """Part -> the step at which it first passed tolerance."""
        first: dict[str, str] = {}
        for step in self.steps:
            for part in step.drifted:
                first.setdefault(part, step.name)
        return first

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": [asdict(s) for s in self.steps],
            "shares": {phase: self.shares(phase) for phase in PHASES},
            "first_drift": self.first_drift(),
        }


def table(waterfall: Waterfall) -> str:
    """One row per step: device ms per step and share of the gain per phase, cost, memory, and the
    parts that first drifted there."""
    header = (
        f"{'step':<26} {'prefill ms':>11} {'of chg':>7} {'decode ms':>10} {'of chg':>7} "
        f"{'cost s':>7} {'+MiB':>8} {'nodes':>6}  first drift here"
    )
    lines = [
        "waterfall: each step from Hugging Face eager to the captured model (device ms per step)",
        header,
        "-" * len(header),
    ]
    shares = {phase: waterfall.shares(phase) for phase in PHASES}
    first = waterfall.first_drift()
    for i, step in enumerate(waterfall.steps):
        cells = []
        for phase in PHASES:
            share = shares[phase][i]
            cells.append(
                f"{step.phase_ms[phase]:>10.3f} {('-' if share is None else f'{100 * share:.0f}%'):>7}"
            )
        drift = ", ".join(p for p, where in first.items() if where == step.name)
        lines.append(
            f"{step.name:<26} {cells[0]:>19} {cells[1]:>18} {step.cost_s:>7.2f} {step.memory_mb:>8.1f} "
            f"{step.nodes or '-':>6}  {drift}".rstrip()
        )
    first_step, last = waterfall.steps[0], waterfall.steps[-1]
    change = ", ".join(
        f"{phase} {first_step.phase_ms[phase]:.3f} -> {last.phase_ms[phase]:.3f} ms "
        f"({first_step.phase_ms[phase] / last.phase_ms[phase]:.2f}x faster)"
        for phase in PHASES
    )
    lines.append(f"change, eager -> {last.name}: {change}; 'of chg': each step's share of it")
    return "\n".join(lines)
