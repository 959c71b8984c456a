"""The weight bytes a decode step reads when each mixture-of-experts layer reads only the experts its
tokens were routed to (pipeline::moe), counted on a generation: a decode step's read rate divided
by every expert's bytes would report Llama-4 Scout's 16-expert layers well above the memory
bandwidth."""

from __future__ import annotations

import statistics

import torch

from pipeline import kernels
from pipeline.library import REFERENCES, kernels_replaced
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams


def routed_decode_bytes(
    engine: DemoLLM, requests: list[Request], max_new_tokens: int, weight_bytes: int, device: torch.device
) -> float | None:
    """`weight_bytes` (every expert) less, per pipeline::moe call of a decode step, the bytes of the
    experts none of the step's tokens went to; the mean over the decode steps of one untimed greedy
    generation of `requests`. None when no decode step called the op eagerly (a CUDA graph replays
    its kernels without calling it, so there is nothing to count)."""
    # the registered implementation of the device (the reference where CUDA has no Triton): the
    # calls run as they do in the timed runs
    routed_moe = (kernels.moe if device.type == "cuda" else None) or REFERENCES["moe"]
    unread_in_step: list[int] = []  # per moe call of the running step
    unread_per_decode: list[int] = []  # per decode step that called the op

    def counting(x, selected, weights, gate_up, down, transposed, weights_on_input):
        # selected: [T, k] expert ids of this step's T tokens; gate_up: [E, ...], down: [E, ...]
        expert_bytes = gate_up[0].nbytes + down[0].nbytes
        unread_in_step.append((gate_up.shape[0] - selected.unique().numel()) * expert_bytes)
        return routed_moe(x, selected, weights, gate_up, down, transposed, weights_on_input)

    def after_step(kind: str) -> None:
        # after_step also turns running ahead off, so the calls since the last step are this step's
        if kind == "decode" and unread_in_step:
            unread_per_decode.append(sum(unread_in_step))
        unread_in_step.clear()

    with kernels_replaced({"moe": counting}, "CUDA" if device.type == "cuda" else "CPU"):
        engine.generate(requests, max_new_tokens, SamplingParams(), seed=0, after_step=after_step)
    if not unread_per_decode:
        return None
    return weight_bytes - statistics.mean(unread_per_decode)
