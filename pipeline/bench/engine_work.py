"""What a decode step asks of the host besides the captured graph, counted op by op.

On a GPU a decode step of a small model is bound by the host: every op the engine and the eager
parent dispatch is a kernel launch or a copy the host must issue, and every host read of a device
value (`int(t)`, `.item()`) stops the host until the device is idle, so the next step's launches
cannot overlap the current step's kernels. The counts are the same on any device, so they are
measured here, on CPU, with a dispatch mode over whole decode steps of the seed's layout (a VLM whose
language model is the captured graph; embedding, lm_head and sampling eager), outside the graph.
Views (slices, reshapes) and profiler ranges launch nothing and are not counted.

Beside the counts, the host's time per decode step outside the graph: the step's time with the
graph forward's own time taken out, on this CPU (uncounted runs). On a GPU the forward is one
replay, and this is the work running ahead (`runtime.lookahead`) has to hide behind the device.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.backends.install import apply, remove
from pipeline.bench import rounds
from pipeline.bench.prepare import engine_of, prepared
from pipeline.config import BackendConfig
from pipeline.graphs import find_graphs
from pipeline.models import zoo
from pipeline.models.inputs import random_ids, special_ids
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams

HOST_DATA = "aten.lift_fresh.default"  # a tensor built from Python values: a host-to-device copy on a GPU
DEVICE_READ = "aten._local_scalar_dense.default"  # a device value read on the host: a sync on a GPU


class _GraphCalls:
    """Wraps the captured graph's forward: marks when it runs, and times each call."""

    def __init__(self, forward):
        self.forward = forward
        self.depth = 0  # > 0 while the graph runs
        self.seconds: list[float] = []

    def __call__(self, *args, **kwargs):
        self.depth += 1
        start = time.perf_counter()
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)
            self.depth -= 1


class _OpCounter(TorchDispatchMode):
    def __init__(self, graph_calls: _GraphCalls):
        super().__init__()
        self.graph_calls = graph_calls  # ops while the graph itself runs are not counted
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self.graph_calls.depth and (
            name == HOST_DATA or not (func.is_view or name.startswith("profiler."))
        ):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _host_ms(
    engine: DemoLLM, requests: list[Request], graph_calls: _GraphCalls, steps: int, repeats: int
) -> dict[str, float]:
    """Over runs, (median decode step - median graph forward) in ms, as a spread."""
    outside = []
    for _ in range(repeats):
        graph_calls.seconds = []
        generation = engine.generate(requests, steps + 1, SamplingParams(), seed=0)
        forwards = graph_calls.seconds[1:]  # the first call is the prefill
        outside.append(generation.decode_ms - 1000 * statistics.median(forwards))
    return rounds.spread(outside)


def bench_engine_work(
    name: str, batches: list[int], backends: list[str], steps: int = 8, repeats: int = 5
) -> dict:
    """Per backend and batch: ops per decode step outside the captured graph, and the host's time."""
    with prepared([f"model={name}"], torch.float32, torch.device("cpu"), "transforms") as state:
        rows = _rows(engine_of(state), find_graphs(state.model), state.cfg.runtime, state.hf_config,
                     batches, backends, steps, repeats)  # fmt: skip
    return {"model": name, "steps": steps, "repeats": repeats, "rows": rows}


def _rows(engine: DemoLLM, targets, runtime, hf_config, batches, backends, steps, repeats) -> list[dict]:
    text_config = zoo.text_config_of(hf_config)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for backend in backends:
        runners = apply(backend, targets, runtime, BackendConfig(backend), on_cuda=False)
        graph = targets[0][1]
        if runners:  # the runner's copies are outside work, its (replayed) graph is not
            runner = next(iter(runners.values()))
            inner = runner.forward_fn
            runner.forward_fn = graph_calls = _GraphCalls(inner)
        else:
            inner = graph.forward
            graph.forward = graph_calls = _GraphCalls(inner)
        counter = _OpCounter(graph_calls)
        try:
            for batch in batches:
                prompts = random_ids((batch, 24), text_config.vocab_size, special_ids(hf_config), generator)
                requests = [Request(i, prompts[i].tolist()) for i in range(batch)]
                engine.generate(requests, 3, SamplingParams(), seed=0)  # buffers and shapes seen once
                per_run = []
                for new_tokens in (2, steps + 2):  # the difference is `steps` decode steps
                    counter.counts = Counter()
                    with counter:
                        engine.generate(requests, new_tokens, SamplingParams(), seed=0)
                    per_run.append(counter.counts)
                host_ms = _host_ms(engine, requests, graph_calls, steps, repeats)
                rows.append(
                    {"backend": backend, "batch": batch, **_per_step(*per_run, steps), "host_ms": host_ms}
                )
        finally:
            if runners:
                runner.forward_fn = inner
            else:
                graph.forward = inner
            remove(targets)
    return rows


def _per_step(short: Counter, long: Counter, steps: int) -> dict:
    step = {op: (long[op] - short[op]) / steps for op in long}
    return {
        "ops": sum(n for op, n in step.items() if op not in (HOST_DATA, DEVICE_READ)),
        "host_tensors": step.get(HOST_DATA, 0.0),
        "device_reads": step.get(DEVICE_READ, 0.0),
    }


def markdown(result: dict) -> list[str]:
    lines = [
        f"## Host work per decode step outside the captured graph, `model={result['model']}`",
        "",
        f"Ops dispatched per decode step, counted on CPU over {result['steps']} steps (the counts are "
        "the same on any device): the engine's step inputs, the eager embedding and lm_head, sampling, "
        "and the CUDA-graph runner's copies (torch-cudagraph runs them here without capture). Views and "
        "profiler ranges launch nothing and are not counted; a custom op counts once. On a GPU each op "
        "is a kernel launch or copy the host issues, each host tensor (built from Python values) a "
        "host-to-device copy, and each device read a stall of the host until the device is idle. "
        "Host ms: the decode step's time with the graph forward's own time taken out (median of "
        f"{result['repeats']} runs on this CPU, p10-p90): the engine, the eager parts and the copies, the "
        "work the host must finish within the device's step for running ahead to hide it.",
        "",
        "| backend | batch | ops | host tensors | device reads | host ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['ops']:.0f} | {r['host_tensors']:.0f} | "
            f"{r['device_reads']:.0f} | {rounds.shown(r['host_ms'], 3)} |"
        )
    return lines
