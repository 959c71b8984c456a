"""The logits check: tolerance, and MoE tokens whose eager routing was a near-tie."""

from __future__ import annotations

import torch
from conftest import build_tiny
from torch import nn

from pipeline import correctness
from pipeline.state import Reference, RunState, StageResult


def test_near_ties_are_margins_of_a_few_ulps():
    # bfloat16 router logits around 1.5: one ULP there is 2**-7 = 0.0078.
    logits = torch.tensor(
        [[1.5, 1.5078125, 0.0, -1.0], [1.5, 1.25, 0.0, -1.0], [2.0, 1.0, 1.984375, 0.0]], dtype=torch.bfloat16
    )
    assert correctness._near_ties(logits, top_k=1).tolist() == [True, False, True]
    # top-2: the margin that decides is between the 2nd and 3rd largest
    assert correctness._near_ties(logits, top_k=2).tolist() == [False, False, False]


class _Shifted(nn.Module):
    """Returns the reference logits with one token's row moved by `delta`."""

    def __init__(self, reference: torch.Tensor, token: int, delta: float):
        super().__init__()
        self.out = reference.clone()
        self.out[0, token] += delta

    def forward(self, **_):
        return (self.out,)


def _state(reference: torch.Tensor, near: torch.Tensor, model: nn.Module) -> RunState:
    state = RunState(
        cfg=None, run_dir=None, device=torch.device("cpu"), dtype=torch.bfloat16, backend="", attention=""
    )
    state.check_calls = {"text": {}}
    state.reference = Reference({"text": reference}, {"text": near})
    state.model = model
    return state


def test_a_flip_at_a_near_tie_is_counted_not_failed_and_elsewhere_fails():
    reference = torch.randn(1, 6, 32)
    near = torch.tensor([[False, False, True, False, False, False]])
    result = StageResult()
    checks = correctness.check(_state(reference, near, _Shifted(reference, 2, 5.0)), "capture", result)
    assert correctness.failure(checks) is None and checks[0].router_flips == 1
    assert checks[0].max_abs_err == 0.0
    assert result.metrics["correctness/capture/text_router_flips"] == 1
    assert "expert choice flipped" in result.notes[0]
    checks = correctness.check(_state(reference, near, _Shifted(reference, 3, 5.0)), "capture", StageResult())
    assert "differs from eager on the text call" in correctness.failure(checks)
    assert checks[0].router_flips == 0


def test_masked_logits_set_no_tolerance_and_must_stay_masked():
    """A model that masks logits at the dtype's minimum (or -inf): the tolerance comes from the
    values, not the masks (a bound of 3.4e34 could not fail), a small change of the values still
    fails, and a logit masked on one side only is a failure."""
    reference = torch.randn(1, 6, 32)
    reference[..., 20:] = torch.finfo(torch.float32).min
    reference[0, 0, 19] = float("-inf")
    near = torch.zeros(1, 6, dtype=torch.bool)
    assert correctness.tolerance(reference, torch.bfloat16) < 1.0
    same = correctness.check(_state(reference, near, _Shifted(reference, 1, 0.0)), "capture", StageResult())
    assert correctness.failure(same) is None and same[0].max_abs_err == 0.0
    moved = correctness.check(_state(reference, near, _Shifted(reference, 1, 0.5)), "capture", StageResult())
    assert "differs from eager" in correctness.failure(moved)
    unmasked = _Shifted(reference, 0, 0.0)
    unmasked.out[0, 0, 25] = 0.0
    checks = correctness.check(_state(reference, near, unmasked), "capture", StageResult())
    assert checks[0].max_abs_err == float("inf") and correctness.failure(checks)


def test_reference_records_the_routers_of_a_moe_model():
    model, hf_config, examples = build_tiny("tiny_llama4_scout")
    assert (
        len(correctness._routers(model, hf_config.text_config)) == hf_config.text_config.num_hidden_layers
    )  # MoE in every layer
    reference = correctness.reference_outputs(model, {"text": examples.text})
    assert reference.router_near_ties["text"].shape == reference.logits["text"].shape[:-1]
    dense, dense_config, dense_examples = build_tiny("tiny_mistral3")
    assert correctness._routers(dense, dense_config.text_config) == []
    assert (
        not correctness.reference_outputs(dense, {"text": dense_examples.text}).router_near_ties["text"].any()
    )
