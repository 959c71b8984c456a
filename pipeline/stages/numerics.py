"""numerics: each part's output (the vision tower, the projector, every decoder layer, the lm_head)
of the model as captured against Hugging Face's eager model on the check calls, and the first
part past the dtype's tolerance (pipeline/numerics.py). Reports; never fails the run."""

from __future__ import annotations

import json
import re

from pipeline import numerics
from pipeline.backends.compile import compile_module, compiled_frames
from pipeline.correctness import TOLERANCE
from pipeline.report.plots import numerics_plot
from pipeline.state import RunState, StageResult

COMPILING = ("torch-compile", "torch-opt")


def metric_name(part: str) -> str:
    """numerics/<part>_max_abs_err: layer_<i> for a decoder layer, else the module's own name."""
    if match := re.search(r"layers\.(\d+)$", part):
        return f"numerics/layer_{match.group(1)}_max_abs_err"
    leaf = part.rsplit(".", 1)[-1]
    kind = (
        "vision_tower"
        if numerics.VISION.search(leaf)
        else "projector"
        if numerics.PROJECTOR.search(leaf)
        else leaf
    )
    return f"numerics/{kind}_max_abs_err"


def run(state: RunState) -> StageResult:
    reference = state.reference
    if reference is None or not reference.part_order:
        return StageResult(notes=["no eager reference to compare parts with (runtime.tp_weights=shard)"])
    tolerance = TOLERANCE[state.dtype]
    compile_copy = compile_module if state.backend in COMPILING else (lambda _module: None)
    rows = numerics.measure(state.model, reference, state.check_calls, tolerance, compile_copy)
    # The copies compiled here are not generation's: recompiles count from now.
    state.compiled_frames = compiled_frames()
    folder = state.run_dir / "numerics"
    folder.mkdir(parents=True, exist_ok=True)
    table = numerics_table(rows, tolerance)
    (folder / "numerics.txt").write_text(table + "\n")
    (folder / "numerics.json").write_text(
        json.dumps({"tolerance": tolerance, "parts": [vars(r) for r in rows]}, indent=1)
    )
    plot = numerics_plot([r.part for r in rows], [r.max_rel for r in rows], tolerance, folder / "depth.png")
    result = StageResult(
        artifacts=[folder / "numerics.txt", folder / "numerics.json", plot], images={"numerics_depth": plot}
    )
    for row in rows:
        if row.max_abs is not None:
            result.metrics[metric_name(row.part)] = row.max_abs
    past = [r for r in rows if r.past_tolerance]
    unread = [r.part for r in rows if r.max_abs is None]
    result.metrics["numerics/parts_past_tolerance"] = len(past)
    if past:
        result.tags["numerics_first_drift"] = past[0].part
        result.notes.append(
            f"!!! first part past tolerance: {past[0].part} (max rel {past[0].max_rel:.2e} > {tolerance:.0e}); "
            f"{len(past)} of {len(rows)} parts past it (numerics/numerics.txt)"
        )
    else:
        largest = max((r for r in rows if r.max_rel is not None), key=lambda r: r.max_rel, default=None)
        result.notes.append(
            f"all {len(rows)} parts within tolerance {tolerance:.0e}"
            + (f" (largest: {largest.part}, max rel {largest.max_rel:.2e})" if largest else "")
        )
    if unread:
        result.notes.append(f"!!! output not readable on the captured model: {', '.join(unread)}")
    result.notes += table.splitlines()
    return result


def numerics_table(rows: list[numerics.PartError], tolerance: float) -> str:
    header = f"{'part':<50} {'max abs':>10} {'max rel':>10}  vs tolerance {tolerance:.0e}"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.max_abs is None:
            lines.append(f"{r.part:<50} {'-':>10} {'-':>10}  not readable after the transforms")
            continue
        verdict = "PAST" if r.past_tolerance else "ok"
        lines.append(f"{r.part:<50} {r.max_abs:>10.2e} {r.max_rel:>10.2e}  {verdict}")
    return "\n".join(lines)
