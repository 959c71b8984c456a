"""Decode, side by side in one process: Hugging Face eager `generate` and demollm on the partly
captured, transformed, cached model, same weights and batch, against the machine's read bandwidth.

Decode of a small batch is memory-bound: every step reads the language model's weights and lm_head
once. Achieved bandwidth = those bytes / step time, as a percent of the read bandwidth of a large
buffer (the faster of a reduction and a one-row GEMV over it) measured in the same run.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass

import torch

from pipeline.bench import rounds
from pipeline.bench.child import in_child
from pipeline.bench.limits import ReadLimit, WeightPass
from pipeline.bench.prepare import engine_of, prepared
from pipeline.config import BackendConfig
from pipeline.devices import dtype_name, sync
from pipeline.graphs import eager_graphs, find_graphs
from pipeline.kernels import cpu_gemv
from pipeline.library import kernels_replaced, references_on_cuda
from pipeline.models import zoo
from pipeline.models.inputs import random_ids, special_ids
from pipeline.models.memory import decode_weights
from pipeline.ops import moe_reference
from pipeline.runner import advance
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.requests import Request
from pipeline.runtime.routed_bytes import routed_decode_bytes
from pipeline.runtime.sampling import SamplingParams
from pipeline.transforms.registry import model_passes_undone

HF_EAGER = "HF eager generate"  # the reference every per-backend row is a ratio to


@dataclass
class DecodeRounds:
    """One process's decode rounds (measure_decode), pooled with other processes' by bench_decode."""

    weight_bytes: int
    routed: dict[int, int]  # batch -> bytes a step reads with the routed experts only (MoE)
    runners: list[str]
    rounds: list[rounds.Round]


def bench_decode(
    name: str,
    batches: list[int],
    prompt_len: int,
    steps: int,
    repeats: int,
    dtype: torch.dtype = torch.float32,
    processes: int = 0,
) -> dict:
    """The decode rows (measure_decode): `repeats` rounds in each of `processes` fresh processes,
    pooled, or with processes=0 in this one. A process's own state can move a runner's time by more
    than a round's noise (MKL's float32 GEMM drew a speed per process), so a row measured in one
    process carries that process's draw in its median, and rounds from several carry a spread of
    them. A fresh process per part also gives the previous dtype's model memory back."""
    args = (name, batches, prompt_len, steps, repeats, dtype)
    measured = (
        [in_child(measure_decode, *args) for _ in range(processes)] if processes else [measure_decode(*args)]
    )
    return summarize(name, batches, prompt_len, steps, dtype, measured)


def measure_decode(
    name: str, batches: list[int], prompt_len: int, steps: int, repeats: int, dtype: torch.dtype
) -> DecodeRounds:
    """Hugging Face eager and demollm on the same weights (and, where the onednn_linear transform
    put oneDNN's inner product in the graph, demollm again with F.linear in its place), taking turns
    per round (rounds.py) with two limits measured around each round's samples: the read bandwidth
    and the GEMV pass over the step's own weights (limits.WeightPass) at each batch.

    Where match_moe put `pipeline::moe` in the graph, demollm runs again with each moe as Hugging
    Face's all-experts form ("demollm all experts"), and demollm's read rate counts the bytes a
    step reads with the routed experts only (counted in an untimed generation before the rounds,
    per batch: `routed_bytes`); Hugging Face and the all-experts form read every expert."""
    read = ReadLimit()  # its buffer before the model
    with prepared([f"model={name}"], dtype, torch.device("cpu")) as state:
        weight_bytes = state.model_info.decode_bytes
        text_config = zoo.text_config_of(state.hf_config)
        generator = torch.Generator().manual_seed(0)
        prompts = {
            b: random_ids((b, prompt_len), text_config.vocab_size, special_ids(state.hf_config), generator)
            for b in batches
        }
        engine = engine_of(advance(state, "transforms"))
        lm_paths = state.model_info.language_model_paths
        weights = decode_weights(state.model, lm_paths[0] if lm_paths else "")
        limits = {"read": read.measure}
        limits |= {f"gemv b{b}": WeightPass(weights, b, repeats=steps).measure for b in batches}
        # a linear kernel of the pipeline's own in the graph: demollm again with F.linear in its place
        routed_linears = sum(state.transform_history.matches(t) for t in ("onednn_linear", "bf16_gemv")) > 0
        moe = state.transform_history.matches("match_moe") > 0
        routed = {}  # batch -> bytes a step reads with the routed experts only (16 untimed steps)
        for b in batches if moe else ():
            routed[b] = routed_decode_bytes(engine, _requests(prompts[b]), 16, weight_bytes, state.device)
            if routed[b] is None:
                raise RuntimeError(
                    f"{name}: no decode step called pipeline::moe, its routing was not counted"
                )
        runners = {}
        for b in batches:
            runners[f"HF eager b{b}"] = lambda b=b: _hf_eager_sample(state, prompts[b], steps)
            runners[f"demollm b{b}"] = lambda b=b: _demollm_sample(engine, prompts[b], steps)
            if routed_linears:
                runners[f"demollm F.linear b{b}"] = lambda b=b: _f_linear_sample(engine, prompts[b], steps)
            if moe:
                runners[f"{ALL_EXPERTS_RUNNER} b{b}"] = lambda b=b: _all_experts_sample(
                    engine, prompts[b], steps
                )
        rounds_, errors = rounds.take_turns(runners, repeats, limits)
    if errors:
        raise RuntimeError(f"decode rows failed: {errors}")
    return DecodeRounds(weight_bytes, routed, list(runners), rounds_)


