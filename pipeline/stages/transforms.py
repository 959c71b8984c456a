"""transforms: the configured graph rewrites, on each captured subgraph or on the whole model,
with a history of what each matched, and a check that the model still computes the eager result."""

from __future__ import annotations

import json
from dataclasses import asdict

from pipeline import correctness, waterfall
from pipeline.errors import StageFailure
from pipeline.graphs import find_graphs
from pipeline.models.memory import human_bytes
from pipeline.parallel import tensor_parallel
from pipeline.state import RunState, StageResult
from pipeline.transforms import registry
from pipeline.transforms.split_piecewise import SplitPiecewise


def run(state: RunState) -> StageResult:
    transforms = registry.parse(state.cfg.transforms)
    ctx = registry.TransformContext(
        state.attention,
        state.cfg.runtime.attn_page_size,
        state.device,
        state.hf_config,
        *tensor_parallel(),
        weights=state.deferred,
    )
    history = state.transform_history = registry.TransformHistory()
    result = StageResult()
    try:
        if state.waterfall is None:
            registry.run_transforms(state.model, transforms, ctx, history)
        else:
            _stepwise(state, transforms, ctx, history)
        if state.cfg.backend.piecewise:  # where the backend cuts the graph, in the history too
            registry.run_transforms(state.model, [SplitPiecewise()], ctx, history)
    except registry.TransformFailed as failed:
        _report(state, history, result)
        raise StageFailure(
            f"{failed}; set transforms.{failed.record.transform}.skip_on_error=true to go on"
        ) from (failed.__cause__)
    _report(state, history, result)
    applied = [r for r in history.records if r.status == "applied"]
    result.notes.append(
        f"{len(applied)} of {len(history.records)} transform runs applied, "
        f"{sum(r.matches for r in applied)} matches, in {result.metrics['transform/apply_s']:.2f} s "
        "(table below and in transforms/report.txt)"
    )
    result.notes += history.table().splitlines()
    if not transforms:
        result.notes.append("no transforms configured (transforms=none)")
    if state.deferred is not None:
        _check_slices_filled(state, result)
    elif any(r.status == "applied" and r.matches for r in history.records):
        if cause := correctness.failure(correctness.check(state, "transforms", result)):
            raise StageFailure(cause)
    else:
        result.notes.append("nothing matched: the model is unchanged")
    return result


def _check_slices_filled(state: RunState, result: StageResult) -> None:
    """runtime.tp_weights=shard: every placeholder load left is filled with this rank's slice, or
    the stage fails naming them; what the rank holds is said."""
    if left := state.deferred.left(state.model):
        raise StageFailure(
            f"{len(left)} weight(s) left unfilled after the transforms ({', '.join(left[:3])}): "
            "runtime.tp_weights=shard needs transforms.shard to run on [subgraph,model] without skip_on_error"
        )
    result.metrics["model/rank_bytes"] = _parameter_bytes(state.model)
    result.notes.append(
        f"runtime.tp_weights=shard: this rank holds {human_bytes(result.metrics['model/rank_bytes'])} "
        "of weights; no eager model to check against (tests compare the ranks' tokens with one process's)"
    )


def _stepwise(state: RunState, transforms, ctx, history: registry.TransformHistory) -> None:
    """profile.waterfall=true: the transforms as the waterfall's steps, each measured once applied
    (one that matched nothing changed nothing, and is no step)."""
    for group in waterfall.order(transforms):
        done = len(history.records)
        registry.run_transforms(state.model, group, ctx, history)
        records = history.records[done:]
        if any(r.matches for r in records):
            name = "graph_and_cache" if group[0].decoding else group[0].name
            waterfall.step(state, name, sum(r.seconds for r in records))


def _report(state: RunState, history: registry.TransformHistory, result: StageResult) -> None:
    folder = state.run_dir / "transforms"
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "report.json"
    report.write_text(json.dumps([asdict(r) for r in history.records], indent=2))
    (folder / "report.txt").write_text(history.table() + "\n")
    result.artifacts += [report, folder / "report.txt"]
    for name, graph in find_graphs(state.model):
        path = folder / name / "graph.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(graph.code)
        result.artifacts.append(path)
    for name in {r.transform for r in history.records}:
        result.metrics[f"transform/{name}/matches"] = history.matches(name)
    result.metrics["transform/apply_s"] = sum(r.seconds for r in history.records)


def _parameter_bytes(model) -> int:
    """What the model's parameters occupy (a tensor held twice counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())
