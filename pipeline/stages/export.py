"""export: torch.export the whole model (full) or its language model (partial), swap the graph in,
and check that the partly captured model still computes what the eager model computed."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from pipeline.errors import StageFailure, short_cause
from pipeline.export import graph_capture
from pipeline.state import CorrectnessCheck, RunState, StageResult

log = logging.getLogger(__name__)

# Export replays the same ATen ops, so float32 agrees to rounding; half types get a looser bound.
# Relative to the largest reference logit.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _targets(state: RunState) -> tuple[list[str], list[str]]:
    """Submodule paths to capture ("" is the whole model) and notes on why."""
    mode, info = state.cfg.capture.mode, state.model_info
    if mode == "full":
        return [""], []
    if state.cfg.capture.submodules:
        return list(state.cfg.capture.submodules), []
    if not info.is_vlm:
        return [""], [f"{info.architecture} is a text model: capture=partial captures the whole model"]
    if not info.language_model_paths:
        raise StageFailure(
            "no language model found (no submodule with the text config and decoder layers); "
            "name it with capture.submodules=[path]"
        )
    return list(info.language_model_paths), []


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def run(state: RunState) -> StageResult:
    if state.cfg.capture.mode == "none":
        return StageResult(notes=["capture=none: the model stays eager, nothing exported"])
    paths, notes = _targets(state)
    examples = state.example_inputs
    capture_call = examples.image or examples.text  # the call whose kwargs the graph is exported from
    # A full graph of a VLM is exported from the image call and takes exactly that call's inputs.
    calls = {"text": examples.text} | ({"image": examples.image} if examples.image else {})
    if paths == [""] and examples.image:
        calls = {"image": examples.image}
        notes.append("the full graph takes the image call's inputs; text-only calls need their own export")

    model = state.model
    with torch.no_grad():
        reference = {name: _logits(model(**call)) for name, call in calls.items()}
    if paths == [""]:
        recorded = {"": graph_capture.RecordedCall(dict(capture_call))}
    else:
        recorded, _ = graph_capture.record_calls(model, paths, capture_call)
    batch, seq = capture_call["input_ids"].shape

    result = StageResult(notes=notes)
    for path in paths:
        module = model.get_submodule(path) if path else model
        try:
            captured = graph_capture.export_module(module, path, recorded[path], batch, seq)
        except graph_capture.ExportFailed as failed:
            exc = failed.__cause__
            (state.run_dir / "logs" / f"export_{path or 'root'}_partial_graph.txt").write_text(failed.console)
            where = graph_capture.module_of_failure(exc, model) or (path or "root")
            hint = "; try capture=partial" if not path and state.model_info.is_vlm else ""
            raise StageFailure(
                f"torch.export of '{path or 'root'}' failed in {where}: {short_cause(exc)}{hint}"
            ) from exc
        model = graph_capture.install(model, captured)
        state.captured.append(captured)
        result.metrics[f"graph/{captured.name}/nodes"] = captured.num_nodes
        result.metrics[f"time/export/{captured.name}_s"] = captured.export_s
        result.artifacts += _write_graph_artifacts(state, captured)
        result.notes.append(
            f"captured '{captured.name}': {captured.num_nodes} nodes, inputs {captured.tensor_inputs}, "
            f"constants {captured.constants}, {captured.export_s:.1f} s"
        )
        result.notes += [f"'{captured.name}': {note}" for note in captured.notes]
    state.model = model
    result.metrics["time/export_s"] = sum(c.export_s for c in state.captured)
    if paths != [""]:
        result.notes.append(f"stays eager: {', '.join(graph_capture.eager_parts(model, paths))}")

    _check(state, calls, reference, result)
    summary = state.run_dir / "export" / "summary.json"
    summary.write_text(json.dumps(_summary(state), indent=2))
    result.artifacts.append(summary)
    failed = [c for c in state.checks if not c.passed]
    if failed:
        worst = max(failed, key=lambda c: c.max_abs_err)
        raise StageFailure(
            f"captured model differs from eager on the {worst.call} call: max_abs_err {worst.max_abs_err:.3g} "
            f"> tolerance {worst.tolerance:.3g}"
        )
    return result


def _check(state: RunState, calls: dict, reference: dict, result: StageResult) -> None:
    with torch.no_grad():
        for name, call in calls.items():
            ref = reference[name]
            err = (_logits(state.model(**call)).float() - ref.float()).abs().max().item()
            tol = _TOLERANCE[state.dtype] * max(1.0, ref.float().abs().max().item())
            state.checks.append(CorrectnessCheck(name, err, tol))
            result.metrics[f"correctness/{name}_max_abs_err"] = err
            result.notes.append(f"check on the {name} call: max_abs_err {err:.3g} (tolerance {tol:.3g})")
    result.metrics["correctness/max_abs_err"] = max(c.max_abs_err for c in state.checks)


def _write_graph_artifacts(state: RunState, captured: graph_capture.CapturedGraph) -> list:
    folder = state.run_dir / "export" / captured.name
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "graph.py": captured.graph_module.code,
        "nodes.json": json.dumps(captured.node_counts(), indent=2),
        "dynamic_shapes.json": json.dumps(
            {
                "dynamic_dims": captured.dynamic_dims,
                "range_constraints": captured.range_constraints,
                "notes": captured.notes,
            },
            indent=2,
        ),
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    return [folder / name for name in files]


def _summary(state: RunState) -> dict:
    return {
        "capture": state.cfg.capture.mode,
        "graphs": [
            {
                "path": c.name,
                "nodes": c.num_nodes,
                "inputs": c.tensor_inputs,
                "constants": c.constants,
                "dropped_none": c.dropped,
                "dynamic_dims": c.dynamic_dims,
                "export_s": c.export_s,
                "notes": c.notes,
            }
            for c in state.captured
        ],
        "checks": [
            {"call": c.call, "max_abs_err": c.max_abs_err, "tolerance": c.tolerance, "passed": c.passed}
            for c in state.checks
        ],
    }
