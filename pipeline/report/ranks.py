"""Tensor-parallel ranks side by side: each rank's profile.json (rank 0's in the job's folder, rank
k's under rank<k>/), its step time, the share of the `communication` kernel category (the
all-reduces the shard transform put under the layer that issues them) and, per module of the layer
stack, its time and the communication inside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.parallel import rank_dir
from pipeline.profiler.parts import category_pct, kernel_times, module_slices
from pipeline.profiler.results import ProfileResults
from pipeline.profiler.rows import ProfileNode

COMMUNICATION = "communication"  # the kernel category of profile.kernel_categories that counts


def rank_profiles(root: Path, world: int) -> dict[int, ProfileResults | None]:
    """{rank: its profile.json, or None when it wrote none}."""
    profiles: dict[int, ProfileResults | None] = {}
    for rank in range(world):
        path = rank_dir(root, rank) / "profile" / "profile.json"
        profiles[rank] = ProfileResults.load(path) if path.exists() else None
    return profiles


def rank_metrics(profiles: dict[int, ProfileResults | None]) -> dict[str, float]:
    """ranks/rank<k>_decode_ms and ranks/rank<k>_comm_pct for every rank that has a profile."""
    metrics = {}
    for rank, profile in profiles.items():
        if profile is None:
            continue
        phases = profile.phases
        if "decode" in phases:
            metrics[f"ranks/rank{rank}_decode_ms"] = phases["decode"].step_ms
        metrics[f"ranks/rank{rank}_comm_pct"] = category_pct(phases, COMMUNICATION)
    return metrics


def _communication_us(node: ProfileNode) -> float:
    return kernel_times(node, "category").get(COMMUNICATION, 0.0)


def rank_table(profiles: dict[int, ProfileResults | None], phase: str) -> tuple[list[str], list[list[Any]]]:
    """(header, rows) of one phase: [part, then per rank: ms, communication ms inside it]; the whole
    step first, then the parts by rank 0's time."""
    present = {rank: p.phases[phase] for rank, p in profiles.items() if p and phase in p.phases}
    header = [f"{phase}: part"] + [h for rank in present for h in (f"rank {rank} ms", f"rank {rank} comm ms")]
    if not present:
        return header, []
    times = {rank: module_slices(e.summary_stats) for rank, e in present.items()}
    comms = {rank: module_slices(e.summary_stats, value=_communication_us) for rank, e in present.items()}
    steps = {rank: e.summary_stats for rank, e in present.items()}
    first = next(iter(present))
    parts = sorted(set().union(*times.values()), key=lambda part: -times[first].get(part, 0.0))
    rows = [["step"] + [v for r in present for v in (steps[r].device_time_us, _communication_us(steps[r]))]]
    rows += [
        [part] + [v for r in present for v in (times[r].get(part, 0.0), comms[r].get(part, 0.0))]
        for part in parts
    ]
    return header, [[row[0]] + [round(us / 1000, 3) for us in row[1:]] for row in rows]
