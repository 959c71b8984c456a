"""profile: demollm's prefill and decode steps under torch.profiler, one window per step, read
into module trees (model and summary views), tables, CSV, profile.json and a Chrome trace per phase;
inside captured graphs too (pipeline/profiler/attribution.py), and beside them the eager model on
the same workload (profile.reference=eager), compared module by module.

The workload is the configured one (prompt.batch_size x prompt.prompt_len), for
profile.decode_steps decode steps with EOS ignored, so every window exists; an unprofiled
generation of the same workload runs first (pipeline/profiler/session.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from pipeline import numerics, waterfall
from pipeline.backend_specs import AS_BUILT, spec
from pipeline.devices import dtype_name
from pipeline.errors import StageFailure
from pipeline.faults import maybe_fail
from pipeline.graphs import eager_graphs, find_graphs
from pipeline.profiler import provenance, session, stepwise
from pipeline.profiler.comparison import comparison
from pipeline.profiler.layers import LAYER, Unlike, layer_kinds, layer_rows
from pipeline.profiler.parts import category_pct, gap_us, part_times
from pipeline.profiler.results import ProfileResults
from pipeline.profiler.roofline import Roofs, StepShape, gemm_shapes, roofline
from pipeline.profiler.rows import LayerRow, Phases, Reference
from pipeline.report.breakdown import long_table
from pipeline.report.plots import waterfall_plot
from pipeline.report.ranks import COMMUNICATION
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.machine_load import gemm_tflops, read_limit_gbs
from pipeline.runtime.sampling import SamplingParams
from pipeline.state import RunState, StageResult
from pipeline.transforms.registry import model_passes_undone, moved_work, rewritten_modules

log = logging.getLogger(__name__)


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
        world_size=state.rank.world if state.rank is not None else 1,
    )


def _profiled(state: RunState, engine: DemoLLM, trace_dir, backend: str) -> session.ProfiledRun:
    cfg = state.cfg
    requests = state.workload()
    params = SamplingParams(**vars(cfg.runtime.sampling))

    def generate(max_new_tokens, after_step):
        maybe_fail("profile")
        return engine.generate(requests, max_new_tokens, params, cfg.seed, after_step=after_step)

    trace_dir.mkdir(parents=True, exist_ok=True)
    eos, engine.eos_ids = engine.eos_ids, set()  # every window exists: no early stop
    try:
        return session.profile_steps(
            engine.executor.model,
            generate,
            cfg.profile.decode_steps,
            trace_dir,
            state.device.type == "cuda",
            backend,
            cfg.profile.kernel_provenance,
        )
    except session.WindowsMissing as exc:
        raise StageFailure(str(exc)) from exc
    finally:
        engine.eos_ids = eos


def _roofs(state: RunState) -> Roofs:
    """The limits each part is set against, measured now, beside the profiled steps: the read
    limit (the higher of this one and the generate stage's: the host's read rate swings between
    measurements, and a roof is the best it reaches), and the GEMM rate at each GEMM shape the
    profiled prefill runs (roofline.gemm_shapes) on the model's own weight of that shape, in the
    run's dtype, the best of its calls. The steps' shapes are the generate stage's first steps:
    the same workload the profile runs."""
    text = getattr(state.hf_config, "text_config", None) or state.hf_config
    steps = state.generation.steps
    prefill = next(step for step in steps if step.kind == "prefill")
    decode = [step for step in steps if step.kind == "decode"][: state.cfg.profile.decode_steps]
    shapes = {"prefill": StepShape(prefill.fed, prefill.tokens, prefill.context, prefill.tokens)}
    if decode:
        batch = max(step.fed for step in decode)
        context = sum(step.context for step in decode) / len(decode)
        shapes["decode"] = StepShape(batch, batch, context, batch)
    heads = getattr(text, "num_attention_heads", 1)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    generated = next(r for r in state.stages if r.name == "generate")
    roofs = Roofs(
        read_gbs=max(read_limit_gbs(state.device), generated.metrics.get("throughput/read_limit_gbs", 0.0)),
        steps={phase: vars(shape) for phase, shape in shapes.items()},
        kv_token_bytes=2 * kv_heads * head_dim * state.dtype.itemsize,
        experts_per_token=getattr(text, "num_experts_per_tok", 0) or 0,
        window=getattr(text, "sliding_window", None) or 0,
    )
    for key, (m, k, n, weight) in sorted(gemm_shapes(state.model, roofs).items()):
        roofs.gemm_tflops[key] = gemm_tflops(
            m, k, n, state.dtype, state.device, 2, min, weight, warm_up=False
        )
    return roofs


def _trace_dir(state: RunState):
    """traces/ of the job's folder, for every rank: a phase's folder then holds one rank<k>.json per
    rank, the layout Holistic Trace Analysis reads as one distributed trace."""
    return (state.rank.root if state.rank is not None else state.run_dir) / "traces"


# What the reference is: the model as Hugging Face built it, run as its `generate` runs it (its
# attention and cache, logits_to_keep=1: runtime/executors.EagerExecutor)
REFERENCE = "Hugging Face generate, eager"


def _eager_reference(state: RunState) -> session.ProfiledRun:
    """The same workload on the model as Hugging Face built it: graphs swapped back for the modules
    they replaced, model-scope rewrites of the eager parts undone, HF's attention and cache."""
    with model_passes_undone(state.model, state.transform_history), eager_graphs(state.model) as eager:
        engine = DemoLLM(eager, state.hf_config, state.cfg.runtime, state.device, set())
        return _profiled(state, engine, _trace_dir(state) / "eager", AS_BUILT)


