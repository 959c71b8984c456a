"""Prefill: demollm's prefill step at 128 and 1024 tokens, as achieved FLOP/s against a GEMM at the
model's own shapes measured in the same run."""

from __future__ import annotations

import torch

from pipeline.bench import rounds
from pipeline.bench.limits import gemm_tflops
from pipeline.bench.prepare import engine_of, prepared
from pipeline.models import zoo
from pipeline.models.inputs import random_ids, special_ids
from pipeline.runtime.requests import Request
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
    with prepared([f"model={name}"], torch.float32, cpu, ("load", "export", "transforms")) as state:
        rows = _rows(state, token_counts, repeats)
    return {"model": name, "rows": rows}


def _rows(state, token_counts: list[int], repeats: int) -> list[dict]:
    """Per prompt length: rounds of [GEMM limit, one prefill, GEMM limit] (rounds.py), the
    achieved FLOP/s as a percent of that round's limit."""
    hf_config, cpu = state.hf_config, state.device
    text_config = zoo.text_config_of(hf_config)
    engine = engine_of(state)
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

        rounds_, _ = rounds.take_turns({"prefill": sample}, repeats, {"gemm": limit})
        flops = prefill_flops(text_config, tokens)
        achieved = [flops / r.samples["prefill"][0] / 1e12 for r in rounds_]
        pct = rounds.spread([100 * a / r.limits["gemm"] for a, r in zip(achieved, rounds_, strict=True)])
        rows.append(
            {
                "tokens": tokens,
                "prefill_ms": rounds.spread([1000 * r.samples["prefill"][0] for r in rounds_]),
                "tflops": rounds.spread(achieved),
                "gemm_tflops": rounds.spread([r.limits["gemm"] for r in rounds_]),
                "pct_of_gemm": pct,
                "noisy": rounds.is_noisy(pct),
            }  # fmt: skip
        )
    return rows


def markdown(result: dict) -> list[str]:
    lines = [
        f"## Prefill, `model={result['model']}` (float32, CPU, batch 1, demollm torch-simple)",
        "",
        "Achieved = matmul FLOPs of the step (projections, MLP, causal attention, lm_head on the last "
        "token) / step time; limit = one GEMM [tokens, hidden] x [hidden, intermediate] measured before "
        "and after each round's prefill, the faster of ATen's matmul and oneDNN's inner product; the "
        "percent is taken within each round. Median over rounds (p10-p90). Target: at least 70 %.",
        "",
        "| tokens | prefill ms | achieved TFLOP/s | GEMM TFLOP/s | % of GEMM | |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['tokens']} | {rounds.shown(r['prefill_ms'], 1)} | {rounds.shown(r['tflops'], 3)} | "
        f"{rounds.shown(r['gemm_tflops'], 3)} | {rounds.shown(r['pct_of_gemm'], 0, ' %')} | "
        f"{'NOISY' if r['noisy'] else ''} |"
        for r in result["rows"]
    ]
    return lines
