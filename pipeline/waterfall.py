"""profile.waterfall=true: what each step from Hugging Face's eager model to the captured one
bought and cost, measured on the one model as the stages advance it.

The steps, cumulative:
- `eager`: Hugging Face generate on the model as built (the export stage, before it exports);
- `graph_and_cache`: the graph swapped in with the transforms a graph needs to decode with demollm
  (those marked `decoding`: cleanup, match_attention, shard where it runs, insert_cached_attention),
  since a graph without a cache cannot decode: export alone is no step of its own;
- then each further enabled transform in the registry's order, one step each (the transforms
  stage applies them in that order: `order`);
- the capture backend (the capture stage, after its warm-up), unless it is torch-simple.

After each step its graphs are written as code, `waterfall/graphs/<step>/<graph>.py`, headed by
their node count, so two steps' files diff to what the step changed; its cost (apply or compile
seconds, the memory it added: the process's resident bytes on CPU, allocated device bytes on a
GPU) and its numerics (the parts past tolerance then, numerics.measure) are taken then, and what it
runs is kept (a snapshot of the graphs and module tables, registry.Snapshot; eager: the graphs and
model-scope rewrites swapped back, as the profile's eager reference).

The profile stage then times the steps in interleaved rounds (profile.waterfall_rounds, each round
visiting every step): each visit profiles the run's workload as the profile stage does (a prefill
window and profile.decode_steps decode windows), device ms per step of each phase and of each
top-level part (parts.PARTS). The profile stage's own captured and eager profiles are the
first round of the last and first steps, so its captured-vs-eager line is one of the waterfall's
rounds. stepwise.py says how the rounds become a median, a spread, changes and shares.
"""

from __future__ import annotations

import contextlib

import psutil
import torch

from pipeline import numerics
from pipeline.backend_specs import AS_BUILT, spec
from pipeline.backends.compile import compile_module
from pipeline.correctness import TOLERANCE
from pipeline.graphs import eager_graphs, find_graphs
from pipeline.profiler import session
from pipeline.profiler.parts import part_of, part_times
from pipeline.profiler.rows import Phases
from pipeline.profiler.stepwise import PHASES, Step, Waterfall
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState
from pipeline.transforms.registry import Snapshot, model_passes_undone, rewritten_modules


def order(transforms: list) -> list[list]:
    """The transforms as waterfall steps: the ones a decoding graph needs first (one step), then
    each other enabled one, in the given order."""
    enabled = [t for t in transforms if t.config.enabled]
    first = [t for t in enabled if t.decoding]
    return [first] + [[t] for t in enabled if not t.decoding]


def check(transforms: list) -> None:
    """The waterfall's order must be one the transforms allow, and its first step must decode:
    a ConfigError naming the fix otherwise."""
    from pipeline.errors import ConfigError
    from pipeline.transforms.registry import TRANSFORMS, check_order

    if not any(t.makes_cache and t.config.enabled for t in transforms):
        cache = next(name for name, cls in TRANSFORMS.items() if cls.makes_cache)
        raise ConfigError(
            f"profile.waterfall=true steps through graphs demollm decodes with: enable transforms.{cache}"
        )
    check_order([t for group in order(transforms) for t in group])


