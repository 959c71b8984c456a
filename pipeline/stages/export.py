"""export: torch.export the whole model (full) or its language model (partial), swap the graph in,
and check that the partly captured model still computes what the eager model computed."""

from __future__ import annotations

import json

from torch import nn

from pipeline import correctness, numerics, waterfall
from pipeline.errors import StageFailure, short_cause
from pipeline.export import graph_capture
from pipeline.graphs import record_of
from pipeline.state import RunState, StageResult


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


def _parts(state: RunState) -> list[str]:
    """The parts whose outputs are compared with eager (numerics.part_paths), on the eager model."""
    return numerics.part_paths(state.model, list(state.model_info.language_model_paths))


def run(state: RunState) -> StageResult:
    examples = state.example_inputs
    state.check_calls = {"text": examples.text} | ({"image": examples.image} if examples.image else {})
    if state.cfg.capture.mode == "none":
        # Still the reference for later stages that change the eager model (model-scope transforms).
        state.reference = correctness.reference_outputs(state.model, state.check_calls, _parts(state))
        return StageResult(notes=["capture=none: the model stays eager, nothing exported"])
    paths, notes = _targets(state)
    capture_call = examples.image or examples.text  # the call whose kwargs the graph is exported from
    if paths == [""] and examples.image:
        # A full graph of a VLM is exported from the image call and takes exactly that call's inputs.
        state.check_calls = {"image": examples.image}
        notes.append("the full graph takes the image call's inputs; text-only calls need their own export")

    parts = _parts(state)
    if state.deferred is None:
        state.reference = correctness.reference_outputs(state.model, state.check_calls, parts)
        state.reference.decode = _decode_reference(state, parts)
    else:
        notes.append(
            "runtime.tp_weights=shard: the language model's linears are placeholders until the shard "
            "transform fills this rank's slices, so there is no eager result to check against"
        )
    if state.cfg.profile.waterfall:
        waterfall.start(state)
    model = _export(state, paths, capture_call)
    result = StageResult(notes=notes)
    for captured in state.captured:
        numerics.tag_layer_outputs(captured.graph_module, captured.path, parts)
        _describe(state, captured, result)
    state.model = model
    result.metrics["export/torch_export_s"] = sum(c.export_s for c in state.captured)
    if paths != [""]:
        result.notes.append(f"stays eager: {', '.join(graph_capture.eager_parts(model, paths))}")

    checks = correctness.check(state, "export", result) if state.reference is not None else []
    summary = state.run_dir / "export" / "summary.json"
    summary.write_text(json.dumps(_summary(state), indent=2))
    result.artifacts.append(summary)
    if cause := correctness.failure(checks):
        raise StageFailure(cause)
    return result


def _export(state: RunState, paths: list[str], capture_call: dict) -> nn.Module:
    """The model with each path's graph swapped in (state.captured holds them), or a StageFailure
    naming the module export failed in, torch's partial graph in logs/."""
    examples = state.example_inputs
    try:
        model, state.captured = graph_capture.capture(
            state.model, paths, capture_call, state.model_info.position_offset, examples.text
        )
    except graph_capture.ExportFailed as failed:
        exc, path = failed.__cause__, failed.path
        (state.run_dir / "logs" / f"export_{path or 'root'}_partial_graph.txt").write_text(failed.console)
        where = graph_capture.module_of_failure(exc, state.model) or (path or "root")
        hint = "; try capture=partial" if not path and state.model_info.is_vlm else ""
        raise StageFailure(f"{failed} in {where}: {short_cause(exc)}{hint}") from exc
    if paths == [""] and state.model_info.is_vlm and state.model_info.language_model_paths:
        # Where the decoder sits inside a full graph, for transforms that touch only its layers.
        record_of(
            state.captured[0].graph_module
        ).language_model_prefix = state.model_info.language_model_paths[0]
    return model


def graph_role(path: str, is_vlm: bool, language_models: tuple[str, ...]) -> str:
    """What a captured graph is, as its metrics are named, so runs of text models and VLMs line
    up: `language_model` (a VLM's language model wherever it sits, or a text model's whole graph),
    `whole_model` (a VLM captured whole, capture=full), else the submodule's path
    (capture.submodules)."""
    if path in language_models or (not path and not is_vlm):
        return "language_model"
    return "whole_model" if not path else path


def _describe(state: RunState, captured, result: StageResult) -> None:
    """One captured graph's metrics (named by its role), files (its code, its graph) and notes."""
    info = state.model_info
    role = graph_role(captured.path, info.is_vlm, tuple(info.language_model_paths))
    result.metrics[f"graph/{role}/nodes"] = captured.num_nodes
    result.metrics[f"export/{role}/torch_export_s"] = captured.export_s
    result.artifacts += _write_graph_artifacts(state, captured)
    result.notes.append(
        f"captured '{captured.name}': {captured.num_nodes} nodes as exported, inputs {captured.tensor_inputs}, "
        f"constants {captured.constants}, {captured.export_s:.1f} s"
    )
    result.notes += [f"'{captured.name}': {note}" for note in captured.notes]


def _decode_reference(state: RunState, parts: list[str]) -> numerics.DecodeParts | None:
    """Each part at a decode step of the eager model as generate runs it (the text call's first
    row as the prompt), for the numerics stage's decode comparison."""
    prompt = state.example_inputs.text["input_ids"][0].tolist()
    try:
        return numerics.decode_parts(
            state.model, state.hf_config, state.cfg.runtime, state.device, prompt, parts, lambda _m: None
        )
    except ValueError:  # demollm cannot drive this model: the generate stage says why
        return None


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
                "unread": c.unread,
                "dynamic_dims": c.dynamic_dims,
                "export_s": c.export_s,
                "notes": c.notes,
            }
            for c in state.captured
        ],
        "checks": [
            {"call": c.call, "max_abs_err": c.max_abs_err, "tolerance": c.tolerance, "passed": c.passed}
            for c in state.checks
            if c.stage == "export"
        ],
    }