def part_metrics(phases: Phases, side: str) -> dict[str, float]:
    """layers/<phase><side>/<part>_ms and <part>_gap_ms: device ms per step of each top-level part
    (parts.PARTS) and the ms between its work, in prefill and decode (the decode windows' mean),
    a bounded set that charts across runs; profile/<phase><side>_gap_pct: the step's gaps as a
    share of its span."""
    metrics = {}
    for phase in ("prefill", "decode"):
        if phase not in phases:
            continue
        summary = phases[phase].summary_stats
        for suffix, value in (("ms", None), ("gap_ms", gap_us)):
            metrics |= {
                f"layers/{phase}{side}/{part}_{suffix}": us / 1000
                for part, us in part_times(summary, value).items()
            }
        metrics[f"profile/{phase}{side}_gap_pct"] = phases[phase].gap_pct
    return metrics


# At most this many decoder layers get metrics of their own (a bounded set per run); past it, layers
# evenly spaced from the first to the last, which the profile's note names.
LAYER_METRICS = 32


def layer_metrics(layers: dict[str, list[LayerRow]]) -> tuple[dict[str, float], str]:
    """layers/<phase>[_eager]/layer_<i>_ms and _gap_ms of the per-layer table's decoder layers
    (LAYER_METRICS of them at most), and a note saying which when capped, else ''."""
    metrics, note = {}, ""
    for phase, rows in layers.items():
        by_index = {int(r.part.rsplit(".", 1)[1]): r for r in rows if LAYER.match(r.part)}
        chosen = sorted(by_index)
        if len(chosen) > LAYER_METRICS:
            picks = {round(i * (len(chosen) - 1) / (LAYER_METRICS - 1)) for i in range(LAYER_METRICS)}
            chosen = [chosen[i] for i in sorted(picks)]
            note = f"per-layer metrics for {len(chosen)} of {len(by_index)} layers: {', '.join(map(str, chosen))}"
        for index in chosen:
            row = by_index[index]
            metrics[f"layers/{phase}/layer_{index}_ms"] = row.captured_ms
            metrics[f"layers/{phase}/layer_{index}_gap_ms"] = row.captured_gap_ms
            if row.eager_ms or row.eager_gap_ms:
                metrics[f"layers/{phase}_eager/layer_{index}_ms"] = row.eager_ms
                metrics[f"layers/{phase}_eager/layer_{index}_gap_ms"] = row.eager_gap_ms
    return metrics, note


