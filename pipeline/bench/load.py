"""The load row: the pipeline's load stage (random init on the meta-built model) against Hugging
Face's own init of the same class, each sample the first load of a fresh process, as
`python -m pipeline` loads once per run.

Why fresh processes: a repeated load in one process is not what a run does (the first load of a
process touches its memory for the first time), and a single process drew one speed for the whole
row, so the ratio held within a run and moved between runs.

Why loads on touched memory beside them: every load pays for its memory's first touch (page
faults, and on a virtual machine the host backing the pages), and that cost moves by itself; ours
is mostly touch and Hugging Face's mostly single-threaded init, so the fresh loads' ratio moved
with it. A touch timed in a process of its own and subtracted from both moved as much. So two more
fresh processes each round first allocate and zero a block of glibc's heap and free it, the heap
kept whole (host_memory.keep_all_freed_memory), and then load: the parameters land on pages
already faulted in, and the ratio of those two loads is the init work's alone, with the touch
timed in the same process.

Why the block is TOUCH_HEADROOM times the model's bytes: both builds allocate every parameter once
on the CPU before moving it to meta, and with mmap turned off those transient blocks come from the
kept heap, between small live allocations, which leaves it in pieces; with a block of just the
model's bytes, part of the model landed past it on fresh pages. Each touched load counts its page
faults, and a round where either faulted in more than SPILL_FRACTION of the model's bytes (beside a
fixed allowance for the process's own small allocations) has no touched ratio: such rounds are
counted, not used."""

from __future__ import annotations

import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.bench import rounds
from pipeline.bench.child import in_child
from pipeline.bench.prepare import job
from pipeline.models import meta, zoo
from pipeline.models.build import first_touch
from pipeline.runner import advance, new_state
from pipeline.runtime.host_memory import keep_all_freed_memory

LOAD_TARGET_S = 15.0
# the touched block against the model's bytes (the docstring says why half again)
TOUCH_HEADROOM = 1.5
# a touched load faulting in more than this share of the model's bytes landed off the touched
# block; the allowance covers the process's own allocations (a clean mistral3 load: 1.6 MB)
SPILL_FRACTION = 0.05
SPILL_ALLOWANCE_BYTES = 16 * 2**20
OURS, HF_INIT = "ours", "HF init"
OURS_TOUCHED, HF_INIT_TOUCHED = "ours, touched memory", "HF init, touched memory"


def bench_load(name: str, repeats: int, reference: bool) -> dict:
    """`repeats` rounds, each our load and (when `reference`) Hugging Face's init, each in a fresh
    process, then both again on memory touched first (tens of seconds each on mistral3, plus a few
    seconds to start a process); the speed-ups taken within each round, where the
    machine's drift is shared. No warm-up round: the first load of a process is the measurement."""
    params: dict[str, int] = {}
    faults: dict[str, list[int]] = {OURS_TOUCHED: [], HF_INIT_TOUCHED: []}

    def ours() -> rounds.Sample:
        seconds, params["params"], _, _ = in_child(first_load, name, OURS, False)
        return seconds, 0.0

    def hf_init() -> rounds.Sample:
        return in_child(first_load, name, HF_INIT, False)[0], 0.0

    def touched(which: str, label: str) -> Callable[[], rounds.Sample]:
        def sample() -> rounds.Sample:  # (the load's seconds, the touch's before it)
            seconds, _, touch, load_faults = in_child(first_load, name, which, True)
            faults[label].append(load_faults)
            return seconds, touch

        return sample

    runners = {
        OURS: ours,
        **({HF_INIT: hf_init} if reference else {}),
        OURS_TOUCHED: touched(OURS, OURS_TOUCHED),
        **({HF_INIT_TOUCHED: touched(HF_INIT, HF_INIT_TOUCHED)} if reference else {}),
    }
    taken, errors = rounds.take_turns(runners, repeats, warm_up=False)
    if errors:
        raise RuntimeError(f"load rows failed: {errors}")
    model_bytes = params["params"] * torch.float32.itemsize
    # the touched loads' page faults per round, one sample each (a failed sample raised above)
    measured = {label: counts for label, counts in faults.items() if counts}
    faults_per_round = [
        dict(zip(measured, counts, strict=True)) for counts in zip(*measured.values(), strict=True)
    ]
    row = {
        "params": params["params"],
        "ours_s": rounds.spread([r.samples[OURS][0] for r in taken]),
        "ours_touched_s": rounds.spread([r.samples[OURS_TOUCHED][0] for r in taken]),
        # the touch of the block in the process whose load follows it, as a rate: the block is
        # TOUCH_HEADROOM times the model's bytes
        "touch_gbs": rounds.spread(
            [TOUCH_HEADROOM * model_bytes / r.samples[OURS_TOUCHED][1] / 1e9 for r in taken]
        ),
        "touched_load_faults_max": max(max(counts) for counts in measured.values()),
        "target_s": LOAD_TARGET_S,
        "processes": "fresh",
    }
    if reference:
        row["hf_init_s"] = rounds.spread([r.samples[HF_INIT][0] for r in taken])
        row["hf_init_touched_s"] = rounds.spread([r.samples[HF_INIT_TOUCHED][0] for r in taken])
        # HF init / ours within each round: how many times faster ours is
        row["speedup"] = rounds.spread([r.samples[HF_INIT][0] / r.samples[OURS][0] for r in taken])
        row.update(touched_speedup(taken, faults_per_round, model_bytes))
    return row


