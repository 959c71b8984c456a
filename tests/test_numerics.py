"""Per-layer numerics: each part of the captured model against Hugging Face's eager model, and the
first part past tolerance named when a rewrite breaks one layer."""

from __future__ import annotations

import inspect
import json
import operator

import pytest
import torch
from conftest import staged

from pipeline.graphs import find_graphs
from pipeline.profiler.ranges import node_stack
from pipeline.report.run_report import headline
from pipeline.runner import run_stage
from pipeline.state import StageRecord

QUIET = ["profile.enabled=false", "report.enabled=false", "tracking.enabled=false"]


def _record(state, name: str):
    return next(r for r in state.stages if r.name == name)


def test_the_reference_parts_are_hugging_faces_hidden_states():
    """The eager outputs each layer is compared with are the hidden states Hugging Face's own
    forward returns (output_hidden_states: the embedding, then each layer but the last, whose
    output HF gives after the final norm)."""
    with staged(["model=tiny_llama3_1_8b", *QUIET], "export") as state:
        reference = state.reference
        call = state.check_calls["text"]
        layers = [p for p in reference.part_order if ".layers." in p]
        assert layers == ["model.layers.0", "model.layers.1"] and reference.part_order[-1] == "lm_head"
        from pipeline.graphs import eager_graphs

        with eager_graphs(state.model) as eager, torch.no_grad():
            hidden = eager(**call, output_hidden_states=True).hidden_states
        torch.testing.assert_close(
            reference.parts["text"]["model.layers.0"], hidden[1].float(), rtol=0, atol=0
        )
        # The decode step's too: Hugging Face's forward on the prompt, then on its greedy token with
        # the cache that forward returned (the cache kwarg as the forward names it)
        decode = reference.decode
        cache_kwarg = (
            "cache"
            if "cache" in inspect.signature(type(state.model).forward).parameters
            else "past_key_values"
        )
        with eager_graphs(state.model) as eager, torch.no_grad():
            prefill = eager(input_ids=torch.tensor([decode.prompt]), use_cache=True)
            assert decode.tokens[0] == int(prefill.logits[0, -1].argmax())
            cache = getattr(prefill, cache_kwarg, None) or prefill.past_key_values
            step = eager(
                input_ids=torch.tensor([[decode.tokens[0]]]),
                use_cache=True,
                output_hidden_states=True,
                **{cache_kwarg: cache},
            )
        torch.testing.assert_close(
            decode.parts["model.layers.0"], step.hidden_states[1].float(), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            decode.parts["lm_head"][:, -1], step.logits[:, -1].float(), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("backend", ["torch-simple", pytest.param("torch-compile", marks=pytest.mark.slow)])
def test_every_part_of_the_captured_model_is_within_tolerance(backend):
    overrides = ["model=tiny_mistral3", f"backend={backend}", *QUIET]
    with staged(overrides, "numerics") as state:
        numerics = _record(state, "numerics")
        assert numerics.metrics["numerics/parts_past_tolerance"] == 0
        assert "numerics_first_drift" not in numerics.tags
        for key in ("vision_tower", "projector", "layer_0", "layer_1", "lm_head"):
            assert numerics.metrics[f"numerics/{key}_max_abs_err"] < 1e-3, key
        assert not any("not readable" in note for note in numerics.notes)
        assert (state.run_dir / "numerics" / "depth.png").stat().st_size > 0
        # A decode step of the program generation runs, against eager's at the same step
        assert numerics.metrics["numerics/decode_parts_past_tolerance"] == 0
        decode = json.loads((state.run_dir / "numerics" / "numerics.json").read_text())["decode"]
        read = {row["part"] for row in decode if row["max_abs"] is not None}
        assert {"model.language_model.layers.0", "model.language_model.layers.1", "lm_head"} <= read
        assert state.reference.decode.parts["lm_head"].shape[:2] == (1, 1)  # one token's logits
        assert any(
            line.startswith("numerics: decode step: all 3 parts within tolerance 1e-04")
            for line in headline(state)
        )
        # kept for the profile's per-layer table, both phases, in forward order
        assert [e.part for e in state.part_errors["prefill"]] == state.reference.part_order
        assert {e.part for e in state.part_errors["decode"] if e.max_abs is not None} == read
        assert not any("recompiles" in line for line in headline(state))
        state.stages.append(StageRecord("generate", "done", 1.0, metrics={"capture/recompiles": 2}))
        assert "WARNING 2 recompiles during generation" in "\n".join(headline(state))


def _flip_rope_sign(gm, layer: str) -> int:
    """A wrong rewrite in one layer only: its RoPE rotates the other way (sin negated)."""
    flipped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.pipeline.rope.default:
            continue
        if not any(path == layer or path.startswith(layer + ".") for _, path, _ in node_stack(node) or []):
            continue
        with gm.graph.inserting_before(node):
            negated = gm.graph.call_function(operator.neg, (node.args[2],))
        node.args = (node.args[0], node.args[1], negated)
        flipped += 1
    gm.recompile()
    return flipped


@pytest.mark.parametrize("backend", ["torch-simple", pytest.param("torch-compile", marks=pytest.mark.slow)])
def test_a_wrong_rewrite_in_one_layer_is_named(backend):
    overrides = ["model=tiny_llama3_1_8b", f"backend={backend}", *QUIET]
    with staged(overrides, "capture") as state:
        ((_, graph),) = find_graphs(state.model)
        assert _flip_rope_sign(graph, "model.layers.1") == 2  # q and k
        run_stage(state, "numerics")
        numerics = _record(state, "numerics")
        assert numerics.tags["numerics_first_drift"] == "model.layers.1"
        assert numerics.tags["numerics_first_drift_decode"] == "model.layers.1"
        assert numerics.metrics["numerics/layer_0_max_abs_err"] < 1e-4
        assert numerics.metrics["numerics/layer_1_max_abs_err"] > 1e-2
        assert numerics.notes[0].startswith("!!! first part past tolerance: model.layers.1")