def gap_note(results: ProfileResults) -> str:
    """The summary's line on gaps: each step's share of its span, gap-bound where over half, and
    how the comparison splits the gain."""
    said = []
    for phase in ("prefill", "decode"):
        if phase not in results.phases:
            continue
        sides = [("", results.phases[phase])]
        if results.reference is not None and phase in results.reference.phases:
            sides.append(("eager ", results.reference.phases[phase]))
        shares = ", ".join(
            f"{side}{p.gap_pct:.0f} %" + (" gap-bound" if p.gap_bound else "") for side, p in sides
        )
        total = results.comparison.get(phase, [None])[-1]
        split = (
            f" (captured - eager: busy {-total.busy_saved_ms:+.3f} ms, gaps {-total.gaps_removed_ms:+.3f} ms)"
            if total is not None
            else ""
        )
        said.append(f"{phase} {shares}{split}")
    return "gaps between ops (share of each step's span): " + "; ".join(said)


def run(state: RunState) -> StageResult:
    cfg = state.cfg
    if not cfg.profile.enabled:
        return StageResult(notes=["profile.enabled=false: not profiled"])
    if state.engine is None:
        raise StageFailure("nothing to profile: the generate stage built no engine")
    folder, trace_dir = state.run_dir / "profile", _trace_dir(state)
    folder.mkdir(parents=True, exist_ok=True)
    roofs = _roofs(state)
    profiled = _profiled(state, state.engine, trace_dir, state.backend)
    results = ProfileResults(_context(state), session.phases_of(profiled, cfg.profile.kernel_categories))
    if cfg.profile.reference == "eager" and state.captured:
        _compare_with_eager(state, results, profiled)
    if state.waterfall is not None:  # the profile's own measurements are the first round's ends
        last = len(state.waterfall.steps) - 1
        first = {0: results.reference.phases, last: results.phases} if results.reference else {}
        state.waterfall.profile_speedup = results.speedups()
        waterfall.rounds(state, first)
    results.roofs, results.roofline = roofs, roofline(results.phases, state.model, roofs)
    results.layers = _layer_table(state, results)
    files, printed = results.write(folder, cfg.profile.table_depth, cfg.profile.table_top_k)
    log.info(
        "profile tables (depth %s, top %s per node):\n%s",
        cfg.profile.table_depth,
        cfg.profile.table_top_k,
        printed,
    )
    metrics = _metrics(state, profiled, results)
    tables = {
        "tables/module_breakdown.json": long_table(results.phases, "module"),
        "tables/kernel_categories.json": long_table(results.phases, "category"),
    }
    if results.layers:
        tables["tables/layers.json"] = _columns(results.layers)
    result = StageResult(
        metrics=metrics,
        artifacts=[*files, trace_dir],
        notes=_notes(state, profiled, results, metrics),
        tables=tables,
    )
    if state.waterfall is not None:
        _write_waterfall(state, result)
    return result


def _compare_with_eager(state: RunState, results: ProfileResults, profiled: session.ProfiledRun) -> None:
    """The eager reference on the same workload, and the captured run against it part by part."""
    eager = session.phases_of(_eager_reference(state), state.cfg.profile.kernel_categories)
    fused = provenance.fused_modules(profiled.instrumentation.graphs)
    results.reference = Reference(REFERENCE, eager)
    results.fused = {source: sorted(targets) for source, targets in fused.items()}
    results.comparison = comparison(
        results.phases,
        eager,
        rewritten=rewritten_modules(state.model, state.transform_history),
        fused=fused,
        graphs=tuple(path for path, _ in find_graphs(state.model)),
        moved=moved_work(state.transform_history),
    )


