"""The run report: what a run was, what each stage did, how fast, how correct, where the time
went. Built from the RunState alone (stage records, checks, history, profile.json on disk), so a
failed run gets a report of what it reached and why it stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.models.memory import human_count
from pipeline.profiler.results import ProfileResults
from pipeline.profiler.roofline import roofline_table
from pipeline.profiler.tables import phase_table
from pipeline.report.document import Block, Image, Pre, Section, Table, write
from pipeline.report.ranks import rank_metrics, rank_profiles, rank_table
from pipeline.state import RunState

HEADLINE = (
    ("latency/prefill_ms", "prefill", "ms"),
    ("latency/decode_ms", "decode", "ms/step"),
    ("throughput/decode_tok_s", "throughput", "tok/s"),
    ("correctness/max_abs_err", "max_abs_err", ""),
    ("profile/coverage_pct", "profile coverage", "%"),
)
PLOT_CAPTIONS = {
    "module_breakdown": "Device time per step by module (absolute and percent)",
    "kernel_categories": "Device time per step by kernel category",
    "kernel_top": "Device time per step by kernel (top k)",
    "busy_gaps": "Busy time and gaps per part, captured and eager, ms per step",
}


def metrics_of(state: RunState) -> dict[str, float]:
    merged: dict[str, float] = {}
    for record in state.stages:
        merged |= record.metrics
    return merged


def _failure(state: RunState) -> str | None:
    failed = next((r for r in state.stages if r.status != "done"), None)
    if failed is None:
        return None
    return f"FAILED at stage '{failed.name}' ({failed.status}): {failed.cause}"


def _spread(metrics: dict[str, float], key: str) -> str:
    """` (p10 x, p90 y)` of a latency whose spread was measured."""
    base = key.removesuffix("_ms")
    low, high = metrics.get(f"{base}_p10_ms"), metrics.get(f"{base}_p90_ms")
    return f" (p10 {low:.4g}, p90 {high:.4g})" if low is not None and high is not None else ""


def headline(state: RunState, report: Path | None = None) -> list[str]:
    """The few numbers a console summary ends with."""
    metrics = metrics_of(state)
    cfg = state.cfg
    lines = [
        f"{cfg.model.name} capture={cfg.capture.mode} backend={state.backend} "
        f"attention={state.attention} {str(state.dtype).removeprefix('torch.')} on {state.device}"
    ]
    numbers = [
        f"{label} {metrics[key]:.4g}{(' ' + unit) if unit else ''}" + _spread(metrics, key)
        for key, label, unit in HEADLINE
        if key in metrics
    ]
    if numbers:
        lines.append(", ".join(numbers))
    noisy = next((r.tags["noisy_reason"] for r in state.stages if "noisy_reason" in r.tags), None)
    if noisy:
        lines.append(f"WARNING noisy measurement: {noisy}")
    numerics = next((r for r in state.stages if r.name == "numerics" and r.notes), None)
    if numerics is not None:
        lines.append(f"numerics: {numerics.notes[0].removeprefix('!!! ')}")
        decode = next((n for n in numerics.notes if "decode step" in n), None)
        if decode is not None:
            lines.append(f"numerics: {decode.removeprefix('!!! ')}")
    recompiles = metrics.get("capture/recompiles", 0)
    if recompiles:
        lines.append(
            f"WARNING {recompiles:.0f} recompiles during generation (the generate stage's notes say why)"
        )
    if state.waterfall is not None and state.waterfall.rounds:
        lines += [f"WARNING waterfall: {warning}" for warning in state.waterfall.warnings()]
    if failure := _failure(state):
        lines.append(failure)
    if report is not None:
        lines.append(f"report: {report}")
    return lines


def _config_table(state: RunState) -> Table:
    cfg, info = state.cfg, state.model_info
    rows: list[list[Any]] = [
        ["model", f"{cfg.model.name} ({info.architecture if info else cfg.model.architecture})"],
        ["parameters", human_count(info.params) if info else "not loaded"],
        ["weights", info.source if info else "-"],
        ["capture", cfg.capture.mode],
        ["backend", f"{state.backend} (backend={cfg.backend.name})"],
        ["attention", f"{state.attention} (attention={cfg.attention.name})"],
        ["dtype, device", f"{str(state.dtype).removeprefix('torch.')} on {state.device}"],
        [
            "workload",
            f"batch {cfg.prompt.batch_size} x prompt {cfg.prompt.prompt_len} tokens, "
            f"{cfg.prompt.output_len} new tokens; profile: {cfg.profile.decode_steps} decode steps",
        ],
    ]
    return Table(["setting", "value"], rows)


def _first_line(notes: list[str]) -> str:
    """A stage's first note that is prose, not a row of a printed table."""
    return next((n for n in notes if not n.startswith(("transform ", "---"))), "")


