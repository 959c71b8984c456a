"""generate: demollm on the configured workload. Prefill all prompts in one step, then decode one
token per sequence per step; tokens, latencies and throughput go to the run."""

from __future__ import annotations

import json

from pipeline.backend_specs import spec
from pipeline.backends import piecewise
from pipeline.backends.compile import compiled_frames
from pipeline.backends.compile_log import LOG
from pipeline.errors import StageFailure
from pipeline.models.memory import decode_weight_bytes
from pipeline.models.zoo import eos_ids
from pipeline.runtime import metrics as generation
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.machine_load import MachineLoad, noise_verdict, quantile, read_limit_gbs
from pipeline.runtime.routed_bytes import routed_decode_bytes
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState, StageResult


def _decode_bytes(state: RunState) -> int:
    """The weights a step reads: the whole model's as loaded, or, on a tensor-parallel rank, its
    shards of the graph and the replicated rest (lm_head)."""
    if state.rank is None:
        return state.model_info.decode_bytes
    paths = state.model_info.language_model_paths
    return decode_weight_bytes(state.model, paths[0] if paths else "")


def run(state: RunState) -> StageResult:
    cfg = state.cfg
    requests = state.workload()
    try:
        engine = DemoLLM(state.model, state.hf_config, cfg.runtime, state.device, eos_ids(state.hf_config))
    except ValueError as exc:
        raise StageFailure(f"{exc}{_why_no_cache(state)}") from exc
    params = SamplingParams(**vars(cfg.runtime.sampling))
    # A compiling or graph-capturing backend compiles the step shapes it first meets: warm up once so
    # the measured run times steps, not compilation (benchmark mode always warms up).
    warm_up = cfg.benchmark.enabled or not spec(state.backend).runs_as_built
    if warm_up:
        engine.generate(requests, cfg.prompt.output_len, params, cfg.seed)
    for runner in piecewise.runners(state.model):  # its table is of the timed runs' steps
        runner.stats = piecewise.PiecewiseStats()
    iterations = cfg.benchmark.iterations if cfg.benchmark.enabled else 1
    with MachineLoad(peers=state.rank is not None) as load:
        runs = [engine.generate(requests, cfg.prompt.output_len, params, cfg.seed) for _ in range(iterations)]
    state.engine, state.generation = engine, runs[-1]

    tokens_file = state.run_dir / "generation" / "tokens.json"
    tokens_file.parent.mkdir(parents=True, exist_ok=True)
    generation.write_tokens(tokens_file, requests, runs[-1])
    metrics, notes = _throughput(state, engine, requests, runs, warm_up)
    resources, artifacts, tables, resource_notes = _piecewise_and_resources(state, engine)
    noisy, why = _noise(state, engine, runs, load, metrics)
    if noisy:
        notes.append(f"NOISY measurement: {why}; re-run on a quiet machine before comparing")
    return StageResult(
        metrics=metrics | resources,
        artifacts=[tokens_file, *artifacts],
        tables=tables,
        notes=notes + resource_notes,
        tags={"noisy": str(noisy).lower(), **({"noisy_reason": why} if noisy else {})},
        # steps whose time holds model work (StepTiming.worked)
        steps={
            "latency/decode_step_ms": [
                1000 * s.seconds for s in runs[-1].steps if s.kind == "decode" and s.worked
            ]
        },
        workload={
            "request": [r.seq_id for r in requests],
            "prompt_tokens": [len(r.prompt) for r in requests],
            "images": [len(r.image_spans) or (1 if r.images else 0) for r in requests],
            "max_new_tokens": [cfg.prompt.output_len] * len(requests),
        },
    )