def summarize(
    name: str,
    batches: list[int],
    prompt_len: int,
    steps: int,
    dtype: torch.dtype,
    measured: list[DecodeRounds],
) -> dict:
    """The rows of one or more processes' rounds, pooled: every ratio is still taken within a round."""
    first = measured[0]
    if any(m.weight_bytes != first.weight_bytes or m.routed != first.routed for m in measured):
        raise RuntimeError(f"{name}: the processes' models read different bytes a step")
    rounds_ = [r for m in measured for r in m.rounds]
    rows = []
    for b in batches:
        named = {"read": "read", "gemv": f"gemv b{b}"}
        hf = f"HF eager b{b}"
        reads_every_expert = (hf, f"{ALL_EXPERTS_RUNNER} b{b}")
        rows.append(
            {
                "batch": b,
                "gemv_pass_gbs": rounds.spread([r.limits[f"gemv b{b}"] for r in rounds_]),
                **({"routed_bytes": first.routed[b]} if b in first.routed else {}),
                "runners": [
                    rounds.row(
                        rounds_,
                        runner,
                        hf,
                        first.weight_bytes
                        if runner in reads_every_expert
                        else first.routed.get(b, first.weight_bytes),
                        named,
                    )
                    | {
                        "runner": runner.removesuffix(f" b{b}"),
                        # each process's median step: how far a process's own state moved it
                        "process_ms": [
                            1000 * statistics.median(r.samples[runner][0] for r in m.rounds) for m in measured
                        ],
                    }
                    for runner in first.runners
                    if runner.endswith(f" b{b}")
                ],
            }
        )
    return {
        "model": name,
        "dtype": dtype_name(dtype),
        "prompt_len": prompt_len,
        "steps": steps,
        "rounds": len(rounds_),
        "processes": len(measured),
        "weight_bytes": first.weight_bytes,
        "read_limit_gbs": rounds.spread([r.limits["read"] for r in rounds_]),
        "rows": rows,
    }


def moe_rows_unaffordable(dtype: torch.dtype) -> str:
    """Why the bfloat16 MoE decode rows (llama4_scout) cannot run on this machine, or ''.

    Without oneDNN's bf16 matmul (a CPU without AVX-512), PyTorch falls back to ATen's loops, and
    Hugging Face's form runs all 16 experts of each layer through them: each decode step takes over
    a minute, so the rows would take hours."""
    if dtype != torch.bfloat16 or cpu_gemv.onednn_bf16():
        return ""
    return (
        "not measured: this CPU has no oneDNN bfloat16 matmul (no AVX-512), so Hugging Face's all-experts "
        "form runs every expert of a layer through ATen's bfloat16 loops, over a minute a decode step"
    )


F_LINEAR = dict.fromkeys(
    ("onednn_linear", "bf16_linear"), lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
)
ALL_EXPERTS_RUNNER = "demollm all experts"