def _stages_table(state: RunState) -> Table:
    """Each stage's wall time (metric stage/<name>_s), which includes its own parts (the export
    stage's torch.export time is export/torch_export_s, the rest is its checks)."""
    rows = [[r.name, r.status, f"{r.seconds:.2f}", r.cause or _first_line(r.notes)] for r in state.stages]
    return Table(["stage", "status", "wall s (stage/<name>_s)", "what happened"], rows)


def _export_section(state: RunState) -> Section:
    section = Section("Export: what was captured, what stayed eager")
    if not state.captured:
        section.blocks.append(f"Nothing captured (capture={state.cfg.capture.mode}).")
    else:
        section.blocks.append(
            Table(
                [
                    "graph",
                    "nodes as exported",
                    "nodes now (after the transforms)",
                    "inputs",
                    "constants",
                    "torch.export s (export/<graph>/torch_export_s)",
                ],
                [
                    [
                        g.name,
                        g.exported_nodes,
                        g.num_nodes,
                        ", ".join(g.tensor_inputs),
                        json.dumps(g.constants),
                        f"{g.export_s:.2f}",
                    ]  # fmt: skip
                    for g in state.captured
                ],
            )
        )
    export = next((r for r in state.stages if r.name == "export"), None)
    section.blocks += [n for n in (export.notes if export else []) if "eager" in n]
    return section


def _transforms_section(state: RunState) -> Section:
    section = Section("Transforms")
    history = state.transform_history
    if history is None or not history.records:
        section.blocks.append("No transforms ran.")
        return section
    section.blocks.append(
        Table(
            ["transform", "target", "status", "matches", "nodes", "ms", "reason"],
            [
                [
                    r.transform,
                    r.target,
                    r.status,
                    r.matches,
                    f"{r.nodes_before}->{r.nodes_after}",
                    f"{1000 * r.seconds:.1f}",
                    r.reason,
                ]  # fmt: skip
                for r in history.records
            ],
        )
    )
    return section


def _capture_section(state: RunState, metrics: dict[str, float]) -> Section:
    section = Section("Capture")
    record = next((r for r in state.stages if r.name == "capture"), None)
    if record is None:
        section.blocks.append("Not reached.")
        return section
    keys = [k for k in sorted(metrics) if k.startswith("capture/")]
    section.blocks += record.notes
    if record.tags.get("capture_fallback") == "true":
        section.blocks.append(
            "FAILED to compile or capture: these numbers are UNCOMPILED (backend.fallback=eager)."
        )
    if keys:
        section.blocks.append(Table(["metric", "value"], [[k, metrics[k]] for k in keys]))
    compiles = state.run_dir / "capture" / "compiles.json"
    if compiles.exists():
        frames = json.loads(compiles.read_text())
        section.blocks.append(
            "Each frame Dynamo compiled in this stage (a recompile says which guard failed):"
        )
        section.blocks.append(
            Table(list(frames[0]), [list(frame.values()) for frame in frames], sortable=True)
        )
    return section


