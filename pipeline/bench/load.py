"""The load row: the pipeline's load stage (random init on the meta-built model) against Hugging
Face's own init of the same class, each sample the first load of a fresh process, as
`python -m pipeline` loads once per run.

Why fresh processes: measured in one process, three rounds after a warm-up, the ratio held within
each run (p10-p90 3.43-3.68) and moved between runs an hour apart (3.50 -> 3.13 on 2026-12-03,
2.77 -> 2.24 and 2.98 -> 2.53 before): Hugging Face's init went 45.3 -> 38.7 s while ours held
12.7 -> 12.4 s, so each run's single process drew one speed for the whole row. And a repeated load
in one process is not what a run does: the first load of a process (its memory touched for the
first time) took 14.7-15.9 s here where the repeats in one process took 12.4-12.7 s.

Why loads on touched memory beside them: every load pays for its memory's first touch (page
faults, and on this virtual machine the host backing the pages), and that cost moves by itself: the
same 11.6 GB took 5.7, 13.0 and 2.1 s to allocate and zero in three runs on 2026-12-03 (20:55,
21:55, 23:55), and the ratio of the fresh loads moved with it, 3.21, 2.92, 3.65, since ours is
mostly touch and Hugging Face's mostly single-threaded init. A touch in a process of its own,
subtracted from both, moved as much (5.0, 6.1, 4.9): a difference of samples from different
processes, and Hugging Face's init faults its pages in on one thread where the touch uses two. So
two more fresh processes each round first allocate and zero the model's bytes in one block of
glibc's heap and free it, the heap kept whole (host_memory.keep_all_freed_memory), and then load:
the parameters land on pages already faulted in, and the ratio of those two loads is the init
work's alone, measured in one process each, with the touch timed in the same process."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.bench import rounds
from pipeline.bench.child import in_child
from pipeline.bench.prepare import advance, new_state
from pipeline.models import zoo
from pipeline.models.build import first_touch, on_meta
from pipeline.runtime.host_memory import keep_all_freed_memory

LOAD_TARGET_S = 15.0
OURS, HF_INIT = "ours", "HF init"
OURS_TOUCHED, HF_INIT_TOUCHED = "ours, touched memory", "HF init, touched memory"


def bench_load(name: str, repeats: int, reference: bool) -> dict:
    """`repeats` rounds, each our load and (when `reference`) Hugging Face's init, each in a fresh
    process, then both again on memory touched first (about 10, 30 and 5, 25 s on mistral3 here,
    plus a few seconds to start a process); the speed-ups taken within each round, where the
    machine's drift is shared. No warm-up round: the first load of a process is the measurement."""
    params: dict[str, int] = {}

    def ours() -> rounds.Sample:
        seconds, params["params"], _ = in_child(first_load, name, OURS, False)
        return seconds, 0.0

    def hf_init() -> rounds.Sample:
        return in_child(first_load, name, HF_INIT, False)[0], 0.0

    def touched(which: str) -> Callable[[], rounds.Sample]:
        def sample() -> rounds.Sample:  # (the load's seconds, the touch's before it)
            seconds, _, touch = in_child(first_load, name, which, True)
            return seconds, touch

        return sample

    runners = {OURS: ours, **({HF_INIT: hf_init} if reference else {}), OURS_TOUCHED: touched(OURS)}
    if reference:
        runners[HF_INIT_TOUCHED] = touched(HF_INIT)
    taken, errors = rounds.take_turns(runners, repeats, warm_up=False)
    if errors:
        raise RuntimeError(f"load rows failed: {errors}")
    row = {
        "params": params["params"],
        "ours_s": rounds.spread([r.samples[OURS][0] for r in taken]),
        "ours_touched_s": rounds.spread([r.samples[OURS_TOUCHED][0] for r in taken]),
        # the touch of the same bytes in the process whose load follows it
        "touch_s": rounds.spread([r.samples[OURS_TOUCHED][1] for r in taken]),
        "target_s": LOAD_TARGET_S,
        "processes": "fresh",
    }
    if reference:
        row["hf_init_s"] = rounds.spread([r.samples[HF_INIT][0] for r in taken])
        row["hf_init_touched_s"] = rounds.spread([r.samples[HF_INIT_TOUCHED][0] for r in taken])
        # HF init / ours within each round: how many times faster ours is
        row["speedup"] = rounds.spread([r.samples[HF_INIT][0] / r.samples[OURS][0] for r in taken])
        # the same on touched memory: the init work alone
        row["speedup_touched"] = rounds.spread(
            [r.samples[HF_INIT_TOUCHED][0] / r.samples[OURS_TOUCHED][0] for r in taken]
        )
    return row


def first_load(name: str, which: str, touched: bool) -> tuple[float, int, float]:
    """(seconds, parameters, touch seconds) of one load in this (fresh) process: the pipeline's
    load stage or Hugging Face's `_from_config` of the class that stage resolves, on real memory.
    `touched`: the model's bytes allocated and zeroed first in one block of the heap (as our load's
    first touch does per parameter, models/build.first_touch) and freed into a heap that keeps it,
    so the load's parameters land on pages already faulted in; its seconds are the touch's (else
    0). The config is composed and the class imported (its modeling module) before either clock."""
    with tempfile.TemporaryDirectory() as tmp:
        state = new_state([f"model={name}", "seed=0"], torch.float32, torch.device("cpu"), Path(tmp))
        model_cls = zoo.resolve_model_class(state.cfg.model, state.hf_config)
        touch_s = 0.0
        if touched:
            skeleton = on_meta(model_cls, state.hf_config, state.device, None)
            nbytes = sum(p.numel() * p.element_size() for p in skeleton.parameters())
            del skeleton
            touch_s = touch_and_keep(nbytes, state.device)
        start = time.perf_counter()
        if which == OURS:
            advance(state, "load")
            return time.perf_counter() - start, state.model_info.params, touch_s
        model = model_cls._from_config(state.hf_config)
        seconds = time.perf_counter() - start
        return seconds, sum(p.numel() for p in model.parameters()), touch_s


def touch_and_keep(nbytes: int, device: torch.device) -> float:
    """Seconds to allocate and zero `nbytes` in one block, then freed into glibc's heap, which keeps
    every freed byte from here on (this process's allocations come from it)."""
    message = keep_all_freed_memory()
    if "kept" not in message:
        raise RuntimeError(message)
    start = time.perf_counter()
    block = first_touch(torch.Size([nbytes]), torch.uint8, device)
    seconds = time.perf_counter() - start
    del block
    return seconds
