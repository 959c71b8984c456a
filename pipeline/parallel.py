"""Tensor parallelism's process group as the stages see it: this process's rank, the world size and
the group's name (what the functional collectives in a sharded graph address); one process of its
own when torch.distributed is not initialized."""

from __future__ import annotations

import torch.distributed as dist


def tensor_parallel() -> tuple[int, int, str]:
    """(rank, world size, process group name); (0, 1, "") outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, ""
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
