"""numerics: each part's output (the vision tower, the projector, every decoder layer, the lm_head)
of the model as captured against Hugging Face's eager model on the check calls, and the first
part past the dtype's tolerance (pipeline/numerics.py). Reports; never fails the run."""

from __future__ import annotations

import json
import re

from pipeline import numerics
from pipeline.backend_specs import spec
from pipeline.backends.compile import compile_module, compiled_frames
from pipeline.backends.compile_log import LOG
from pipeline.correctness import TOLERANCE
from pipeline.report.plots import numerics_plot
from pipeline.state import RunState, StageResult


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
    compile_copy = compile_module if spec(state.backend).compiles else (lambda _module: None)
    rows = numerics.measure(state.model, reference, state.check_calls, tolerance, compile_copy)
    decode, decode_notes = _decode_rows(state, tolerance, compile_copy)
    # The copies compiled here are not generation's: recompiles count from now.
    state.compiled_frames, state.compile_log_mark = compiled_frames(), LOG.mark()
    state.part_errors = {"prefill": rows, **({"decode": decode} if decode is not None else {})}
    folder = state.run_dir / "numerics"
    folder.mkdir(parents=True, exist_ok=True)
    table = numerics_table(rows, tolerance, decode)
    if spec(state.backend).compiles and state.captured:
        table += (
            f"\nthe layers inside the graphs are read from a tapped copy of each graph compiled by {state.backend} "
            "apart from the program generation runs (the eager parts from that program itself)"
        )
    (folder / "numerics.txt").write_text(table + "\n")
    (folder / "numerics.json").write_text(
        json.dumps(
            {
                "tolerance": tolerance,
                "parts": [vars(r) for r in rows],
                "decode": [vars(r) for r in decode] if decode is not None else None,
            },
            indent=1,
        )
    )
    plot = numerics_plot([r.part for r in rows], [r.max_rel for r in rows], tolerance, folder / "depth.png")
    result = StageResult(
        artifacts=[folder / "numerics.txt", folder / "numerics.json", plot], images={"numerics_depth": plot}
    )
    for row in rows:
        if row.max_abs is not None:
            result.metrics[metric_name(row.part)] = row.max_abs
    unread = [r.part for r in rows if r.max_abs is None]
    _verdict(result, rows, tolerance, "", "")
    if unread:
        result.notes.append(f"!!! output not readable on the captured model: {', '.join(unread)}")
    result.notes += decode_notes
    if decode is not None:
        _verdict(result, decode, tolerance, "decode_", "decode step: ")
    result.notes += table.splitlines()
    return result


def _verdict(
    result: StageResult, rows: list[numerics.PartError], tolerance: float, key: str, said: str
) -> None:
    """numerics/<key>parts_past_tolerance, the tag numerics_first_drift[_decode] of the first part
    past tolerance, and a note: that part, or all within it (with the largest)."""
    past = [r for r in rows if r.past_tolerance]
    result.metrics[f"numerics/{key}parts_past_tolerance"] = len(past)
    if past:
        result.tags["numerics_first_drift" + (f"_{key.rstrip('_')}" if key else "")] = past[0].part
        result.notes.append(
            f"!!! {said}first part past tolerance: {past[0].part} (max rel {past[0].max_rel:.2e} > "
            f"{tolerance:.0e}); {len(past)} of {len(rows)} parts past it (numerics/numerics.txt)"
        )
        return
    largest = max((r for r in rows if r.max_rel is not None), key=lambda r: r.max_rel, default=None)
    result.notes.append(
        f"{said}all {len(rows)} parts within tolerance {tolerance:.0e}"
        + (f" (largest: {largest.part}, max rel {largest.max_rel:.2e})" if largest else "")
    )


def _decode_rows(
    state: RunState, tolerance: float, compile_copy
) -> tuple[list[numerics.PartError] | None, list[str]]:
    """Each part at a decode step of the program generation runs against the eager model's at the
    same step (reference.decode), or None and why not."""
    eager = state.reference.decode
    if eager is None:
        return None, ["no decode step compared: demollm cannot drive this model"]
    try:
        ours = numerics.decode_parts(
            state.model, state.hf_config, state.cfg.runtime, state.device, eager.prompt,
            state.reference.part_order, compile_copy,
        )  # fmt: skip
    except ValueError as exc:  # demollm cannot drive the captured model: generate says why
        return None, [f"no decode step compared: {exc}"]
    if ours.tokens[0] != eager.tokens[0]:
        return None, [
            f"!!! no decode step compared: the prefill's token differs from eager's ({ours.tokens[0]} vs "
            f"{eager.tokens[0]}), so the decode step's input would too"
        ]
    parts = [p for p in state.reference.part_order if p in eager.parts]
    return numerics.compare(eager.parts, ours.parts, parts, tolerance), []


def _cells(r: numerics.PartError | None) -> str:
    if r is None:
        return f"{'':>10} {'':>10} {'':>5}"
    if r.max_abs is None:
        return f"{'-':>10} {'-':>10} {'n/a':>5}"
    return f"{r.max_abs:>10.2e} {r.max_rel:>10.2e} {'PAST' if r.past_tolerance else 'ok':>5}"


def numerics_table(
    rows: list[numerics.PartError], tolerance: float, decode: list[numerics.PartError] | None = None
) -> str:
    """Per part: the check calls' (prefill-shaped) max abs and rel error, and a decode step's."""
    header = (
        f"{'part':<50} {'check max abs':>13} {'max rel':>10} {'':>5} {'decode abs':>10} {'max rel':>10} {'':>5}"
        f"  vs tolerance {tolerance:.0e}"
    )
    lines = [header, "-" * len(header)]
    at_decode = {r.part: r for r in decode or []}
    for r in rows:
        lines.append(f"{r.part:<50} {_cells(r):>29}  {_cells(at_decode.get(r.part))}".rstrip())
    if decode is None:
        lines.append("decode: not compared (see the notes)")
    lines.append("n/a: the captured model gave no output of that part to compare")
    return "\n".join(lines)