def _all_experts_sample(engine: DemoLLM, prompts: torch.Tensor, steps: int) -> rounds.Sample:
    """demollm with every pipeline::moe run as Hugging Face's Llama-4 form (every expert on every
    token, the unrouted weighted 0): what reading only the routed experts is worth, same graph."""
    with kernels_replaced({"moe": moe_reference}, "CPU"):
        return _demollm_sample(engine, prompts, steps)


def _f_linear_sample(engine: DemoLLM, prompts: torch.Tensor, steps: int) -> rounds.Sample:
    """demollm with every pipeline::onednn_linear (graph and eager lm_head) run by F.linear: what
    the linear implementation is worth, on the same weights, in the same rounds."""
    with kernels_replaced(F_LINEAR, "CPU"):
        return _demollm_sample(engine, prompts, steps)


def _hf_eager_sample(state, prompts: torch.Tensor, steps: int) -> rounds.Sample:
    """Hugging Face's generate on the model as Hugging Face built it: the captured graphs swapped
    back for the modules they replaced and the model-scope rewrites undone, for this sample only
    (a copy of a 2.9 B float32 model would not fit beside it)."""
    with model_passes_undone(state.model, state.transform_history), eager_graphs(state.model) as eager:
        return _hf_sample(eager, prompts, steps)


def _demollm_sample(engine: DemoLLM, prompts: torch.Tensor, steps: int) -> rounds.Sample:
    """(median decode step, prefill) in seconds of one demollm generation."""
    run = engine.generate(_requests(prompts), steps + 1, SamplingParams(), seed=0)
    return statistics.median(run.decode_step_s), run.prefill_s


def _requests(prompts: torch.Tensor) -> list[Request]:
    return [Request(i, prompts[i].tolist()) for i in range(prompts.shape[0])]