def _layer_table(state: RunState, results: ProfileResults) -> dict[str, list[LayerRow]]:
    """The per-layer table of prefill and decode: the numerics stage's parts, their kinds, where
    the two sides' work differs (model-scope rewrites; work fused or moved between parts) and
    each phase's numerics."""
    lm_paths = list(state.model_info.language_model_paths) if state.model_info else []
    parts = state.reference.part_order if state.reference else numerics.part_paths(state.model, lm_paths)
    text = getattr(state.hf_config, "text_config", None) or state.hf_config
    kinds = layer_kinds(state.model, parts, getattr(text, "layer_types", None))
    unlike = Unlike.of(
        parts,
        rewritten_modules(state.model, state.transform_history),
        {source: set(targets) for source, targets in results.fused.items()},
        moved_work(state.transform_history),
    )
    eager = results.reference.phases if results.reference else None
    tables = {}
    for phase in ("prefill", "decode"):
        if phase not in results.phases:
            continue
        errors = state.part_errors.get(phase, [])
        first = next((e.part for e in errors if e.past_tolerance), None)
        by_part = {e.part: (e.max_abs, e.max_rel, e.part == first) for e in errors}
        roofs = results.roofline.get(phase, [])
        tables[phase] = layer_rows(phase, results.phases, eager, parts, kinds, unlike, roofs, by_part)
    return tables


def _columns(layers: dict[str, list[LayerRow]]) -> dict[str, list]:
    """The per-layer tables of every phase as one MLflow table: a column per field, `phase` first."""
    rows = [{"phase": phase, **asdict(row)} for phase, phase_rows in layers.items() for row in phase_rows]
    return {key: [row[key] for row in rows] for key in rows[0]}


def _metrics(state: RunState, profiled: session.ProfiledRun, results: ProfileResults) -> dict[str, float]:
    """profile/* (timings, coverage, attribution, speedups), comm share, layers/<phase>/<part>_ms."""
    phases = results.phases
    metrics = session.metrics_of(profiled, phases)
    metrics["profile/prefill_layer_coverage_pct"] = session.layer_coverage(phases, "prefill")
    metrics["profile/decode_layer_coverage_pct"] = session.layer_coverage(phases, "decode_")
    if state.rank is not None:  # the all-reduces of the sharded graph
        metrics["profile/comm_pct"] = category_pct(phases, COMMUNICATION)
    metrics.update(part_metrics(phases, ""))
    if results.reference is not None:
        metrics.update(part_metrics(results.reference.phases, "_eager"))
    metrics.update({f"profile/{phase}_speedup_vs_eager": x for phase, x in results.speedups().items()})
    metrics.update(layer_metrics(results.layers)[0])
    return metrics


def _notes(
    state: RunState, profiled: session.ProfiledRun, results: ProfileResults, metrics: dict[str, float]
) -> list[str]:
    """The summary's lines: windows and overhead, coverage, what the graphs show, the comparison."""
    cfg = state.cfg
    notes = [
        f"{len(profiled.windows)} windows ({', '.join(name for name, _ in profiled.windows[:2])}, ...); profiled decode "
        f"{metrics['profile/decode_ms']:.2f} ms/step = {metrics['profile/overhead_ratio']:.2f}x unprofiled",
        f"coverage: {metrics['profile/coverage_pct']:.1f} % of device time in a module, "
        f"{metrics['profile/layer_coverage_pct']:.1f} % of the layer stacks' time in a layer or deeper "
        f"(prefill {metrics['profile/prefill_layer_coverage_pct']:.1f} %, decode "
        f"{metrics['profile/decode_layer_coverage_pct']:.1f} %)",
    ]
    if cfg.profile.reference == "eager" and not state.captured:
        notes.append("profile.reference=eager: the run is the eager model already (capture=none)")
    if state.rank is not None:
        notes.append(
            f"communication: {metrics['profile/comm_pct']:.1f} % of the steps' time (rank {state.rank.rank})"
        )
    if state.captured and spec(state.backend).compiles and not cfg.profile.kernel_provenance:
        notes.append(
            "inside the graphs: not attributed (profile.kernel_provenance=false): each compiled "
            "graph's kernels count under the graph module; true maps them to modules"
        )
    elif state.captured:
        counted = ", ".join(f"{n} {way}" for way, n in profiled.counts.items())
        notes.append(
            f"inside the graphs: {spec(state.backend).sees}" + (f" ({counted} calls)" if counted else "")
        )
    notes.append(gap_note(results))
    if capped := layer_metrics(results.layers)[1]:
        notes.append(capped)
    if results.comparison:
        speedups = [f"{phase} {x:.2f}x" for phase, x in results.speedups().items()]
        rewrites = sorted(
            {r.note for rows in results.comparison.values() for r in rows if r.note.startswith("rewritten")}
        )
        notes.append(
            f"against {REFERENCE} on the same workload, whole steps (device time per step: export, the "
            f"transforms and {state.backend} together"
            + (f"; parts {', '.join(rewrites)} included" if rewrites else "")
            + f"): {', '.join(speedups)}"
        )
    notes.append(
        "profile/profile.json, CSV tables and tables.txt; Chrome traces in traces/<phase>/ (Perfetto, HTA)"
    )
    return notes


