"""match_rmsnorm: graph norms become pipeline::rms_norm; at scope model the eager *RMSNorm modules
outside the graphs call the same op."""

from __future__ import annotations

from transform_helpers import assert_same, captured, run


def test_model_scope_rmsnorm_swaps_eager_modules():
    model, calls, reference = captured("tiny_mistral3")
    history = run(model, ["transforms=none", "+transforms.match_rmsnorm={scope: model}"])
    # The eager parts only (the language model is the graph): Pixtral's ln_pre + 2 per vision
    # layer, and the projector's norm.
    assert history.matches("match_rmsnorm") == 3 + 1
    assert not any(
        type(m).__name__.endswith("RMSNorm") and type(m).__name__ != "CanonicalRMSNorm"
        for m in model.modules()
    )
    assert_same(model, calls, reference)
