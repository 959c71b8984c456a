"""The load row: the pipeline's load stage (random init on the meta-built model) against Hugging
Face's own init of the same class, each sample the first load of a fresh process, as
`python -m pipeline` loads once per run.

Why fresh processes: measured in one process, three rounds after a warm-up, the ratio held within
each run (p10-p90 3.43-3.68) and moved between runs an hour apart (3.50 -> 3.13 on 2026-12-03,
2.77 -> 2.24 and 2.98 -> 2.53 before): Hugging Face's init went 45.3 -> 38.7 s while ours held
12.7 -> 12.4 s, so each run's single process drew one speed for the whole row. And a repeated load
in one process is not what a run does: the first load of a process (its memory touched for the
first time) took 14.7-15.9 s here where the repeats in one process took 12.4-12.7 s.

Why a touch sample beside them: every load pays for its memory's first touch (page faults, and on
this virtual machine the host backing the pages), and that cost moves on its own. Two runs an hour
apart (2026-12-03 17:54 and 18:54) measured ours 8.4 -> 31.9 s and Hugging Face's 29.3 -> 83.7 s:
the ratio 3.48 -> 2.62, because ours is mostly touch and Hugging Face's mostly single-threaded
normal_. A fresh process that allocates and zeroes every parameter, as ours does before its fill
(models/build.py), measures that floor in each round; the row reports it and the ratio of the
work beyond it, (HF - touch) / (ours - touch)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from pipeline.bench import rounds
from pipeline.bench.child import in_child
from pipeline.bench.prepare import advance, new_state
from pipeline.models import zoo
from pipeline.models.build import first_touch, on_meta

LOAD_TARGET_S = 15.0
OURS, HF_INIT, TOUCH = "ours", "HF init", "touch"


def bench_load(name: str, repeats: int, reference: bool) -> dict:
    """`repeats` rounds, each the memory's touch, our load and (when `reference`) Hugging Face's
    init in a fresh process each (about 3, 10 and 30 s on mistral3 here, plus a few seconds to
    start a process); the speed-ups taken within each round, where the machine's drift is shared.
    No warm-up round: the first load of a process is the measurement."""
    params: dict[str, int] = {}

    def ours() -> rounds.Sample:
        seconds, params["params"] = in_child(first_load, name, OURS)
        return seconds, 0.0

    def hf_init() -> rounds.Sample:
        return in_child(first_load, name, HF_INIT)[0], 0.0

    def touch() -> rounds.Sample:
        return in_child(first_load, name, TOUCH)[0], 0.0

    runners = {TOUCH: touch, OURS: ours, **({HF_INIT: hf_init} if reference else {})}
    taken, errors = rounds.take_turns(runners, repeats, warm_up=False)
    if errors:
        raise RuntimeError(f"load rows failed: {errors}")
    row = {
        "params": params["params"],
        "ours_s": rounds.spread([r.samples[OURS][0] for r in taken]),
        "touch_s": rounds.spread([r.samples[TOUCH][0] for r in taken]),
        "target_s": LOAD_TARGET_S,
        "processes": "fresh",
    }
    if reference:
        row["hf_init_s"] = rounds.spread([r.samples[HF_INIT][0] for r in taken])
        # HF init / ours within each round: how many times faster ours is
        row["speedup"] = rounds.spread([r.samples[HF_INIT][0] / r.samples[OURS][0] for r in taken])
        row.update(beyond_touch(taken))
    return row


def beyond_touch(taken: list[rounds.Round]) -> dict:
    """(HF - touch) / (ours - touch) per round: the init work alone. The touch is a process of its
    own, so in a round where it drew a slower machine than our load, ours - touch is zero or
    negative and the round has no ratio; those rounds are counted, not used, and with none left
    the row has no such ratio."""
    beyond = [
        (r.samples[HF_INIT][0] - r.samples[TOUCH][0]) / (r.samples[OURS][0] - r.samples[TOUCH][0])
        for r in taken
        if r.samples[OURS][0] > r.samples[TOUCH][0]
    ]
    row: dict = {"beyond_touch_rounds_without_ratio": len(taken) - len(beyond)}
    if beyond:
        row["speedup_beyond_touch"] = rounds.spread(beyond)
    return row


def first_load(name: str, which: str) -> tuple[float, int]:
    """(seconds, parameters) of one load in this (fresh) process: the pipeline's load stage,
    Hugging Face's `_from_config` of the class that stage resolves, on real memory, or the touch:
    every parameter of the model built on meta allocated and zeroed, as our load does before its
    fill. The config is composed and the class imported (its modeling module) before the clock
    starts, for all three."""
    with tempfile.TemporaryDirectory() as tmp:
        state = new_state([f"model={name}", "seed=0"], torch.float32, torch.device("cpu"), Path(tmp))
        model_cls = zoo.resolve_model_class(state.cfg.model, state.hf_config)
        if which == OURS:
            start = time.perf_counter()
            advance(state, "load")
            return time.perf_counter() - start, state.model_info.params
        if which == TOUCH:
            shapes = [p.shape for p in on_meta(model_cls, state.hf_config, state.device, None).parameters()]
            start = time.perf_counter()
            touched = [first_touch(shape, state.dtype, state.device) for shape in shapes]
            return time.perf_counter() - start, sum(t.numel() for t in touched)
        start = time.perf_counter()
        model = model_cls._from_config(state.hf_config)
        seconds = time.perf_counter() - start
        return seconds, sum(p.numel() for p in model.parameters())
