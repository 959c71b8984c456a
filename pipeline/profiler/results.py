"""ProfileResults: one profiled run, typed, from the profile stage to every reader. It prints its
tables, writes its files (each the one writer of it) and loads back from its profile.json.

profile.json (schema below, versioned):
  schema_version: 2
  context: model, architecture, capture, backend, attention, dtype, device, workload, versions
  phases: {prefill (prefill_2.. when prompts queued or were chunked), decode_1 .. decode_N,
    decode (the mean of the decode windows)}: each a PhaseStats:
    step_ms (the engine's own time for the step, profiled; for `decode` the mean of the windows',
    step_ms_median beside it), statistic (which: "one window" or "mean of N windows"),
    device_time_us (the same statistic), coverage_pct, layer_coverage_pct, attribution_pct (device
    time by how it was attributed: module_range, inductor_provenance, cudagraph_sequence,
    unattributed), summary_stats and model_stats: trees of ProfileNode
      {name, kind, fqn, cls, params, shapes, trace, category, depth, cpu_time_us, device_time_us,
       pct, invocations, attribution, span_us, busy_us, gap_us, launches, children}
      (span/busy/gap/launches: profiler/tree.py; read as 0 where absent)
  reference (profile.reference=eager): {what, phases}: the eager model's phases on the same workload
  fused: {module: [modules whose kernels Inductor fused with its work]}
  comparison: {prefill, decode: [ComparedPart {part, captured_ms, eager_ms, speedup, note}]}
  roofline: {roofs: Roofs, phases: {prefill, decode: [RoofRow]}}
  layers: {prefill, decode: [LayerRow]}: the per-layer table (profiler/layers.py)
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pipeline.profiler import vllm_layout
from pipeline.profiler.roofline import Roofs, roofline_table
from pipeline.profiler.rows import ComparedPart, LayerRow, Phases, PhaseStats, ProfileNode, Reference, RoofRow
from pipeline.profiler.tables import comparison_table, layer_table, phase_table

SCHEMA_VERSION = 2
READABLE = (1, 2)  # version 1 lacks attribution, statistic and the eager reference
CSV_COLUMNS = [
    "phase", "id", "parent_id", "depth", "kind", "name", "fqn", "cls", "category",
    "cpu_time_us", "device_time_us", "pct", "invocations", "attribution", "span_us", "busy_us", "gap_us",
    "launches", "shapes", "trace",
]  # fmt: skip


@dataclass
class ProfileResults:
    context: dict[str, str | int | float]  # what ran, on what, with which versions
    phases: Phases
    reference: Reference | None = None
    fused: dict[str, list[str]] = field(default_factory=dict)
    comparison: dict[str, list[ComparedPart]] = field(default_factory=dict)
    roofs: Roofs | None = None  # the limits the roofline rows were set against
    roofline: dict[str, list[RoofRow]] = field(default_factory=dict)
    layers: dict[str, list[LayerRow]] = field(default_factory=dict)  # phase -> the per-layer table

    # --- profile.json ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        saved: dict = {
            "schema_version": SCHEMA_VERSION,
            "context": self.context,
            "phases": {name: p.to_dict() for name, p in self.phases.items()},
        }
        if self.reference is not None:
            saved["reference"] = {
                "what": self.reference.what,
                "phases": {name: p.to_dict() for name, p in self.reference.phases.items()},
            }
            saved["fused"] = self.fused
            saved["comparison"] = {
                phase: [asdict(r) for r in rows] for phase, rows in self.comparison.items()
            }
        if self.roofs is not None:
            saved["roofline"] = {
                "roofs": asdict(self.roofs),
                "phases": {phase: [asdict(r) for r in rows] for phase, rows in self.roofline.items()},
            }
        if self.layers:
            saved["layers"] = {phase: [asdict(r) for r in rows] for phase, rows in self.layers.items()}
        return saved

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, saved: dict) -> ProfileResults:
        reference = saved.get("reference")
        roofline = saved.get("roofline")
        return cls(
            context=saved.get("context", {}),
            phases={name: PhaseStats.from_dict(p) for name, p in saved["phases"].items()},
            reference=Reference(
                reference["what"], {n: PhaseStats.from_dict(p) for n, p in reference["phases"].items()}
            )
            if reference
            else None,
            fused=saved.get("fused", {}),
            comparison={
                phase: [ComparedPart(**r) for r in rows]
                for phase, rows in saved.get("comparison", {}).items()
            },
            roofs=Roofs(**roofline["roofs"]) if roofline else None,
            roofline={
                phase: [RoofRow(**r) for r in rows]
                for phase, rows in (roofline or {}).get("phases", {}).items()
            },
            layers={phase: [LayerRow(**r) for r in rows] for phase, rows in saved.get("layers", {}).items()},
        )

    @classmethod
    def load(cls, path: Path) -> ProfileResults:
        """A saved profile.json; ValueError with a one-line reason when it cannot be read as one."""
        try:
            saved = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        if not isinstance(saved, dict) or saved.get("schema_version") not in READABLE:
            raise ValueError(
                f"{path} is not a profile.json of schema_version {' or '.join(map(str, READABLE))}"
            )
        try:
            return cls.from_dict(saved)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: a profile.json missing or mistyping {exc}") from None

    # --- what the profile says -----------------------------------------------------------------
    def speedups(self) -> dict[str, float]:
        """Phase -> the whole step's speedup over eager, where the comparison could take one."""
        return {
            phase: rows[-1].speedup
            for phase, rows in self.comparison.items()
            if rows and rows[-1].speedup is not None
        }

    # --- printed and written ---------------------------------------------------------------------
    def tables(self, depth: int | None, top_k: int | None) -> str:
        """tables.txt: each phase's summary and model tables, the comparison with eager, the roofs,
        the per-layer table."""
        return "\n\n".join(
            [
                *(
                    phase_table(self.phases, phase, table, depth, top_k)
                    for table in ("summary", "model")
                    for phase in ("prefill", "decode")
                ),
                *(comparison_table(rows, phase) for phase, rows in self.comparison.items()),
                *(roofline_table(rows, phase, self.roofs) for phase, rows in self.roofline.items()),
                *(layer_table(rows, phase) for phase, rows in self.layers.items()),
            ]
        )

    def write(self, folder: Path, depth: int | None, top_k: int | None) -> tuple[list[Path], str]:
        """profile.json, the two CSV tables, tables.txt, vllm_profile.json, comparison.csv (with a
        reference) and layers.csv; returns the files and the printed tables. The one writer of each."""
        profile_json = folder / "profile.json"
        profile_json.write_text(self.to_json())
        model_csv, summary_csv = folder / "model_stats.csv", folder / "summary_stats.csv"
        _write_tree_csv(model_csv, self.phases, "model_stats")
        _write_tree_csv(summary_csv, self.phases, "summary_stats")
        printed = self.tables(depth, top_k)
        tables_txt = folder / "tables.txt"
        tables_txt.write_text(printed + "\n")
        vllm_json = folder / "vllm_profile.json"  # the same trees as vLLM's layerwise profiler writes them
        vllm_json.write_text(json.dumps(vllm_layout.vllm_profile(self.context, self.phases)))
        files = [profile_json, model_csv, summary_csv, tables_txt, vllm_json]
        for name, table, row_type in (
            ("comparison.csv", self.comparison, ComparedPart),
            ("layers.csv", self.layers, LayerRow),
        ):
            if table:
                files.append(_write_rows_csv(folder / name, table, row_type))
        return files, printed


def csv_rows(phase: str, root: ProfileNode) -> list[dict]:
    """The tree flattened in depth-first order, with id and parent_id keeping the hierarchy."""
    rows: list[dict] = []

    def visit(node: ProfileNode, parent_id: int | None) -> None:
        row_id = len(rows)
        rows.append(
            {
                **{k: getattr(node, k) for k in CSV_COLUMNS if hasattr(node, k) and k != "shapes"},
                "phase": phase,
                "id": row_id,
                "parent_id": "" if parent_id is None else parent_id,
                "shapes": "; ".join("x".join(map(str, s)) for s in node.shapes),
            }
        )
        for child in node.children:
            visit(child, row_id)

    visit(root, None)
    return rows


def _write_tree_csv(path: Path, phases: Phases, table: str) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for phase, stats in phases.items():
            writer.writerows(csv_rows(phase, getattr(stats, table)))


def _write_rows_csv(path: Path, table: dict[str, list], row_type: type) -> Path:
    """Rows of each phase, one CSV line each with the phase first."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["phase", *(f.name for f in fields(row_type))])
        writer.writeheader()
        for phase, rows in table.items():
            writer.writerows({"phase": phase, **asdict(row)} for row in rows)
    return path
