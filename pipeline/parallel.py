"""Tensor parallelism as the stages see it: this process's rank, the world size and the group's
name (what the functional collectives in a sharded graph address); one process of its own when
torch.distributed is not initialized. Where a rank writes, where the ranks meet, and what a rank
leaves for its supervisor (pipeline/ranks.py starts and watches the ranks)."""

from __future__ import annotations

import json
import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

PROGRESS = Path("logs") / "progress.json"  # in each rank's folder: its pid, stage and MLflow run


def tensor_parallel() -> tuple[int, int, str]:
    """(rank, world size, process group name); (0, 1, "") outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, ""
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name


@dataclass(frozen=True)
class Rank:
    """This process's place among the tensor-parallel ranks of a job."""

    rank: int
    world: int
    local_rank: int  # the device index on its host
    root: Path  # the job's run folder (rank 0's)

    @property
    def run_dir(self) -> Path:
        return rank_dir(self.root, self.rank)

    def device(self, device: torch.device) -> torch.device:
        """One GPU per rank on its host; CPU ranks share the CPU."""
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device


def join(
    rank: int, world: int, init_method: str, timeout_s: float, on_cuda: bool, local_rank: int = 0
) -> None:
    """Enter the job's process group: NCCL with one GPU per rank, gloo on CPU; a collective that
    waits longer than timeout_s raises instead of hanging the job."""
    if on_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now: where rank 0 of a one-host group listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_dir(root: Path, rank: int) -> Path:
    """Rank 0 writes the job's folder; rank k its `rank<k>/` inside it."""
    return root if rank == 0 else root / f"rank{rank}"


def meet(timeout_s: float) -> None:
    """Every rank reaches this point (the report stage) before rank 0 reads their folders; on gloo
    the error names the ranks that did not come."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


def write_progress(me: Rank, stage: str, run_id: str | None) -> None:
    """Where this rank is: what the supervisor names when the rank dies without a word."""
    path = me.run_dir / PROGRESS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": me.rank, "pid": os.getpid(), "stage": stage, "run_id": run_id}))


def stop_signals() -> None:
    """The run is ending (its record being written): later interrupts and peer notices wait."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
