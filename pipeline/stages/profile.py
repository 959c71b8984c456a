"""profile: demollm's prefill and decode steps under torch.profiler, one window per step, read
into module trees (model and summary views), tables, CSV, profile.json and a Chrome trace per phase.

The workload is the configured one (prompt.batch_size x prompt.prompt_len), for
profile.decode_steps decode steps with EOS ignored, so every window exists; an unprofiled
generation of the same workload runs first (pipeline/profiler/session.py).
"""

from __future__ import annotations

import logging

from pipeline.devices import dtype_name
from pipeline.errors import StageFailure
from pipeline.faults import maybe_fail
from pipeline.profiler import session
from pipeline.runtime.requests import build_requests
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState, StageResult

log = logging.getLogger(__name__)

COARSE = {
    "torch-compile": "a compiled graph shows as one module (its kernels are Inductor's)",
    "torch-cudagraph": "kernels of CUDA graph replays group under CUDAGraphRunner",
    "torch-opt": "kernels of CUDA graph replays group under CUDAGraphRunner",
}


def _context(state: RunState) -> dict:
    cfg = state.cfg
    return session.context(
        state.device,
        model=cfg.model.name,
        architecture=state.model_info.architecture if state.model_info else "",
        capture=cfg.capture.mode,
        backend=state.backend,
        attention=state.attention,
        dtype=dtype_name(state.dtype),
        batch_size=cfg.prompt.batch_size,
        prompt_len=cfg.prompt.prompt_len,
        decode_steps=cfg.profile.decode_steps,
    )


def run(state: RunState) -> StageResult:
    cfg = state.cfg
    if not cfg.profile.enabled:
        return StageResult(notes=["profile.enabled=false: not profiled"])
    if state.engine is None:
        raise StageFailure("nothing to profile: the generate stage built no engine")
    engine, steps = state.engine, cfg.profile.decode_steps
    requests = build_requests(
        cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, state.dtype, state.device, state.sources,
        chunked=cfg.capture.mode != "none",
    )  # fmt: skip
    params = SamplingParams(**vars(cfg.runtime.sampling))
    folder, trace_dir = state.run_dir / "profile", state.run_dir / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    trace_dir.mkdir(parents=True, exist_ok=True)

    def generate(max_new_tokens, after_step):
        maybe_fail("profile")
        return engine.generate(requests, max_new_tokens, params, cfg.seed, after_step=after_step)

    eos, engine.eos_ids = engine.eos_ids, set()  # every window exists: no early stop
    try:
        # Graph ranges only change a graph that runs its own forward (torch-simple).
        profiled = session.profile_steps(
            state.model,
            generate,
            steps,
            trace_dir,
            state.device.type == "cuda",
            state.backend == "torch-simple",
        )
    except session.WindowsMissing as exc:
        raise StageFailure(str(exc)) from exc
    finally:
        engine.eos_ids = eos
    phases = session.phases_of(profiled, cfg.profile.kernel_categories)
    files, printed = session.write(
        folder, _context(state), phases, cfg.profile.table_depth, cfg.profile.table_top_k
    )
    log.info(
        "profile tables (depth %s, top %s per node):\n%s",
        cfg.profile.table_depth,
        cfg.profile.table_top_k,
        printed,
    )
    metrics = session.metrics_of(profiled, phases)
    notes = [
        f"{len(profiled.windows)} windows ({', '.join(name for name, _ in profiled.windows[:2])}, ...); profiled decode "
        f"{metrics['profile/decode_ms']:.2f} ms/step = {metrics['profile/overhead_ratio']:.2f}x unprofiled",
        f"coverage: {metrics['profile/coverage_pct']:.1f} % of device time in a module, "
        f"{metrics['profile/layer_coverage_pct']:.1f} % of the layer stacks' time in a layer or deeper",
    ]
    if profiled.instrumented:
        notes.append(f"module ranges from nn_module_stack in {', '.join(profiled.instrumented)}")
    if state.backend in COARSE:
        notes.append(
            f"backend {state.backend}: {COARSE[state.backend]}; finer attribution needs "
            "backend=torch-simple or capture=none"
        )
    notes.append(f"profile.json, CSV tables and tables.txt in {folder}; Chrome traces in {trace_dir}")
    return StageResult(metrics=metrics, artifacts=[*files, trace_dir], notes=notes)