class _HFCompiled:
    """Hugging Face's own recipe: a static cache and torch.compile of the forward, switched on for
    one sample at a time so that the same model also serves the eager rows. On a GPU, generate
    compiles the forward itself once the cache is static (mode reduce-overhead: CUDA graphs, with the
    output handling that mode needs; compiling the forward here as well nested two compilations and
    failed on a GPU with an output overwritten by a later replay); on CPU it does not, so the
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
            # The last position's logits, as generate's default (logits_to_keep=1) asks, but picked
            # by index: the default's hidden[:, -1:] of a [B, S, K] prefill is a strided view, and
            # F.linear of it with a bfloat16 weight on CPU expands the weight to a batched matmul,
            # B copies (llama4_scout batch 4: +7.7 GiB beside its 15 GiB, the kernel's OOM kill);
            # indexing gives a contiguous [B, 1, K] (+0.01 GiB). Same logits, prefill and decode.
            logits_to_keep=torch.tensor([-1], device=prompts.device),
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
    f_linear: tuple[str, ...] | list[str] = (),
) -> dict:
    """Per runner, same weights and batch, one process: HF eager, HF static cache + torch.compile,
    and demollm with each backend (each of `stepped` again with runtime.lookahead 0, each of
    `without_kernels` again with the canonical ops' reference aten chains on CUDA, and each of
    `f_linear` again with F.linear in place of oneDNN's inner product on CPU). Runners
    take turns, one sample each per round, so that a slow phase of a noisy machine lands on all of
    them, not on whichever ran then; medians over rounds after a warm-up round. A runner that fails
    is a row with its error, not a lost table."""
    with prepared([f"model={name}"], dtype, device) as state:
        runners = _backend_runners(
            state, batch, prompt_len, steps, backends, stepped, without_kernels, f_linear
        )
        rounds_, errors = rounds.take_turns(runners, repeats)
    rows = [
        {"runner": runner, "error": errors[runner]}
        if runner in errors
        else rounds.row(rounds_, runner, reference=HF_EAGER)
        for runner in runners
    ]
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


def _backend_runners(state, batch, prompt_len, steps, backends, stepped, without_kernels, f_linear) -> dict:
    """name -> a sample (decode s, prefill s): HF eager and HF's compile recipe on a copy of the
    eager model, demollm per backend on the prepared one."""
    device = state.device
    # HF's copy: the transforms rewrite eager modules too (onednn_linear's lm_head), and the HF
    # rows must run Hugging Face's model as it is.
    hf_model = copy.deepcopy(state.model)
    engine = engine_of(advance(state, "transforms"))
    text_config = zoo.text_config_of(state.hf_config)
    generator = torch.Generator().manual_seed(0)
    prompts = random_ids((batch, prompt_len), text_config.vocab_size, special_ids(state.hf_config), generator)
    prompts = prompts.to(device)
    demollm = _DemollmSampler(engine, find_graphs(state.model), state.cfg.runtime, prompts, steps)
    hf_compiled = _HFCompiled(hf_model, device)
    lookahead = state.cfg.runtime.lookahead
    return {
        HF_EAGER: lambda: _hf_sample(hf_model, prompts, steps),
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
        # The same backend with F.linear for every linear oneDNN's inner product ran: what the
        # onednn_linear transform is worth.
        **{
            f"demollm {b}, F.linear": (lambda b=b: demollm.sample(b, lookahead, linear=F_LINEAR))
            for b in f_linear
        },
    }


class _DemollmSampler:
    """One demollm sample with a backend put on the graphs for its duration."""

    def __init__(self, engine: DemoLLM, targets, runtime, prompts: torch.Tensor, steps: int):
        self.engine, self.targets, self.runtime, self.steps = engine, targets, runtime, steps
        self.requests = [Request(i, prompts[i].tolist()) for i in range(prompts.shape[0])]
        self.on_cuda = prompts.device.type == "cuda"

    def sample(
        self, backend: str, lookahead: int, kernels: bool = True, linear: dict | None = None
    ) -> tuple[float, float]:
        from pipeline.backends import install

        # Re-applying a compile backend finds Dynamo's cache from the warm-up round: no recompile.
        install.apply(backend, self.targets, self.runtime, BackendConfig(backend), on_cuda=self.on_cuda)
        self.engine.lookahead = lookahead
        try:
            # CUDA graphs are captured in the first generate, with the kernels active then
            with (
                contextlib.nullcontext() if kernels else references_on_cuda(),
                kernels_replaced(linear, "CPU") if linear else contextlib.nullcontext(),
            ):
                self.engine.generate(self.requests, 3, SamplingParams(), seed=0)  # caches warm
                run = self.engine.generate(self.requests, self.steps + 1, SamplingParams(), seed=0)
            return statistics.median(run.decode_step_s), run.prefill_s
        finally:
            install.remove(self.targets)


def _cell(value, digits: int = 2, unit: str = "") -> str:
    """A spread as `median (p10-p90)`; a plain number as it is (GPU rows recorded before rounds,
    in BENCHMARKS.gpu.json, carry one median)."""
    if isinstance(value, dict):
        return rounds.shown(value, digits, unit)
    return f"{value:.{digits}f}{unit}"


def _noisy(row: dict) -> str:
    return "NOISY" if row.get("noisy") else ""


FIGURE_NAMES = {
    "vs_reference": "ratio to HF",
    "pct_of_read": "% of read limit",
    "pct_of_gemv": "% of GEMV pass",
}


def backends_markdown(result: dict, target: str) -> list[str]:
    lines = [
        f"## Decode per backend, `model={result['model']}` ({result['dtype']}, {result['device']}, "
        f"batch {result['batch']}, prompt {result['prompt_len']} tokens)",
        "",
        (
            f"Same weights and batch, one process; the runners take turns, one sample each per round, "
            f"{result['repeats']} rounds after a warm-up round; each cell is the median over rounds with "
            f"p10-p90, the ratio to HF eager taken within each round. Target: {target}."
            if "repeats" in result  # GPU rows recorded before rounds: one median per runner
            else f"Same weights and batch, one process; medians over repeats, recorded before ratios were "
            f"taken per round (no spread). Target: {target}."
        ),
        "",
        "| runner | decode ms/step | x HF eager (per round) | prefill ms | |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['runner']} | failed: {r['error']} | - | - | |")
            continue
        ratio = r.get("vs_reference", r.get("vs_hf_eager"))
        lines.append(
            f"| {r['runner']} | {_cell(r['decode_ms'])} | {_cell(ratio) if ratio is not None else '1.00'} | "
            f"{_cell(r['prefill_ms'], 1)} | {_noisy(r)} |"
        )
    return lines


def _target(result: dict) -> str:
    if any("routed_bytes" in r for r in result["rows"]):
        return (
            "demollm reads only the routed experts (its GB/s and % counts those bytes; HF eager and "
            "demollm all experts read every expert). Target at batch 1: at least 3x faster than "
            "Hugging Face eager and at least 70 % of the read bandwidth."
        )
    return "Target: at least 85 % of the read bandwidth, and never slower than Hugging Face eager."


def label(results: dict, decode: dict) -> str:
    """A decode table's name in comparisons and plots: its dtype, and its model where that is not
    the bench's default model (the MoE rows)."""
    model = "" if decode["model"] == results["model"] else f"{decode['model']} "
    return f"decode {model}{decode['dtype']}"


def _rounds_text(result: dict) -> str:
    processes = result.get("processes", 1)  # results of runs before the rows took several processes: one
    if processes == 1:
        return f"{result['rounds']} rounds after a warm-up round"
    return (
        f"{result['rounds']} rounds, {result['rounds'] // processes} in each of {processes} fresh processes "
        f"after a warm-up round of its own, pooled (a process's own state can set a runner's speed)"
    )


def markdown(result: dict) -> list[str]:
    lines = [
        f"## Decode, `model={result['model']}` ({result['dtype']}, CPU, prompt {result['prompt_len']} tokens)",
        "",
        f"Hugging Face eager `generate` and demollm (uncompiled graph, attention=torch; also with F.linear "
        f"in place of the linear kernel the transforms chose: oneDNN's inner product in float32, the "
        f"bfloat16 GEMV kernel in bfloat16, each at decode sizes only where it was timed faster than "
        f"F.linear for the shape) on the same weights take turns, {_rounds_text(result)}. "
        f"Two limits are measured before and after each "
        f"round's samples, each as long as a sample (a median over repeats), the mean of the two standing "
        f"for the round: the read bandwidth of a 1 GiB float32 buffer (the faster of a reduction and a "
        f"one-row GEMV over it) "
        f"({_cell(result['read_limit_gbs'], 1, ' GB/s')} over the rounds) and the GEMV pass: every "
        f"weight of the step multiplied by a [batch, K] input with demollm's kernel, back to back (per "
        f"batch below). A step reads {result['weight_bytes'] / 1e9:.2f} GB of weights (decoder layers, "
        f"final norm, lm_head); each cell is the median over rounds (p10-p90) of the round's median "
        f"step, and every ratio is taken within a round. {_target(result)} NOISY names a figure whose "
        f"per-round values spread over {rounds.NOISY_ROUND_SPREAD:.2f}x (p90/p10): not a result.",
        "",
        "| batch | runner | ms/step | x HF eager (per round) | % of read limit | % of GEMV pass | |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        for i, runner in enumerate(r["runners"]):
            routed = f"; routed: {r['routed_bytes'] / 1e9:.2f} GB a step" if "routed_bytes" in r else ""
            batch = (
                f"{r['batch']} (GEMV pass {_cell(r['gemv_pass_gbs'], 1, ' GB/s')}{routed})" if i == 0 else ""
            )
            ratio = _cell(runner["vs_reference"]) if "vs_reference" in runner else "1.00"
            noisy = [FIGURE_NAMES[k] for k in runner["noisy_figures"]]
            lines.append(
                f"| {batch} | {runner['runner']} | {_cell(runner['decode_ms'], 1)} | {ratio} | "
                f"{_cell(runner['pct_of_read'], 0, ' %')} | {_cell(runner['pct_of_gemv'], 0, ' %')} | "
                f"{'NOISY: ' + ', '.join(noisy) if noisy else ''} |"
            )
    if result.get("processes", 1) > 1:
        lines += [
            "",
            "Each process's median ms/step, process by process: "
            + "; ".join(
                f"batch {r['batch']} {runner['runner']} {' / '.join(f'{ms:.0f}' for ms in runner['process_ms'])}"
                for r in result["rows"]
                for runner in r["runners"]
            )
            + ".",
        ]
    return lines
