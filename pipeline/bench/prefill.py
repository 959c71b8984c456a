"""Prefill: demollm's prefill step at 128 and 1024 tokens, as achieved FLOP/s against a GEMM at the
model's own shapes measured in the same run, and as time against the pass of its own linears.

Why both limits: one GEMM at the MLP's shape is the machine's best rate, the prefill's target; but
a prefill's percent of it drifted by a third within hours while the GEMM held, so the prefill
follows something one large GEMM does not see. The
pass (limits.WeightPass at [tokens, K] over every decoder weight and at [1, K] over the lm_head,
demollm's kernel, the shapes the prefill runs) is measured beside it: the prefill's share of time
in its own linears."""

from __future__ import annotations

import dataclasses
import functools

import torch

from pipeline.bench import rounds
from pipeline.bench.limits import WeightPass
from pipeline.bench.prepare import engine_of, prepared
from pipeline.models import zoo
from pipeline.models.inputs import random_ids, special_ids
from pipeline.models.memory import decoder_and_head
from pipeline.runtime.machine_load import gemm_tflops
from pipeline.runtime.requests import Request, build_requests
from pipeline.runtime.sampling import SamplingParams


def prefill_flops(text_config, tokens: int) -> float:
    """Matmul FLOPs of one prefill of `tokens` tokens: 2 x tokens x the decoder's weight elements,
    plus causal attention (QK^T and PV over half the square) and the lm_head on the last token."""
    hidden, heads = text_config.hidden_size, text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or hidden // heads
    kv_heads = text_config.num_key_value_heads
    inter = text_config.intermediate_size
    per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * inter
    attention = 2 * 2 * heads * head_dim * tokens * tokens / 2  # two matmuls, causal half
    layers = text_config.num_hidden_layers
    return layers * (2 * tokens * per_layer + attention) + 2 * hidden * text_config.vocab_size


def bench_prefill(name: str, token_counts: list[int], repeats: int) -> dict:
    cpu = torch.device("cpu")
    with prepared([f"model={name}"], torch.float32, cpu, "transforms") as state:
        rows = _rows(state, token_counts, repeats)
    return {"model": name, "rows": rows}


def _rows(state, token_counts: list[int], repeats: int) -> list[dict]:
    """Per prompt length: rounds of [limits, one prefill, limits] (rounds.py): the achieved FLOP/s
    as a percent of that round's GEMM, and the pass of the prefill's linears (one pass each side,
    as the prefill is one sample) as a percent of the prefill's time."""
    hf_config, cpu = state.hf_config, state.device
    text_config = zoo.text_config_of(hf_config)
    engine = engine_of(state)
    lm_paths = state.model_info.language_model_paths
    decoder, head = decoder_and_head(state.model, lm_paths[0] if lm_paths else "")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for tokens in token_counts:
        prompt = random_ids((1, tokens), text_config.vocab_size, special_ids(hf_config), generator)[
            0
        ].tolist()
        requests = [Request(0, prompt)]

        def sample(requests=requests) -> rounds.Sample:
            seconds = engine.generate(requests, 1, SamplingParams(), seed=0).prefill_s
            return seconds, seconds

        def limit(tokens=tokens) -> float:
            return gemm_tflops(
                tokens, text_config.hidden_size, text_config.intermediate_size, torch.float32, cpu
            )

        # the decoder's linears on every token, the lm_head on the last one (a GEMV over its
        # 2.7 GB in mistral3's float32: under a tenth of a 128-token prefill)
        passes = [WeightPass(decoder, tokens, repeats=1), WeightPass(head, 1, repeats=1)]

        def linears(passes=passes) -> float:
            return sum(p.seconds() for p in passes)

        rounds_, _ = rounds.take_turns({"prefill": sample}, repeats, {"gemm": limit, "pass": linears})
        flops = prefill_flops(text_config, tokens)
        achieved = [flops / r.samples["prefill"][0] / 1e12 for r in rounds_]
        pct = rounds.spread([100 * a / r.limits["gemm"] for a, r in zip(achieved, rounds_, strict=True)])
        pct_of_pass = rounds.spread([100 * r.limits["pass"] / r.samples["prefill"][0] for r in rounds_])
        rows.append(
            {
                "tokens": tokens,
                "prefill_ms": rounds.spread([1000 * r.samples["prefill"][0] for r in rounds_]),
                "tflops": rounds.spread(achieved),
                "gemm_tflops": rounds.spread([r.limits["gemm"] for r in rounds_]),
                "pct_of_gemm": pct,
                "pass_ms": rounds.spread([1000 * r.limits["pass"] for r in rounds_]),
                "pct_of_pass": pct_of_pass,
                "noisy": rounds.is_noisy(pct) or rounds.is_noisy(pct_of_pass),
            }  # fmt: skip
        )
    return rows


