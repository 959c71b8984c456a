"""profile.json (schema below, versioned) and the CSV tables, from the trees of each phase.

profile.json:
  schema_version: 2
  context: model, architecture, capture, backend, attention, dtype, device, workload, versions
  phases: {prefill (prefill_2.. when prompts queued or were chunked), decode_1 .. decode_N,
    decode (the mean of the decode windows)}: each with
    step_ms (the engine's own time for the step, profiled; for `decode` the mean of the windows',
    step_ms_median beside it), statistic (which: "one window" or "mean of N windows"),
    device_time_us (the same statistic), coverage_pct, layer_coverage_pct, attribution_pct (device
    time by how it was attributed: module_range, inductor_provenance, cudagraph_sequence,
    unattributed), summary_stats and model_stats: trees of nodes
      {name, kind, fqn, cls, params, shapes, trace, category, depth, cpu_time_us, device_time_us,
       pct, invocations, attribution, children}
  reference (profile.reference=eager): {what, phases}: the eager model's phases on the same workload
  comparison: {prefill, decode: [{part, captured_ms, eager_ms, speedup, note}]}
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from pipeline.profiler.tree import Node

SCHEMA_VERSION = 2
READABLE = (1, 2)  # version 1 lacks attribution, statistic and the eager reference
CSV_COLUMNS = [
    "phase", "id", "parent_id", "depth", "kind", "name", "fqn", "cls", "category",
    "cpu_time_us", "device_time_us", "pct", "invocations", "attribution", "shapes", "trace",
]  # fmt: skip


def load(path: Path) -> dict[str, Any]:
    """A saved profile.json; ValueError with a one-line reason when it cannot be read as one."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(profile, dict) or profile.get("schema_version") not in READABLE:
        raise ValueError(f"{path} is not a profile.json of schema_version {' or '.join(map(str, READABLE))}")
    return profile


def to_dict(node: Node, depth: int = 0) -> dict[str, Any]:
    return {
        "name": node.name,
        "kind": node.kind,
        "fqn": node.fqn,
        "cls": node.cls,
        "params": [[name, shape] for name, shape in node.params],
        "shapes": node.shapes,
        "trace": node.trace,
        "category": node.category,
        "depth": depth,
        "cpu_time_us": round(node.cpu_time_us, 3),
        "device_time_us": round(node.device_time_us, 3),
        "pct": round(node.pct, 3),
        "invocations": node.invocations,
        "attribution": node.attribution if node.kind == "module" else "",
        "children": [to_dict(c, depth + 1) for c in node.children.values()],
    }


def csv_rows(phase: str, tree: dict[str, Any]) -> list[dict[str, Any]]:
    """The tree flattened in depth-first order, with id and parent_id keeping the hierarchy."""
    rows: list[dict[str, Any]] = []

    def visit(node: dict[str, Any], parent_id: int | None) -> None:
        row_id = len(rows)
        rows.append(
            {
                **{k: node[k] for k in CSV_COLUMNS if k in node and k not in ("shapes",)},
                "phase": phase,
                "id": row_id,
                "parent_id": "" if parent_id is None else parent_id,
                "shapes": "; ".join("x".join(map(str, s)) for s in node["shapes"]),
            }
        )
        for child in node["children"]:
            visit(child, row_id)

    visit(tree, None)
    return rows


def write_csv(path: Path, phases: dict[str, dict[str, Any]], table: str) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for phase, entry in phases.items():
            writer.writerows(csv_rows(phase, entry[table]))


def write_comparison(path: Path, comparison: dict[str, list[dict[str, Any]]]) -> None:
    """The captured-vs-eager rows of every phase, one CSV."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["phase", "part", "captured_ms", "eager_ms", "speedup", "note"])
        writer.writeheader()
        for phase, rows in comparison.items():
            writer.writerows({"phase": phase, **row} for row in rows)


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
