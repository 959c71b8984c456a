"""profile: demollm's prefill and decode steps under torch.profiler, one window per step, read
into module trees (model and summary views), tables, CSV, profile.json and a Chrome trace per phase.

The workload is the configured one (prompt.batch_size x prompt.prompt_len), for
profile.decode_steps decode steps with EOS ignored, so every window exists. An unprofiled
generation of the same workload runs first: it warms up and gives the step times the profiled
ones are compared with (profile/overhead_ratio).
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from pipeline.errors import StageFailure
from pipeline.faults import maybe_fail
from pipeline.profiler import events, output, tables, tree
from pipeline.profiler.categories import Categorizer
from pipeline.profiler.ranges import module_ranges
from pipeline.runtime.requests import build_requests
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState, StageResult

log = logging.getLogger(__name__)

COARSE = {
    "torch-compile": "a compiled graph shows as one module (its kernels are Inductor's)",
    "torch-cudagraph": "kernels of CUDA graph replays group under CUDAGraphRunner",
    "torch-opt": "kernels of CUDA graph replays group under CUDAGraphRunner",
}


class WindowCollector:
    """on_trace_ready: each closed window becomes a phase (prefill, decode_1, ...), its Chrome
    trace written at once and its events read while the profiler still holds them."""

    def __init__(self, trace_dir: Path, module_names: dict[int, str]):
        self.trace_dir, self.module_names = trace_dir, module_names
        self.windows: list[tuple[str, events.Window]] = []

    def __call__(self, prof) -> None:
        phase = "prefill" if not self.windows else f"decode_{len(self.windows)}"
        prof.export_chrome_trace(str(self.trace_dir / f"{phase}.json"))
        self.windows.append((phase, events.read_window(prof, self.module_names)))


def _context(state: RunState) -> dict:
    import transformers

    cfg = state.cfg
    return {
        "model": cfg.model.name,
        "architecture": state.model_info.architecture if state.model_info else "",
        "capture": cfg.capture.mode,
        "backend": state.backend,
        "attention": state.attention,
        "dtype": str(state.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(state.device) if state.device.type == "cuda" else "cpu",
        "batch_size": cfg.prompt.batch_size,
        "prompt_len": cfg.prompt.prompt_len,
        "decode_steps": cfg.profile.decode_steps,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _entry(root: tree.Node, step_s: float) -> dict:
    attributed, in_layers = tree.coverage(root)
    return {
        "step_ms": 1000 * step_s,
        "device_time_us": root.device_time_us,
        "coverage_pct": attributed,
        "layer_coverage_pct": in_layers,
        "summary_stats": output.to_dict(tree.summary_tree(root)),
        "model_stats": output.to_dict(root),
    }


def _weighted(phases: dict[str, dict], key: str) -> float:
    """A percentage over all step windows together, each weighted by its device time."""
    steps = [e for name, e in phases.items() if name != "decode"]
    total = sum(e["device_time_us"] for e in steps)
    return sum(e[key] * e["device_time_us"] for e in steps) / total if total else 0.0


def run(state: RunState) -> StageResult:
    cfg = state.cfg
    if not cfg.profile.enabled:
        return StageResult(notes=["profile.enabled=false: not profiled"])
    if state.engine is None:
        raise StageFailure("nothing to profile: the generate stage built no engine")
    engine = state.engine
    steps = cfg.profile.decode_steps
    requests = build_requests(cfg, state.hf_config, state.dtype, state.device, state.tokenizer)
    params = SamplingParams(**cfg.runtime.sampling)
    folder, trace_dir = state.run_dir / "profile", state.run_dir / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    trace_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if state.device.type == "cuda" else [])
    # Graph ranges only change a graph that runs its own forward (torch-simple).
    ranges = module_ranges(state.model) if state.backend == "torch-simple" else nullcontext([])
    collector = WindowCollector(trace_dir, {})
    eos, engine.eos_ids = engine.eos_ids, set()  # every window exists: no early stop
    try:
        # Stepped as the profiled run is (each step read before the next is launched), so that the
        # overhead ratio is the profiler's alone.
        unprofiled = engine.generate(requests, steps + 1, params, cfg.seed, after_step=lambda: None)
        with ranges as instrumented, warnings.catch_warnings():
            # warmup=0 is deliberate: windows are consecutive steps, and the warm-up ran above.
            warnings.filterwarnings("ignore", message=".*warmup.*")
            warnings.filterwarnings("ignore", message=".*clears events.*")
            collector.module_names = {id(m): name for name, m in state.model.named_modules()}
            with profile(
                activities=activities,
                record_shapes=True,
                with_stack=True,
                schedule=schedule(wait=0, warmup=0, active=1, repeat=steps + 1),
                on_trace_ready=collector,
            ) as prof:
                maybe_fail("profile")
                profiled = engine.generate(requests, steps + 1, params, cfg.seed, after_step=prof.step)
    finally:
        engine.eos_ids = eos
    step_times = [profiled.prefill_s, *profiled.decode_step_s]
    if len(collector.windows) != len(step_times):
        raise StageFailure(
            f"the profiler closed {len(collector.windows)} windows for {len(step_times)} steps"
        )

    categorize = Categorizer(cfg.profile.kernel_categories)
    trees = [tree.model_tree(window, phase, categorize) for phase, window in collector.windows]
    phases = {
        phase: _entry(root, step_s)
        for (phase, _), root, step_s in zip(collector.windows, trees, step_times, strict=True)
    }
    phases["decode"] = {
        **_entry(tree.mean_tree(trees[1:], "decode"), statistics.median(profiled.decode_step_s)),
        "mean_of": [phase for phase, _ in collector.windows[1:]],
    }
    profile_json = folder / "profile.json"
    profile_json.write_text(
        json.dumps({"schema_version": output.SCHEMA_VERSION, "context": _context(state), "phases": phases})
    )
    model_csv, summary_csv = folder / "model_stats.csv", folder / "summary_stats.csv"
    output.write_csv(model_csv, phases, "model_stats")
    output.write_csv(summary_csv, phases, "summary_stats")
    depth, top_k = cfg.profile.table_depth, cfg.profile.table_top_k
    printed = "\n\n".join(
        tables.phase_table({"phases": phases}, phase, table, depth, top_k)
        for table in ("summary", "model")
        for phase in ("prefill", "decode")
    )
    tables_txt = folder / "tables.txt"
    tables_txt.write_text(printed + "\n")
    log.info("profile tables (depth %s, top %s per node):\n%s", depth, top_k, printed)

    unprofiled_decode = statistics.median(unprofiled.decode_step_s)
    metrics = {
        "profile/prefill_ms": 1000 * profiled.prefill_s,
        "profile/decode_ms": 1000 * statistics.median(profiled.decode_step_s),
        "profile/overhead_ratio": statistics.median(profiled.decode_step_s) / unprofiled_decode,
        "profile/prefill_overhead_ratio": profiled.prefill_s / unprofiled.prefill_s,
        "profile/coverage_pct": _weighted(phases, "coverage_pct"),
        "profile/layer_coverage_pct": _weighted(phases, "layer_coverage_pct"),
        "profile/windows": len(collector.windows),
    }
    notes = [
        f"{len(collector.windows)} windows (prefill, decode_1..{steps}); profiled decode "
        f"{metrics['profile/decode_ms']:.2f} ms/step = {metrics['profile/overhead_ratio']:.2f}x unprofiled",
        f"coverage: {metrics['profile/coverage_pct']:.1f} % of device time in a module, "
        f"{metrics['profile/layer_coverage_pct']:.1f} % of the layer stacks' time in a layer or deeper",
    ]
    if instrumented:
        notes.append(f"module ranges from nn_module_stack in {', '.join(instrumented)}")
    if state.backend in COARSE:
        notes.append(
            f"backend {state.backend}: {COARSE[state.backend]}; finer attribution needs "
            "backend=torch-simple or capture=none"
        )
    notes.append(f"profile.json, CSV tables and tables.txt in {folder}; Chrome traces in {trace_dir}")
    return StageResult(
        metrics=metrics,
        artifacts=[profile_json, model_csv, summary_csv, tables_txt, trace_dir],
        notes=notes,
    )
