"""A phase's time in parts: module slices (the disjoint subtrees a module tree is cut into), kernel categories,
and the bounded set of top-level parts (PARTS) every family's modules map to. The analysis the
comparison, the roofs, the waterfall and the report all count by."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.profiler.tree import UNATTRIBUTED

if TYPE_CHECKING:
    from pipeline.profiler.rows import Phases, ProfileNode

LAYER = re.compile(r"(^|\.)layers\.\*$")


def _modules_below(node: ProfileNode) -> list[ProfileNode]:
    return [c for c in node.children if c.kind in ("module", "unattributed")]


def _has_layers(node: ProfileNode) -> bool:
    return bool(LAYER.search(node.fqn)) or any(_has_layers(c) for c in _modules_below(node))


def module_slices(
    summary: ProfileNode, depth: int | None = None, value: Callable[[ProfileNode], float] | None = None
) -> dict[str, float]:
    """Disjoint parts of a phase's device time (us), by summary-tree module.

    Default: the children of the decoder layers (`layers.*.self_attn`, `layers.*.mlp`, the norms)
    and, outside the layers, the largest modules that hold no layers (lm_head, vision tower,
    projector, embedding, demollm's own steps); time a container spends itself is `<fqn> (self)`.
    With `depth`, the module nodes at that depth below the phase instead (shallower leaves as is).
    value: what is summed per node instead of its device time (one kernel category's time).
    """
    slices: dict[str, float] = {}
    us = value or (lambda node: node.device_time_us)

    def add(name: str, us: float) -> None:
        if us > 0:
            slices[name] = slices.get(name, 0.0) + us

    def visit(node: ProfileNode, level: int) -> None:
        below = _modules_below(node)
        if depth is not None:
            stop = level >= depth or not below
        else:
            stop = not below or (not _has_layers(node) and not LAYER.search(node.fqn))
            if LAYER.search(node.fqn):  # a layer: its children are the slices
                for child in below:
                    add(child.fqn or child.name, us(child))
                add(f"{node.fqn} (self)", us(node) - sum(us(c) for c in below))
                return
        if stop and level > 0:
            add(node.fqn or node.name, us(node))
            return
        for child in below:
            visit(child, level + 1)
        if level > 0:
            add(f"{node.fqn or node.name} (self)", us(node) - sum(us(c) for c in below))

    visit(summary, 0)
    return slices


def kernel_times(tree: ProfileNode, key: str) -> dict[str, float]:
    """Device time (us) of the kernel leaves, summed by `category` or by `name`."""
    totals: dict[str, float] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if node.kind == "kernel":
            name = getattr(node, key) or "other"
            totals[name] = totals.get(name, 0.0) + node.device_time_us
        stack.extend(node.children)
    return totals


def category_pct(phases: Phases, category: str) -> float:
    """The share (%) of one kernel category in the device time of all step windows together."""
    steps = [e for name, e in phases.items() if name != "decode"]
    total = sum(e.device_time_us for e in steps)
    part = sum(kernel_times(e.summary_stats, "category").get(category, 0.0) for e in steps)
    return 100 * part / total if total else 0.0


# The top-level parts a phase's time is charted by across runs (MLflow metrics layers/<phase>/<part>_ms):
# a bounded set, whatever the family calls its modules.
PARTS = (
    "attention", "mlp", "norms", "lm_head", "embeddings", "vision_tower", "projector", "demollm",
    "unattributed", "other",
)  # fmt: skip
_IN_LAYER = re.compile(r"(^|\.)layers\.\*\.")
_VISION = re.compile(r"vision|visual|image_encoder|patch_embed")
_PROJECTOR = re.compile(r"projector|multi_modal|mm_proj|connector")


def part_of(slice_: str) -> str:
    """Which of PARTS a module slice (module_slices) belongs to: the decoder layers' attention,
    MLP (experts included) and norms summed over layers; the rest by what the module is."""
    name = slice_.removesuffix(" (self)")
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith(UNATTRIBUTED):
        return "unattributed"
    if name.startswith("demollm."):
        return "demollm"
    if _VISION.search(name):
        return "vision_tower"
    if _PROJECTOR.search(name):
        return "projector"
    if "lm_head" in name:
        return "lm_head"
    if "embed" in leaf:
        return "embeddings"
    if "norm" in leaf:
        return "norms"
    if _IN_LAYER.search(name) and not slice_.endswith(" (self)"):
        if "attn" in leaf or "attention" in leaf:
            return "attention"
        if any(word in leaf for word in ("mlp", "feed_forward", "moe", "expert")):
            return "mlp"
    return "other"


def part_times(summary: ProfileNode, value: Callable[[ProfileNode], float] | None = None) -> dict[str, float]:
    """A phase's device time (us) per part of PARTS, every part present (0 where none); value:
    what is summed instead (module_slices)."""
    times = dict.fromkeys(PARTS, 0.0)
    for slice_, us in module_slices(summary, value=value).items():
        times[part_of(slice_)] += us
    return times


def busy_us(node: ProfileNode) -> float:
    return node.busy_us


def gap_us(node: ProfileNode) -> float:
    return node.gap_us


@dataclass
class SliceTimes:
    """One side's module slices three ways (us): device time, busy time and gaps (tree.py)."""

    device: dict[str, float]
    busy: dict[str, float]
    gap: dict[str, float]

    @classmethod
    def of(cls, summary: ProfileNode) -> SliceTimes:
        return cls(
            module_slices(summary),
            module_slices(summary, value=busy_us),
            module_slices(summary, value=gap_us),
        )

    def of_slices(self, names: list[str]) -> tuple[float, float, float]:
        """(device, busy, gap) us of these slices together."""
        return tuple(sum(times.get(n, 0.0) for n in names) for times in (self.device, self.busy, self.gap))


LAYER_INDEX = re.compile(r"\.layers\.\d+\.")


def slice_of(fqn: str, slices: set[str]) -> str | None:
    """The module slice (module_slices) a module's work is counted in: the deepest slice at or
    above it, layer indices as `*`; a container's own work goes to its `(self)` slice."""
    path = LAYER_INDEX.sub(".layers.*.", "." + fqn + ".").strip(".")
    if path in slices:
        return path
    while path:
        if f"{path} (self)" in slices:
            return f"{path} (self)"
        path = path.rsplit(".", 1)[0] if "." in path else ""
        if path in slices:
            return path
    return None


# Below this a part's time per step is the profiler's rounding, not work: no ratio is taken of it
# (a residue of a part fused away once divided a real time into a ratio of 5e12).
MEASURABLE_US = 1.0