def markdown(result: dict) -> list[str]:
    with_pass = all("pct_of_pass" in r for r in result["rows"])  # older records have no pass
    lines = [
        f"## Prefill, `model={result['model']}` (float32, CPU, batch 1, demollm torch-simple)",
        "",
        "Achieved = matmul FLOPs of the step (projections, MLP, causal attention, lm_head on the last "
        "token) / step time; limit = one GEMM [tokens, hidden] x [hidden, intermediate] measured before "
        "and after each round's prefill, the faster of ATen's matmul and oneDNN's inner product; the "
        "percent is taken within each round. Median over rounds (p10-p90). Target: at least 70 %."
        + (
            " Linears' pass = every decoder weight multiplied by a [tokens, K] input and the lm_head by "
            "one row, with demollm's kernel, back to back, before and after the prefill: % of pass = pass time / prefill time, "
            "the share of the step its own linears take when nothing else runs."
            if with_pass
            else ""
        )
        # a block taken over from a part run (`--rows prefill`) says when and where
        + (f" Measured {result['measured']}." if "measured" in result else ""),
        "",
        "| tokens | prefill ms | achieved TFLOP/s | GEMM TFLOP/s | % of GEMM |"
        + (" linears' pass ms | % of pass |" if with_pass else "")
        + " |",
        "|---|---|---|---|---|" + ("---|---|" if with_pass else "") + "---|",
    ]
    lines += [
        f"| {r['tokens']} | {rounds.shown(r['prefill_ms'], 1)} | {rounds.shown(r['tflops'], 3)} | "
        f"{rounds.shown(r['gemm_tflops'], 3)} | {rounds.shown(r['pct_of_gemm'], 0, ' %')} | "
        + (
            f"{rounds.shown(r['pass_ms'], 1)} | {rounds.shown(r['pct_of_pass'], 0, ' %')} | "
            if with_pass
            else ""
        )
        + f"{'NOISY' if r['noisy'] else ''} |"
        for r in result["rows"]
    ]
    return lines


PIECEWISE_MODES = ("uncaptured", "compiled", "piecewise")


def bench_piecewise_prefill(
    name: str, token_counts: list[int], repeats: int, device: torch.device, dtype: torch.dtype
) -> dict:
    """Time to first token of one request of the workload (an image request for a VLM) at each
    prompt length, three ways in each round: the graph uncaptured, the whole graph compiled (its
    prefill is never replayed), and backend.piecewise=true (CPU: torch-compile's segments; GPU:
    torch-opt's, replayed per token bucket). Ratios within rounds."""
    from pipeline.backend_specs import AUTO_CPU, AUTO_CUDA
    from pipeline.backends import install
    from pipeline.backends.cudagraph import pick_bucket
    from pipeline.graphs import cached_graphs

    backend = AUTO_CUDA if device.type == "cuda" else AUTO_CPU
    overrides = [f"model={name}", f"backend={backend}", "backend.piecewise=true", "prompt.batch_size=1"]
    with prepared(overrides, dtype, device, "transforms") as state:
        graph_name, graph = cached_graphs(state.model)[0]
        install.apply(
            backend, [(graph_name, graph)], state.cfg.runtime, state.cfg.backend, device.type == "cuda"
        )
        runner = graph.piecewise_runner
        whole = graph.cuda_graph_runner.forward_fn if device.type == "cuda" else runner.full_fn
        forwards = {
            "uncaptured": type(graph).forward.__get__(graph),
            "compiled": whole,
            "piecewise": graph.forward,
        }
        engine = engine_of(state)
        rows = []
        for tokens in token_counts:
            prompt = dataclasses.replace(state.cfg.prompt, prompt_len=tokens)
            requests = build_requests(
                prompt, state.cfg.runtime, state.cfg.seed, state.hf_config, dtype, device, state.sources
            )

            def sample(mode: str, requests=requests) -> rounds.Sample:
                graph.forward = forwards[mode]
                seconds = engine.generate(requests, 1, SamplingParams(), seed=0).prefill_s
                return seconds, seconds

            runners = {mode: functools.partial(sample, mode) for mode in PIECEWISE_MODES}
            rounds_, _ = rounds.take_turns(runners, repeats)
            graph.forward = forwards["piecewise"]
            ms = {
                mode: rounds.spread([1000 * r.samples[mode][0] for r in rounds_]) for mode in PIECEWISE_MODES
            }
            ratios = {
                other: rounds.spread([r.samples["piecewise"][0] / r.samples[other][0] for r in rounds_])
                for other in ("uncaptured", "compiled")
            }
            total = len(requests[0].prompt)
            rows.append(
                {
                    "tokens": total,
                    "bucket": pick_bucket(total, runner.buckets),
                    "ms": ms,
                    "piecewise_over": ratios,
                    "noisy": any(rounds.is_noisy(r) for r in ratios.values()),
                }
            )
    return {"model": name, "backend": backend, "device": device.type, "rows": rows}


def piecewise_markdown(result: dict) -> list[str]:
    lines = [
        f"## Piecewise prefill, `model={result['model']}` ({result['device']}, batch 1, time to first token)",
        "",
        f"One request of the workload (with its image for a VLM): the language model uncaptured, compiled "
        f"whole ({result['backend']} without piecewise: its prefill is never replayed), and with "
        "`backend.piecewise=true` (the prompt padded to its token bucket). Median over rounds "
        "(p10-p90); ratios taken within each round."
        + (f" Measured {result['measured']}." if "measured" in result else ""),
        "",
        "| tokens | bucket | uncaptured ms | compiled ms | piecewise ms | piecewise / uncaptured | piecewise / compiled | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['tokens']} | {r['bucket']} | {rounds.shown(r['ms']['uncaptured'], 1)} | "
        f"{rounds.shown(r['ms']['compiled'], 1)} | {rounds.shown(r['ms']['piecewise'], 1)} | "
        f"{rounds.shown(r['piecewise_over']['uncaptured'], 2)} | {rounds.shown(r['piecewise_over']['compiled'], 2)} | "
        f"{'NOISY' if r['noisy'] else ''} |"
        for r in result["rows"]
    ]
    return lines
