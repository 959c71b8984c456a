"""capture: the compile backend on each captured subgraph (never on the eager parts), checked
against eager on the same calls, then warmed up on demollm's steps of the run's requests, so
generation runs what was compiled here; compile time and what was captured are recorded."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from torch import nn

from pipeline import correctness, waterfall
from pipeline.backend_specs import spec
from pipeline.backends import install, piecewise
from pipeline.backends.compile import compiled_frames
from pipeline.backends.compile_log import LOG, FrameCompile, columns, facts
from pipeline.devices import free_memory
from pipeline.errors import StageFailure, short_cause
from pipeline.faults import maybe_fail
from pipeline.graphs import find_graphs
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState, StageResult


def run(state: RunState) -> StageResult:
    graphs = find_graphs(state.model)
    result = StageResult(notes=[f"backend {state.backend} (backend={state.cfg.backend.name})"])
    if spec(state.backend).runs_as_built:
        result.notes.append(
            "graphs run as exported and transformed" if graphs else "the eager model runs as it is"
        )
        return result
    # With capture=none there is no subgraph: torch-compile compiles the whole eager model.
    targets: list[tuple[str, nn.Module]] = list(graphs) if graphs else [("model", state.model)]
    frames, logged = compiled_frames(), LOG.mark()
    start = time.perf_counter()
    try:
        _install(state, targets, result)
    except Exception as exc:
        _fall_back(state, targets, result, exc)
        return result
    result.metrics["capture/compile_s"] = time.perf_counter() - start
    result.metrics["capture/graphs"] = len(targets)
    if state.waterfall is not None:
        waterfall.step(state, state.backend, result.metrics["capture/compile_s"])
    result.metrics["capture/compiled_frames"] = compiled_frames() - frames
    _compile_facts(state, LOG.since(logged), result)
    state.compiled_frames, state.compile_log_mark = compiled_frames(), LOG.mark()
    result.notes.append(
        f"compiled and checked {len(targets)} graph(s) in {result.metrics['capture/compile_s']:.1f} s"
    )
    return result


def _install(state: RunState, targets: list[tuple[str, nn.Module]], result: StageResult) -> None:
    """The backend on every target, its buckets said; the first calls compile and are checked
    against the eager reference; then a warm-up."""
    runners = install.apply(
        state.backend, targets, state.cfg.runtime, state.cfg.backend, on_cuda=state.device.type == "cuda"
    )
    if not runners:  # torch-compile alone
        result.notes.append("every step runs Inductor's code of each whole graph; no step is replayed")
    for name, runner in runners.items():
        result.notes.append(_captures(name, runner))
        if isinstance(runner, piecewise.PiecewiseRunner):
            result.metrics["capture/piecewise_buckets"] = len(runner.buckets)
        else:
            result.metrics["capture/buckets"] = len(runner.buckets)
    maybe_fail("capture")
    checks = correctness.check(state, "capture", result)
    if cause := correctness.failure(checks):
        raise StageFailure(cause)
    _warm_up(state)


def _fall_back(
    state: RunState, targets: list[tuple[str, nn.Module]], result: StageResult, exc: Exception
) -> None:
    """A failed capture: whatever the attempt held (compiled code, captured graphs, their memory
    pools) goes now, so a fallback, or the next job of a sweep, has the memory back; then the
    graphs run uncompiled (backend.fallback=eager) or the stage fails."""
    cause = short_cause(exc)
    install.remove(targets)
    free_memory()
    if state.cfg.backend.fallback != "eager":
        raise StageFailure(f"backend {state.backend} failed: {cause}") from exc
    result.tags["capture_fallback"] = "true"
    result.notes.append(
        f"!!! backend {state.backend} FAILED ({cause}); running UNCOMPILED (backend.fallback=eager)"
    )
    result.metrics["capture/fallback"] = 1
    state.compiled_frames, state.compile_log_mark = compiled_frames(), LOG.mark()


def _compile_facts(state: RunState, frames: list[FrameCompile], result: StageResult) -> None:
    """capture/graph_breaks, capture/guards and capture/inductor_kernels over the frames the stage
    compiled, each frame a row of capture/compiles.json and the MLflow table tables/compiles.json,
    and a note naming any graph break."""
    if not frames:
        return
    result.metrics |= {f"capture/{key}": value for key, value in facts(frames).items()}
    folder = state.run_dir / "capture"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compiles.json").write_text(json.dumps([asdict(f) for f in frames], indent=1) + "\n")
    result.artifacts.append(folder / "compiles.json")
    result.tables["tables/compiles.json"] = columns(frames)
    broken = [f for f in frames if f.graph_break]
    result.notes.append(
        f"{len(frames)} frames compiled: {len(broken)} graph breaks, "
        f"{result.metrics['capture/guards']:.0f} guards, {result.metrics['capture/inductor_kernels']:.0f} "
        "Inductor kernels (capture/compiles.json)"
        + (f"; !!! {broken[0].graph}: {broken[0].graph_break}" if broken else "")
    )


def _captures(name: str, runner: nn.Module) -> str:
    """Which steps a runner captures, and which it leaves to the graph it sits in front of."""
    if isinstance(runner, piecewise.PiecewiseRunner):
        return (
            f"'{name}': prefill and mixed steps padded to token buckets {runner.buckets}; "
            f"{len(runner.segments)} static segments {runner.segments_run}, the layout ops eager between "
            "them; decode steps and longer steps run the full graph"
        )
    return f"'{name}': CUDA graphs for decode buckets {runner.buckets}; other steps run uncaptured"


def _warm_up(state: RunState) -> None:
    """Compile for the steps generation will run. The check's calls are shaped as the parent model
    calls the graph ([B, S], a fresh cache each); demollm's steps are packed ([1, T]) over its
    paged cache, and a one-token step is a shape class of its own (backends/compile.py). Three
    tokens of the run's own requests (a prefill, then two decode steps: the second meets the
    cache as the first left it, which HF's cache of an eager model changes) and three of its first
    request alone (one-token steps) compile what generation meets: `capture/recompiles` counts
    what generation still compiles."""
    try:
        engine = DemoLLM(state.model, state.hf_config, state.cfg.runtime, state.device, eos_ids=set())
    except ValueError:
        return  # demollm cannot drive this model: the generate stage fails and says why
    requests = state.workload()
    for batch in (requests, requests[:1]):
        engine.generate(batch, 3, SamplingParams(), state.cfg.seed)