def waterfall_metrics(fall: stepwise.Waterfall) -> dict[str, float]:
    """waterfall/<phase>/<nn>_<step>_ms (the median after the step), _saved_ms (the median change
    from the step before, > 0 a gain) and _share (of the whole change, signed), each step's order
    in its name, so MLflow shows one chart section per phase with the steps in order."""
    metrics = {}
    for phase in stepwise.PHASES:
        changes, shares = fall.changes(phase), fall.shares(phase)
        for i, step in enumerate(fall.steps):
            name = f"waterfall/{phase}/{i:02d}_{step.name}"
            metrics[f"{name}_ms"] = step.time(phase).median
            if changes[i] is not None:
                metrics[f"{name}_saved_ms"] = changes[i].median
                metrics[f"{name}_share"] = shares[i]
    return metrics


def _write_waterfall(state: RunState, result: StageResult) -> None:
    """waterfall/: the steps as JSON and a table, the stacked-bar plot of median part times; metrics
    (waterfall_metrics), an MLflow table, and the table in the log; what the rounds cannot vouch
    for as notes in the summary."""
    fall = state.waterfall
    steps = fall.steps
    folder = state.run_dir / "waterfall"
    folder.mkdir(parents=True, exist_ok=True)
    text = stepwise.table(fall)
    (folder / "waterfall.txt").write_text(text + "\n")
    (folder / "waterfall.json").write_text(json.dumps(fall.as_dict(), indent=1))
    plot = waterfall_plot(
        {phase: {s.name: s.part_median(phase) for s in steps} for phase in stepwise.PHASES},
        folder / "waterfall.png",
    )
    result.artifacts += [folder / "waterfall.txt", folder / "waterfall.json", plot, folder / "graphs"]
    result.images["waterfall"] = plot
    shares = {phase: fall.shares(phase) for phase in stepwise.PHASES}
    noisy = {phase: fall.noisy(phase) for phase in stepwise.PHASES}
    first = fall.first_drift()
    columns: dict[str, list] = {"step": [s.name for s in steps]}
    for phase in stepwise.PHASES:
        times = [s.time(phase) for s in steps]
        columns |= {
            f"{phase}_ms": [t.median for t in times],
            f"{phase}_p10_ms": [t.p10 for t in times],
            f"{phase}_p90_ms": [t.p90 for t in times],
            f"{phase}_share": shares[phase],
            f"{phase}_noisy": noisy[phase],
        }
    result.tables["tables/waterfall.json"] = {
        **columns,
        "cost_s": [s.cost_s for s in steps],
        "memory_mib": [s.memory_mib for s in steps],
        "nodes": [s.nodes for s in steps],
        "first_drift": [", ".join(p for p, at in first.items() if at == s.name) for s in steps],
    }
    result.metrics |= waterfall_metrics(fall)
    result.metrics["waterfall/rounds"] = fall.rounds
    result.notes += text.splitlines()