def _memory(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def start(state: RunState) -> None:
    """The eager step, on the model as Hugging Face built it."""
    state.waterfall = Waterfall(last_memory=_memory(state.device))
    step(state, "eager", 0.0)


def step(state: RunState, name: str, cost_s: float) -> Step:
    """The model as it is now is a step: its cost, graphs, numerics and what it runs."""
    waterfall = state.waterfall
    memory = _memory(state.device)
    added = Step(name, cost_s, (memory - waterfall.last_memory) / 2**20)
    waterfall.last_memory = memory
    graphs = find_graphs(state.model)
    for graph_name, gm in graphs:
        added.nodes += len(gm.graph.nodes)
        code = state.run_dir / "waterfall" / "graphs" / name / f"{graph_name or 'root'}.py"
        code.parent.mkdir(parents=True, exist_ok=True)
        code.write_text(f"# {len(gm.graph.nodes)} nodes after step {name}\n{gm.code}")
    if state.reference is not None and state.reference.part_order:
        compiled = name == state.backend and spec(state.backend).compiles
        compile_copy = compile_module if compiled else (lambda _module: None)
        errors = numerics.measure(
            state.model, state.reference, state.check_calls, TOLERANCE[state.dtype], compile_copy
        )
        added.drifted = [e.part for e in errors if e.past_tolerance]
    waterfall.steps.append(added)
    waterfall.programs.append(Snapshot(state.model) if graphs else None)
    return added


def _profile(state: RunState, model, backend: str, trace_dir) -> Phases:
    """One visit: the run's workload profiled on `model` as it is now; profile_steps' phases."""
    engine = DemoLLM(model, state.hf_config, state.cfg.runtime, state.device, eos_ids=set())
    requests, params = state.workload(), SamplingParams(**vars(state.cfg.runtime.sampling))

    def generate(max_new_tokens, after_step):
        return engine.generate(requests, max_new_tokens, params, state.cfg.seed, after_step=after_step)

    trace_dir.mkdir(parents=True, exist_ok=True)
    profiled = session.profile_steps(
        model,
        generate,
        state.cfg.profile.decode_steps,
        trace_dir,
        state.device.type == "cuda",
        backend,
        state.cfg.profile.kernel_provenance,
    )
    return session.phases_of(profiled, state.cfg.profile.kernel_categories)


def _add(step: Step, phases: Phases) -> None:
    step.add_round(
        {phase: phases[phase].device_time_us / 1000 for phase in PHASES},
        {
            phase: {p: us / 1000 for p, us in part_times(phases[phase].summary_stats).items()}
            for phase in PHASES
        },
    )


@contextlib.contextmanager
def _running(state: RunState, index: int):
    """The model as step `index` ran it, for the duration (yields the module to profile); the
    model as it ends is back on exit, its backend's forwards included."""
    program = state.waterfall.programs[index]
    if program is None:  # eager: graphs and model-scope rewrites swapped back
        with model_passes_undone(state.model, state.transform_history), eager_graphs(state.model) as eager:
            yield eager
        return
    if index == len(state.waterfall.steps) - 1:  # the model as it ends
        yield state.model
        return
    final = Snapshot(state.model)
    graphs = [gm for _, gm in find_graphs(state.model)]
    forwards = {id(gm): gm.__dict__.pop("forward") for gm in graphs if "forward" in gm.__dict__}
    program.restore()
    try:
        yield state.model
    finally:
        final.restore()
        for gm in graphs:
            if id(gm) in forwards:
                gm.forward = forwards[id(gm)]


# The parts whose work is the same at every step unless a pass rewrites one of their modules
STEADY = ("vision_tower", "projector")


def untouched_parts(state: RunState) -> list[str]:
    """The parts no step changes: a vision tower or projector outside every graph whose modules no
    model-scope pass rewrote (the vision tower of a partly captured VLM in bfloat16, say)."""
    graphs = [path for path, _ in find_graphs(state.model)]
    if "" in graphs:
        return []
    rewritten = rewritten_modules(state.model, state.transform_history)
    touched, seen = set(), set()
    for path, _module in state.model.named_modules():
        if (part := part_of(path)) not in STEADY:
            continue
        seen.add(part)
        if any(path == g or path.startswith(g + ".") for g in graphs) or any(
            path == r or path.startswith(r + ".") or r.startswith(path + ".") for r in rewritten
        ):
            touched.add(part)
    return sorted(seen - touched)


def rounds(state: RunState, first: dict[int, Phases] | None = None) -> None:
    """profile.waterfall_rounds rounds, each visiting every step in order; `first`: step index ->
    phases the profile stage already measured, taken as that step's first round."""
    waterfall, first = state.waterfall, first or {}
    waterfall.untouched = untouched_parts(state)
    for round_ in range(state.cfg.profile.waterfall_rounds):
        for index, measured in enumerate(waterfall.steps):
            if round_ == 0 and index in first:
                _add(measured, first[index])
                continue
            backend = state.backend if measured.name == state.backend else AS_BUILT
            trace_dir = state.run_dir / "waterfall" / "traces" / measured.name
            with _running(state, index) as model:
                _add(measured, _profile(state, model, backend, trace_dir))
