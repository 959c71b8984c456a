"""Two gloo ranks on this CPU, each a process of its own, for tests of tensor parallelism that run
in process (the CLI's own launch is tested in test_tensor_parallel.py)."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.parallel import free_port, join

WORLD = 2


def _in_group(rank: int, port: int, work, args: tuple, results) -> None:
    """One rank: join the gloo group, put what work(rank, *args) returns (or its error: a rank that
    died silently would leave the other waiting), leave. Pickled here: torch's queue would pass a
    tensor as a handle to this process's memory, gone once the rank has ended."""
    join(rank, WORLD, f"tcp://127.0.0.1:{port}", 120, on_cuda=False)
    torch.set_num_threads(1)
    try:
        results.put(pickle.dumps(dict(rank=rank, **work(rank, *args))))
    except Exception as exc:
        results.put(pickle.dumps(dict(rank=rank, error=f"{type(exc).__name__}: {exc}")))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(work, *args) -> list[dict]:
    """work(rank, *args) on WORLD ranks (work: a module-level function, as spawn pickles it by
    name); what each returned, by rank."""
    port = free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_in_group, args=(r, port, work, args, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = [pickle.loads(results.get(timeout=600)) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert not [o["error"] for o in out if "error" in o], out
    return sorted(out, key=lambda o: o["rank"])
