"""A profiled generation: an unprofiled warm-up of the same workload, then one torch.profiler window
per step (prefill, decode_1 .. decode_N), each read into a module tree, and the phases, metrics and
files made from them.

The unprofiled generation warms up and gives the step times the profiled ones are compared with
(profile/overhead_ratio). Both run with every step read before the next is launched, so the ratio is
the profiler's alone, and with EOS ignored, so every window exists.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

from pipeline.profiler import events, ranges, tree
from pipeline.profiler.attribution import Instrumentation, instrumented
from pipeline.profiler.categories import Categorizer
from pipeline.profiler.rows import Phases, PhaseStats
from pipeline.runtime.engine import Generation


class WindowsMissing(RuntimeError):
    """The profiler closed fewer windows than the generation had steps."""


class WindowCollector:
    """on_trace_ready: each closed window becomes a phase named by its step (prefill, prefill_2 when
    a prompt was chunked or requests queued, decode_1, ...), its Chrome trace written at once and
    its events read while the profiler still holds them. The engine says which kind of step each
    window holds (`pending`) before the profiler closes it; a window closed without one (the empty
    one the profiler closes on exit) is dropped."""

    def __init__(self, trace_dir: Path, module_names: dict[int, str]):
        self.trace_dir, self.module_names = trace_dir, module_names
        self.windows: list[tuple[str, events.Window]] = []
        self.pending: str | None = None
        self.counts = {"prefill": 0, "decode": 0}

    def __call__(self, prof) -> None:
        kind, self.pending = self.pending, None
        if kind is None:
            return
        self.counts[kind] += 1
        n = self.counts[kind]
        phase = "prefill" if kind == "prefill" and n == 1 else f"{kind}_{n}"
        write_trace(prof, self.trace_dir / phase)
        self.windows.append((phase, events.read_window(prof, self.module_names)))


@dataclass
class ProfiledRun:
    windows: list[tuple[str, events.Window]]
    step_s: list[float]  # the profiled steps' own times, in order (a window each)
    unprofiled: Generation  # the same workload without the profiler, as the timed runs execute it
    profiled: Generation
    instrumentation: Instrumentation = field(default_factory=Instrumentation)
    counts: dict[str, int] = field(default_factory=dict)  # calls attributed per way, over all windows


def profile_steps(
    model: nn.Module,
    generate,
    decode_steps: int,
    trace_dir: Path,
    on_cuda: bool,
    backend: str,
    kernel_provenance: bool = True,
) -> ProfiledRun:
    """generate(max_new_tokens, after_step) runs the workload: once unprofiled as the timed runs run
    it, then with the backend's graphs instrumented (attribution.py; a compiled variant warms up
    first, outside any window, unless kernel_provenance is off), once profiled with one window per
    step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    unprofiled = generate(decode_steps + 1, lambda kind: None)
    collector = WindowCollector(trace_dir, {})
    with (
        instrumented(model, backend, on_cuda, kernel_provenance) as instrumentation,
        warnings.catch_warnings(),
    ):
        if instrumentation.recorders:
            generate(decode_steps + 1, lambda kind: None)  # compiles the profiled variants
        # warmup=0 is deliberate: windows are consecutive steps, and the warm-up ran above.
        warnings.filterwarnings("ignore", message=".*warmup.*")
        warnings.filterwarnings("ignore", message=".*clears events.*")
        collector.module_names = {id(m): name for name, m in model.named_modules()}
        with (
            ranges.eager_module_ranges(model),
            profile(
                activities=activities,
                record_shapes=True,
                with_stack=True,
                schedule=schedule(wait=0, warmup=0, active=1),
                on_trace_ready=collector,
            ) as prof,
        ):

            def close_window(kind: str) -> None:
                collector.pending = kind
                prof.step()

            profiled = generate(decode_steps + 1, close_window)
    step_s = [s.seconds for s in profiled.steps]
    if len(collector.windows) != len(step_s):
        raise WindowsMissing(f"the profiler closed {len(collector.windows)} windows for {len(step_s)} steps")
    counts: dict[str, int] = {}
    for _, window in collector.windows:  # after the windows: attribution never runs inside one
        for way, n in instrumentation.apply(window).items():
            counts[way] = counts.get(way, 0) + n
    return ProfiledRun(collector.windows, step_s, unprofiled, profiled, instrumentation, counts)