def _correctness_section(state: RunState) -> Section:
    section = Section("Correctness")
    if not state.checks:
        section.blocks.append("No checks ran.")
        return section
    section.blocks.append(
        Table(
            ["after stage", "call", "max_abs_err", "tolerance", "MoE routing flips", "result"],
            [
                [c.stage, c.call, c.max_abs_err, c.tolerance, c.router_flips, "ok" if c.passed else "FAILED"]
                for c in state.checks
            ],
        )
    )
    section.blocks.append(
        "Each check compares the model's logits after that stage with the eager Hugging Face model's on "
        "the same call; tokens where eager's mixture-of-experts routing was a near-tie (top-k margin "
        "within a few units of rounding) and the expert choice flipped are counted as routing flips, "
        "not as errors. Greedy-token parity of demollm with Hugging Face generate, per backend, is "
        "tested on the tiny models (tests/test_runtime.py, tests/test_capture.py)."
    )
    folder = state.run_dir / "numerics"
    if (folder / "numerics.txt").exists():
        section.blocks.append(
            "Each part's output against eager on the same calls (the first past tolerance is where the "
            "captured model leaves eager):"
        )
        section.blocks.append(Pre((folder / "numerics.txt").read_text()))
        if (folder / "depth.png").exists():
            section.blocks.append(
                Image(folder / "depth.png", "Each part's max relative difference along depth")
            )
    return section


UNITS = (("_tok_s", "tok/s"), ("_requests_s", "requests/s"), ("_gbs", "GB/s"), ("_ms", "ms"),
         ("_s", "s"), ("_mb", "MiB"), ("_pct", "%"), ("_cores", "cores"))  # fmt: skip


def unit_of(metric: str) -> str:
    """The unit a metric's name ends in (docs/metrics.md)."""
    return next((unit for suffix, unit in UNITS if metric.endswith(suffix)), "")


def _performance_section(metrics: dict[str, float]) -> Section:
    keys = [
        k for k in sorted(metrics) if k.split("/")[0] in ("latency", "throughput", "memory", "stage", "noise")
    ]
    section = Section("Latency, throughput, memory, noise, stage times")
    section.blocks.append(
        Table(["metric", "value", "unit"], [[k, metrics[k], unit_of(k)] for k in keys])
        if keys
        else "Not reached."
    )
    return section


def _profile_section(state: RunState, plots: dict[str, Path], plot_notes: list[str]) -> Section:
    section = Section("Profile")
    path = state.run_dir / "profile" / "profile.json"
    if not path.exists():
        section.blocks.append("No profile (the profile stage did not run or was disabled).")
        return section
    profile = ProfileResults.load(path)
    for phase in ("prefill", "decode"):
        if phase in profile.phases:
            section.blocks.append(Pre(phase_table(profile.phases, phase, "summary", depth=3, top_k=6)))
    record = next((r for r in state.stages if r.name == "profile"), None)
    section.blocks += record.notes if record else []
    for phase, rows in profile.comparison.items():
        section.blocks.append(
            Table(
                [
                    f"{phase}: part",
                    "captured ms",
                    "captured gap ms",
                    "HF generate ms",
                    "HF gap ms",
                    "HF / captured",
                    "busy saved ms",
                    "gaps removed ms",
                    "note",
                ],
                [
                    [
                        r.part,
                        r.captured_ms,
                        r.captured_gap_ms,
                        r.eager_ms,
                        r.eager_gap_ms,
                        f"{r.speedup:.2f}x" if r.speedup else "-",
                        r.busy_saved_ms,
                        r.gaps_removed_ms,
                        r.note,
                    ]
                    for r in rows
                    if r.part == "total" or r.captured_ms + r.eager_ms > 0.01 * rows[-1].eager_ms
                ],
            )
        )
    folder = state.run_dir / "waterfall"
    if (folder / "waterfall.txt").exists():
        section.blocks.append(Pre((folder / "waterfall.txt").read_text()))
        section.blocks.append(
            Image(folder / "waterfall.png", "Device time per step after each step, by part")
        )
    for phase, rows in profile.roofline.items():
        section.blocks.append(Pre(roofline_table(rows, phase, profile.roofs)))
    section.blocks += _layer_tables(profile)
    section.blocks += plot_notes
    section.blocks += [Image(png, PLOT_CAPTIONS.get(key, key)) for key, png in plots.items()]
    return section