def spilled(load_faults: int, model_bytes: int) -> bool:
    """Whether a load on touched memory faulted in more than its allowance: its parameters, or
    some, landed off the touched block, on pages the host backs anew."""
    return load_faults * resource.getpagesize() > SPILL_FRACTION * model_bytes + SPILL_ALLOWANCE_BYTES


def touched_speedup(taken: list[rounds.Round], faults: list[dict[str, int]], model_bytes: int) -> dict:
    """HF init / ours on touched memory, per round: the init work alone. A round where either load
    spilled off its touched block measured part of a touch too; it is counted, not used, and with
    none left the row has no such ratio."""
    kept = [
        r.samples[HF_INIT_TOUCHED][0] / r.samples[OURS_TOUCHED][0]
        for r, round_faults in zip(taken, faults, strict=True)
        if not any(spilled(f, model_bytes) for f in round_faults.values())
    ]
    row: dict = {"touched_rounds_spilled": len(taken) - len(kept)}
    if kept:
        row["speedup_touched"] = rounds.spread(kept)
    return row


def first_load(name: str, which: str, touched: bool) -> tuple[float, int, float, int]:
    """(seconds, parameters, touch seconds, page faults) of one load in this (fresh) process: the
    pipeline's load stage or Hugging Face's `_from_config` of the class that stage resolves, on
    real memory. `touched`: a block of TOUCH_HEADROOM times the model's bytes allocated and zeroed
    first (as our load's first touch does per parameter, models/build.first_touch) and freed into a
    heap that keeps it, so the load's parameters land on pages already faulted in; its seconds are
    the touch's (else 0). The config is composed and the class imported (its modeling module)
    before either clock; the page faults are the load's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        state = new_state(job([f"model={name}", "seed=0"], torch.float32, torch.device("cpu"), Path(tmp)))
        model_cls = zoo.resolve_model_class(state.cfg.model, state.hf_config)
        touch_s = 0.0
        if touched:
            nbytes = meta.parameter_count(meta.meta_model(model_cls, state.hf_config)) * state.dtype.itemsize
            touch_s = touch_and_keep(int(TOUCH_HEADROOM * nbytes), state.device)
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        if which == OURS:
            advance(state, "load")
            seconds, params = time.perf_counter() - start, state.model_info.params
        else:
            model = model_cls._from_config(state.hf_config)
            seconds, params = time.perf_counter() - start, sum(p.numel() for p in model.parameters())
        return seconds, params, touch_s, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before


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