def context(device: torch.device, **run: str | int | float) -> dict[str, str | int | float]:
    """profile.json's context: what ran (the run's own fields), on what, with which versions."""
    import transformers

    return {
        **run,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def phases_of(run: ProfiledRun, categories: dict[str, str]) -> Phases:
    """profile.json's phases: one per window, and `decode`, the mean of the decode windows (its step
    time the mean of theirs too, so the two numbers describe the same average step)."""
    categorize = Categorizer(categories)
    trees = [tree.model_tree(window, phase, categorize) for phase, window in run.windows]
    phases = {
        phase: PhaseStats.of(root, 1000 * step_s, "one window")
        for (phase, _), root, step_s in zip(run.windows, trees, run.step_s, strict=True)
    }
    decode = [i for i, (phase, _) in enumerate(run.windows) if phase.startswith("decode_")]
    if decode:
        mean = PhaseStats.of(
            tree.mean_tree([trees[i] for i in decode], "decode"),
            statistics.mean(1000 * run.step_s[i] for i in decode),
            f"mean of {len(decode)} windows",
        )
        mean.step_ms_median = statistics.median(1000 * run.step_s[i] for i in decode)
        mean.mean_of = [run.windows[i][0] for i in decode]
        phases["decode"] = mean
    return phases


def _weighted(phases: Phases, key: str) -> float:
    """A percentage over all step windows together, each weighted by its device time."""
    steps = [e for name, e in phases.items() if name != "decode"]
    total = sum(e.device_time_us for e in steps)
    return sum(getattr(e, key) * e.device_time_us for e in steps) / total if total else 0.0


def metrics_of(run: ProfiledRun, phases: Phases) -> dict[str, float]:
    profiled, unprofiled = run.profiled, run.unprofiled
    decode = statistics.median(profiled.decode_step_s)
    steps = [e for name, e in phases.items() if name != "decode"]
    total = sum(e.device_time_us for e in steps)
    metrics = {
        "profile/prefill_ms": 1000 * profiled.prefill_s,
        "profile/decode_ms": 1000 * decode,
        "profile/overhead_ratio": decode / statistics.median(unprofiled.decode_step_s),
        "profile/prefill_overhead_ratio": profiled.prefill_s / unprofiled.prefill_s,
        "profile/coverage_pct": _weighted(phases, "coverage_pct"),
        "profile/layer_coverage_pct": _weighted(phases, "layer_coverage_pct"),
        "profile/windows": len(run.windows),
    }
    for way in tree.ATTRIBUTIONS:  # the share of device time each way attributed, all windows
        share = sum(e.attribution_pct[way] * e.device_time_us for e in steps) / total if total else 0.0
        metrics[f"profile/attributed_{way}_pct"] = share
    return metrics


def layer_coverage(phases: Phases, prefix: str) -> float:
    """The layer coverage of the phases whose names start with prefix (prefill, decode_)."""
    chosen = {name: e for name, e in phases.items() if name.startswith(prefix) and name != "decode"}
    return _weighted(chosen, "layer_coverage_pct")


def write_trace(prof, folder: Path) -> Path:
    """The window's Chrome trace as `<folder>/rank<r>.json` with `distributedInfo` (rank, world
    size): the layout Holistic Trace Analysis reads, a folder of one file per rank (a file without
    a rank counts as rank 0, so a folder of phases would collide there)."""
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    trace.setdefault("distributedInfo", {"backend": "none", "rank": rank, "world_size": world_size})
    path.write_text(json.dumps(trace))
    return path
