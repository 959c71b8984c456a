"""Decode, side by side in one process: Hugging Face eager `generate` and demollm on the partly
captured, transformed, cached model, same weights and batch, against the machine's read bandwidth.

Decode of a small batch is memory-bound: every step reads the language model's weights and lm_head
once. Achieved bandwidth = those bytes / step time, as a percent of a large-tensor reduction's
bandwidth measured in the same run.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch

from pipeline.bench.limits import gemv_read_gbs
from pipeline.bench.prepare import advance, engine_of, prepared
from pipeline.devices import dtype_name, sync
from pipeline.graphs import find_graphs
from pipeline.library import references_on_cuda
from pipeline.models import zoo
from pipeline.models.inputs import random_ids, special_ids
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams


def _hf_times(model, prompts: torch.Tensor, steps: int, repeats: int) -> tuple[float, float]:
    """HF generate: (decode step, prefill) in seconds, medians over repeats after a warm-up."""
    for _ in range(2):  # warm-up at the timed lengths: a static cache's length is the generated length
        _hf_sample(model, prompts, steps)
    pairs = [_hf_sample(model, prompts, steps) for _ in range(repeats)]
    return statistics.median(d for d, _ in pairs), statistics.median(p for _, p in pairs)


def bench_decode(
    name: str,
    batches: list[int],
    prompt_len: int,
    steps: int,
    repeats: int,
    bandwidth: float,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """bandwidth: the read bandwidth measured at the start of the run, before any model was loaded."""
    with prepared([f"model={name}"], dtype, torch.device("cpu")) as state:
        weight_bytes = state.model_info.decode_bytes
        hf, ours, gemv = _decode_step_s(state, batches, prompt_len, steps, repeats)
    rows = []
    for b in batches:
        rows.append(
            {
                "batch": b,
                "hf_eager_ms": 1000 * hf[b],
                "demollm_ms": 1000 * ours[b],
                "speedup": hf[b] / ours[b],
                "demollm_gbs": weight_bytes / ours[b] / 1e9,
                "hf_gbs": weight_bytes / hf[b] / 1e9,
            }
        )
    return {
        "model": name,
        "dtype": dtype_name(dtype),
        "prompt_len": prompt_len,
        "steps": steps,
        "weight_bytes": weight_bytes,
        "read_bandwidth_gbs": bandwidth,
        "gemv_read_gbs": gemv,
        "rows": rows,
    }


def _decode_step_s(state, batches: list[int], prompt_len: int, steps: int, repeats: int):
    """({batch: HF eager step s}, {batch: demollm step s}, lm_head GEMV GB/s) on the prepared model."""
    text_config = zoo.text_config_of(state.hf_config)
    generator = torch.Generator().manual_seed(0)
    prompts = {
        b: random_ids((b, prompt_len), text_config.vocab_size, special_ids(state.hf_config), generator)
        for b in batches
    }
    hf = {b: _hf_times(state.model, prompts[b], steps, repeats)[0] for b in batches}
    gemv = gemv_read_gbs(state.model.get_output_embeddings().weight.detach())  # the largest weight: lm_head
    # HF's rows ran first: the transforms rewrite the eager lm_head of this same model.
    engine = engine_of(advance(state, "export", "transforms"))
    ours = {b: _demollm_step_s(engine, prompts[b], steps, repeats)[0] for b in batches}
    return hf, ours, gemv


def _demollm_step_s(engine: DemoLLM, prompts: torch.Tensor, steps: int, repeats: int) -> tuple[float, float]:
    """(median decode step, median prefill) in seconds, after a warm-up generation."""
    requests = [Request(i, prompts[i].tolist()) for i in range(prompts.shape[0])]
    engine.generate(requests, steps + 1, SamplingParams(), seed=0)  # warm-up (and compile)
    runs = [engine.generate(requests, steps + 1, SamplingParams(), seed=0) for _ in range(repeats)]
    return statistics.median(statistics.median(r.decode_step_s) for r in runs), statistics.median(
        r.prefill_s for r in runs
    )


class _HFCompiled:
    """Hugging Face's own recipe: a static cache and torch.compile of the forward, switched on for
    one sample at a time so that the same model also serves the eager rows. On a GPU, generate
    compiles the forward itself once the cache is static (mode reduce-overhead: CUDA graphs, with the
    output handling that mode needs; compiling the forward here as well nested two compilations and
    failed on an H200 with an output overwritten by a later replay); on CPU it does not, so the
    forward is compiled here."""

    def __init__(self, model, device: torch.device):
        self.model = model
        # compiled on first use
        self.forward = None if device.type == "cuda" else torch.compile(model.forward)

    def sample(self, prompts: torch.Tensor, steps: int) -> tuple[float, float]:
        if self.forward is not None:
            self.model.forward = self.forward
        self.model.generation_config.cache_implementation = "static"
        try:
            return _hf_sample(self.model, prompts, steps)
        finally:
            self.model.__dict__.pop("forward", None)
            self.model.generation_config.cache_implementation = None


def _hf_sample(model, prompts: torch.Tensor, steps: int) -> tuple[float, float]:
    """One HF generate of 1 + steps tokens: (median decode step, prefill) in seconds, from a
    timestamp generate takes after every step. (Subtracting a 1-token generate from a longer one
    carried the noise of two prefills into every step: on CPU in bfloat16 HF's prefill lm_head
    expands its weight for a batched matmul, seconds that varied run to run.)"""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class StepClock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            sync(prompts.device)
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    sync(prompts.device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=prompts,
            max_new_tokens=1 + steps,
            min_new_tokens=1 + steps,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([StepClock()]),
        )
    step_s = [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]
    return statistics.median(step_s), stamps[0] - start


def bench_backends(
    name: str,
    batch: int,
    prompt_len: int,
    steps: int,
    repeats: int,
    device: torch.device,
    dtype: torch.dtype,
    backends: list[str],
    stepped: tuple[str, ...] | list[str] = (),
    without_kernels: tuple[str, ...] | list[str] = (),
) -> dict:
    """Per runner, same weights and batch, one process: HF eager, HF static cache + torch.compile,
    and demollm with each backend (each of `stepped` again with runtime.lookahead 0, and each of
    `without_kernels` again with the canonical ops' reference aten chains on CUDA). Runners
    take turns, one sample each per round, so that a slow phase of a noisy machine lands on all of
    them, not on whichever ran then; medians over rounds after a warm-up round. A runner that fails
    is a row with its error, not a lost table."""
    with prepared([f"model={name}"], dtype, device) as state:
        rows = take_turns(
            _backend_runners(state, batch, prompt_len, steps, backends, stepped, without_kernels), repeats
        )
    eager = rows[0].get("decode_ms")
    for row in rows:
        if eager and "decode_ms" in row:
            row["vs_hf_eager"] = row["decode_ms"] / eager
    return {
        "model": name,
        "batch": batch,
        "prompt_len": prompt_len,
        "steps": steps,
        "repeats": repeats,
        "device": str(device),
        "dtype": dtype_name(dtype),
        "rows": rows,
    }


def _backend_runners(state, batch, prompt_len, steps, backends, stepped, without_kernels) -> dict:
    """name -> a sample (decode s, prefill s): HF eager and HF's compile recipe on a copy of the
    eager model, demollm per backend on the prepared one."""
    device = state.device
    # HF's copy: the transforms rewrite eager modules too (onednn_linear's lm_head), and the HF
    # rows must run Hugging Face's model as it is.
    hf_model = copy.deepcopy(state.model)
    engine = engine_of(advance(state, "export", "transforms"))
    text_config = zoo.text_config_of(state.hf_config)
    generator = torch.Generator().manual_seed(0)
    prompts = random_ids((batch, prompt_len), text_config.vocab_size, special_ids(state.hf_config), generator)
    prompts = prompts.to(device)
    demollm = _DemollmSampler(engine, find_graphs(state.model), state.cfg.runtime, prompts, steps)
    hf_compiled = _HFCompiled(hf_model, device)
    lookahead = state.cfg.runtime.lookahead
    return {
        "HF eager generate": lambda: _hf_sample(hf_model, prompts, steps),
        "HF static cache + torch.compile": lambda: hf_compiled.sample(prompts, steps),
        **{f"demollm {b}": (lambda b=b: demollm.sample(b, lookahead)) for b in backends},
        # The same backend with every step's tokens read before the next is launched: what the
        # host running ahead is worth.
        **{f"demollm {b}, lookahead 0": (lambda b=b: demollm.sample(b, 0)) for b in stepped},
        # The same backend with the aten chains the Triton kernels replace: what the kernels are worth.
        **{
            f"demollm {b}, aten ops": (lambda b=b: demollm.sample(b, lookahead, kernels=False))
            for b in without_kernels
        },
    }


class _DemollmSampler:
    """One demollm sample with a backend put on the graphs for its duration."""

    def __init__(self, engine: DemoLLM, targets, runtime, prompts: torch.Tensor, steps: int):
        self.engine, self.targets, self.runtime, self.steps = engine, targets, runtime, steps
        self.requests = [Request(i, prompts[i].tolist()) for i in range(prompts.shape[0])]
        self.on_cuda = prompts.device.type == "cuda"

    def sample(self, backend: str, lookahead: int, kernels: bool = True) -> tuple[float, float]:
        from pipeline import backends

        # Re-applying a compile backend finds Dynamo's cache from the warm-up round: no recompile.
        backends.apply(backend, self.targets, self.runtime, None, on_cuda=self.on_cuda)
        self.engine.lookahead = lookahead
        try:
            # CUDA graphs are captured in the first generate, with the kernels active then
            with contextlib.nullcontext() if kernels else references_on_cuda():
                self.engine.generate(self.requests, 3, SamplingParams(), seed=0)  # caches warm
                run = self.engine.generate(self.requests, self.steps + 1, SamplingParams(), seed=0)
            return statistics.median(run.decode_step_s), run.prefill_s
        finally:
            backends.remove(self.targets)


def take_turns(runners: dict, repeats: int) -> list[dict]:
    """Each runner -> (decode s, prefill s): one sample each per round, round 0 a warm-up (and
    compile) whose samples are dropped; a row per runner with the medians, or its error."""
    from pipeline.errors import short_cause

    samples: dict[str, list[tuple[float, float]]] = {runner: [] for runner in runners}
    errors: dict[str, str] = {}
    for round_ in range(repeats + 1):
        for runner, sample in runners.items():
            if runner in errors:
                continue
            try:
                value = sample()
            except Exception as exc:  # recorded in the table: one broken runner must not hide the others
                errors[runner] = short_cause(exc)
                continue
            if round_:
                samples[runner].append(value)
    rows = []
    for runner in runners:
        if runner in errors:
            rows.append({"runner": runner, "error": errors[runner]})
            continue
        rows.append(
            {
                "runner": runner,
                "decode_ms": 1000 * statistics.median(d for d, _ in samples[runner]),
                "prefill_ms": 1000 * statistics.median(p for _, p in samples[runner]),
            }
        )
    return rows


def backends_markdown(result: dict, target: str) -> list[str]:
    lines = [
        f"## Decode per backend, `model={result['model']}` ({result['dtype']}, {result['device']}, "
        f"batch {result['batch']}, prompt {result['prompt_len']} tokens)",
        "",
        (
            f"Same weights and batch, one process; the runners take turns, one sample each per round, "
            f"median over {result['repeats']} rounds after a warm-up round. Target: {target}."
            if "repeats" in result  # recorded before runners took turns: one runner after another
            else f"Same weights and batch, one process; median over repeats after a warm-up. Target: {target}."
        ),
        "",
        "| runner | decode ms/step | x HF eager | prefill ms |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['runner']} | failed: {r['error']} | - | - |")
        else:
            ratio = f"{r['vs_hf_eager']:.2f}" if "vs_hf_eager" in r else "-"
            lines.append(f"| {r['runner']} | {r['decode_ms']:.2f} | {ratio} | {r['prefill_ms']:.1f} |")
    return lines


def markdown(result: dict) -> list[str]:
    bw, gemv = result["read_bandwidth_gbs"], result["gemv_read_gbs"]
    lines = [
        f"## Decode, `model={result['model']}` ({result['dtype']}, CPU, prompt {result['prompt_len']} tokens)",
        "",
        f"Measured read bandwidth: {bw:.1f} GB/s. A step reads {result['weight_bytes'] / 1e9:.2f} GB of weights "
        "(decoder layers, final norm, lm_head). Median step over "
        f"{result['steps']} decode steps. Target: at least 85 % of the read bandwidth, and never slower "
        "than Hugging Face eager. For reference, one GEMV over the lm_head weight with the kernel demollm's "
        f"linears use in this dtype reads {gemv:.1f} GB/s (last column: demollm as a percent of that).",
        "",
        "| batch | HF eager generate | demollm (uncompiled graph, attention=torch) | demollm vs HF | demollm bandwidth | HF bandwidth | demollm / GEMV |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['hf_eager_ms']:.1f} ms | {r['demollm_ms']:.1f} ms | {r['speedup']:.2f}x | "
            f"{r['demollm_gbs']:.1f} GB/s ({100 * r['demollm_gbs'] / bw:.0f} %) | "
            f"{r['hf_gbs']:.1f} GB/s ({100 * r['hf_gbs'] / bw:.0f} %) | {100 * r['demollm_gbs'] / gemv:.0f} % |"
        )
    return lines
