"""profile.waterfall=true: what each step from Hugging Face's eager model to the captured one
bought and cost, measured on the one model as the stages advance it.

The steps, cumulative:
- `eager`: Hugging Face generate on the model as built (the export stage, before it exports);
- `graph_and_cache`: the graph swapped in with the transforms a graph needs to decode with demollm
  (cleanup, match_attention, shard where it runs, insert_cached_attention), since a graph without
  a cache cannot decode: export alone is no step of its own;
- then each further enabled transform in the registry's order, one step each (the transforms
  stage applies them in that order: `order`);
- the capture backend (the capture stage, after its warm-up), unless it is torch-simple.

After each step its graphs are written as code, `waterfall/graphs/<step>/<graph>.py`, headed by
their node count, so two steps' files diff to what the step changed. Each step is profiled on the
run's workload as the profile stage profiles it (a prefill window and
profile.decode_steps decode windows): device ms per step of each phase and of each top-level part
(breakdown.PARTS). Its cost is its apply (or compile) seconds and the memory it added (the
process's resident bytes on CPU, allocated device bytes on a GPU). Its numerics are the parts past
tolerance then (numerics.measure): the step at which a layer first drifted is named.

A step's share of a phase's gain is (the previous step's ms - its ms) / (eager's ms - the last
step's ms): the shares telescope, so they add up to the whole gain (a negative share is a step
that cost time).
"""

from __future__ import annotations

import psutil
import torch

from pipeline import numerics
from pipeline.backends.compile import compile_module
from pipeline.correctness import TOLERANCE
from pipeline.graphs import find_graphs
from pipeline.profiler import session
from pipeline.profiler.stepwise import PHASES, Step, Waterfall
from pipeline.report.breakdown import part_times
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState

# What a graph needs before demollm can decode with it; applied together as one step.
DECODING = ("cleanup", "match_attention", "shard", "insert_cached_attention")


def order(transforms: list) -> list[list]:
    """The transforms as waterfall steps: the ones a decoding graph needs first (one step), then
    each other enabled one, in the given order."""
    enabled = [t for t in transforms if t.config.enabled]
    first = [t for t in enabled if t.name in DECODING]
    return [first] + [[t] for t in enabled if t.name not in DECODING]


def check(transforms: list) -> None:
    """The waterfall's order must be one the transforms allow, and its first step must decode:
    a ConfigError naming the fix otherwise."""
    from pipeline.errors import ConfigError
    from pipeline.transforms.registry import check_order

    if not any(t.name == "insert_cached_attention" and t.config.enabled for t in transforms):
        raise ConfigError(
            "profile.waterfall=true steps through graphs demollm decodes with: enable "
            "transforms.insert_cached_attention"
        )
    check_order([t for group in order(transforms) for t in group])


def _memory(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def start(state: RunState) -> None:
    """The eager step, on the model as Hugging Face built it."""
    state.waterfall = Waterfall(last_memory=_memory(state.device))
    measure(state, "eager", 0.0)


def measure(state: RunState, name: str, cost_s: float) -> Step:
    """Profile the model as it is now on the run's workload; append the step."""
    waterfall = state.waterfall
    engine = DemoLLM(state.model, state.hf_config, state.cfg.runtime, state.device, eos_ids=set())
    requests, params = state.workload(), SamplingParams(**vars(state.cfg.runtime.sampling))

    def generate(max_new_tokens, after_step):
        return engine.generate(requests, max_new_tokens, params, state.cfg.seed, after_step=after_step)

    backend = state.backend if name == state.backend else "torch-simple"
    trace_dir = state.run_dir / "waterfall" / "traces" / name
    trace_dir.mkdir(parents=True, exist_ok=True)
    profiled = session.profile_steps(
        engine.runner.model, generate, state.cfg.profile.decode_steps, trace_dir, state.device.type == "cuda", backend
    )  # fmt: skip
    phases = session.phases_of(profiled, state.cfg.profile.kernel_categories)
    memory = _memory(state.device)
    step = Step(
        name,
        cost_s,
        (memory - waterfall.last_memory) / 2**20,
        {phase: phases[phase]["device_time_us"] / 1000 for phase in PHASES},
        {
            phase: {p: us / 1000 for p, us in part_times(phases[phase]["summary_stats"]).items()}
            for phase in PHASES
        },
    )
    waterfall.last_memory = memory
    for graph_name, gm in find_graphs(state.model):
        step.nodes += len(gm.graph.nodes)
        code = state.run_dir / "waterfall" / "graphs" / name / f"{graph_name or 'root'}.py"
        code.parent.mkdir(parents=True, exist_ok=True)
        code.write_text(f"# {len(gm.graph.nodes)} nodes after step {name}\n{gm.code}")
    if state.reference is not None and state.reference.part_order:
        compile_copy = compile_module if backend in ("torch-compile", "torch-opt") else (lambda _module: None)
        errors = numerics.measure(
            state.model, state.reference, state.check_calls, TOLERANCE[state.dtype], compile_copy
        )
        step.drifted = [e.part for e in errors if e.past_tolerance]
    waterfall.steps.append(step)
    return step