def _throughput(state: RunState, engine: DemoLLM, requests, runs, warm_up: bool) -> tuple[dict, list[str]]:
    """Latency and throughput of the timed runs, decode GB/s over the bytes a step reads (the
    routed experts' only where they can be counted), and the recompiles during generation."""
    routed_bytes, bytes_notes = _routed_bytes(state, engine, requests)
    decode_bytes = routed_bytes if routed_bytes is not None else _decode_bytes(state)
    metrics = generation.generation_metrics(runs, decode_bytes, engine.lookahead)
    notes = generation.generation_notes(engine, requests, metrics, len(runs), warm_up) + bytes_notes
    if routed_bytes is not None:
        metrics["model/decode_routed_bytes"] = routed_bytes
    if spec(state.backend).compiles:
        metrics["capture/recompiles"] = compiled_frames() - state.compiled_frames
        recompiled = LOG.since(state.compile_log_mark)
        notes.append(
            f"recompilations during generation: {int(metrics['capture/recompiles'])}"
            + "".join(
                f"; !!! {f.graph} ({f.compile_id}): {f.recompile_reason or 'first compile'}"
                for f in recompiled[:3]
            )
        )
    return metrics, notes


def _piecewise_and_resources(state: RunState, engine: DemoLLM) -> tuple[dict, list, dict, list[str]]:
    """Memory and buffers, and the piecewise runners' bucket table (generation/piecewise.json and
    an MLflow table): (metrics, artifacts, tables, notes)."""
    reports = [runner.report() for runner in piecewise.runners(state.model)]
    resources, notes = generation.resource_metrics(state.model, engine, reports)
    artifacts, tables = [], {}
    for report in reports:  # one table: only the language model is cached
        path = state.run_dir / "generation" / "piecewise.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        artifacts.append(path)
        if report["rows"]:
            tables["tables/piecewise.json"] = {
                key: [r[key] for r in report["rows"]] for key in report["rows"][0]
            }
    return resources, artifacts, tables, notes


def _noise(state: RunState, engine: DemoLLM, runs, load: MachineLoad, metrics: dict) -> tuple[bool, str]:
    """Whether the measurement is noisy (other processes' CPU time, the decode steps' spread), and
    the read limit of this moment beside the run's own read rate: the machine's drifts by 2x in an
    hour."""
    steps = generation.decode_steps_ms(runs, engine.lookahead)
    noisy, why = noise_verdict(load.other_cores, steps)
    metrics["noise/other_cores"] = load.other_cores
    metrics["throughput/read_limit_gbs"] = read_limit_gbs(state.device)
    metrics["throughput/decode_pct_of_limit"] = (
        100 * metrics["throughput/decode_gbs"] / metrics["throughput/read_limit_gbs"]
    )
    if steps:
        metrics["noise/decode_spread"] = quantile(steps, 0.9) / quantile(steps, 0.1)
    return noisy, why


def _routed_bytes(state: RunState, engine: DemoLLM, requests) -> tuple[float | None, list[str]]:
    """The weight bytes a decode step reads where match_moe put pipeline::moe in the graph: the
    routed experts' only, counted on one more (untimed) generation. None where every weight of the
    language model and lm_head counts (no routed experts, or CUDA-graph replays hid the routing)."""
    if not (state.transform_history and state.transform_history.matches("match_moe")):
        return None, []
    every_expert = state.model_info.decode_bytes
    routed = routed_decode_bytes(engine, requests, state.cfg.prompt.output_len, every_expert, state.device)
    if routed is None:
        return None, [
            "decode GB/s counts every expert's weights: the decode steps ran in CUDA graphs, whose "
            "replays do not call pipeline::moe where its routing could be counted"
        ]
    return routed, [
        f"decode GB/s counts the routed experts only: {routed / 1e9:.3f} of {every_expert / 1e9:.3f} GB "
        "a step (mean over the decode steps of an untimed generation)"
    ]


CACHE_TRANSFORMS = ("match_attention", "insert_cached_attention")


def _why_no_cache(state: RunState) -> str:
    """What the transform history says about the two transforms a cached graph needs: disabled or
    missing (then the switch to turn on), or applied without a match (then that transform's record
    in transforms/report.json, with where its pattern stopped)."""
    history = state.transform_history
    records = history.records if history else []
    for name in CACHE_TRANSFORMS:
        mine = [r for r in records if r.transform == name]
        if not mine or all(r.status == "disabled" for r in mine):
            return f"; transforms.{name} is not enabled: enable it (conf/transforms/default.yaml)"
        if not any(r.matches for r in mine):
            reason = next((r.reason for r in mine if r.reason), "no reason recorded")
            return f"; transforms.{name} matched nothing ({reason}): see transforms/report.json"
    return ""
