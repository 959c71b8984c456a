"""A measurement in a fresh process: its memory goes back to the machine when it ends, and its
per-process state (where its allocations landed, how its libraries set themselves up) is one
sample of many, not a property of the whole run."""

from __future__ import annotations


def in_child(fn, *args):
    """fn(*args) in a fresh process (spawned: no copy of this one's memory), its result returned;
    the memory of the model it loads goes back to the machine when it ends. A child that dies (the
    kernel's OOM killer) raises BrokenProcessPool here: a multiprocessing.Pool waited forever."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