LAYER_COLUMNS = (
    "captured ms", "busy", "gap", "HF ms", "busy", "gap", "HF / captured", "% of roof", "max abs err",
    "max rel err", "note",
)  # fmt: skip


def _layer_tables(profile: ProfileResults) -> list[Block]:
    """The per-layer table of each phase, one sortable table: time and gaps on both sides, the
    roof, the numerics (the first part past tolerance marked)."""
    blocks: list[Block] = []
    for phase, rows in profile.layers.items():
        blocks.append(
            f"{phase}, per layer: device ms per step on each side split into busy time and gaps (ms "
            "between the part's work), the share of its roof, its output against eager's (click a "
            "header to sort)."
        )
        blocks.append(
            Table(
                [f"{phase}: part", "kind", *LAYER_COLUMNS],
                [
                    [
                        r.part,
                        r.kind,
                        r.captured_ms,
                        r.captured_busy_ms,
                        r.captured_gap_ms,
                        r.eager_ms,
                        r.eager_busy_ms,
                        r.eager_gap_ms,
                        f"{r.speedup:.2f}x" if r.speedup else "-",
                        "-" if r.pct_of_roof is None else r.pct_of_roof,
                        "-" if r.max_abs is None else r.max_abs,
                        "-"
                        if r.max_rel is None
                        else f"{r.max_rel:.2e}" + (" FIRST PAST TOLERANCE" if r.first_drift else ""),
                        r.note,
                    ]
                    for r in rows
                ],  # fmt: skip
                sortable=True,
            )
        )
    return blocks


def _ranks_section(state: RunState) -> Section:
    """Every rank's profile side by side: time per layer part and the communication inside it."""
    section = Section(f"Tensor-parallel ranks ({state.rank.world})")
    profiles = rank_profiles(state.run_dir, state.rank.world)
    missing = [str(rank) for rank, profile in profiles.items() if profile is None]
    if missing:
        section.blocks.append(
            f"No profile from rank {', '.join(missing)} (not profiled, or it failed first)."
        )
    shares = [
        f"rank {key.removeprefix('ranks/rank').removesuffix('_comm_pct')} {value:.1f} %"
        for key, value in rank_metrics(profiles).items()
        if key.endswith("_comm_pct")
    ]
    section.blocks.append(f"Communication's share of the profiled steps' time: {', '.join(shares)}.")
    for phase in ("prefill", "decode"):
        header, rows = rank_table(profiles, phase)
        if rows:
            section.blocks.append(Table(header, rows))
    return section


def sections(state: RunState, plots: dict[str, Path], plot_notes: list[str]) -> list[Section]:
    metrics = metrics_of(state)
    summary = Section("Summary", headline(state))
    return [
        summary,
        Section("Configuration", [_config_table(state)]),
        Section("Stages", [_stages_table(state)]),
        _export_section(state),
        _transforms_section(state),
        _capture_section(state, metrics),
        _correctness_section(state),
        _performance_section(metrics),
        _profile_section(state, plots, plot_notes),
        *([_ranks_section(state)] if state.rank is not None and state.rank.rank == 0 else []),
    ]


def write_report(state: RunState, plots: dict[str, Path], plot_notes: list[str]) -> tuple[Path, Path]:
    """report/report.md and the self-contained report/report.html."""
    title = f"Run report: {state.cfg.model.name}, capture={state.cfg.capture.mode}, backend={state.backend}"
    return write(state.run_dir / "report", "report", title, sections(state, plots, plot_notes), state.run_dir)
