"""Canonical ops: reference implementations equal HF's own functions; fake kernels pass opcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama4.modeling_llama4 import apply_rotary_emb as llama4_rope
from transformers.models.mistral.modeling_mistral import MistralRMSNorm, apply_rotary_pos_emb, repeat_kv

import pipeline.ops  # noqa: F401
from pipeline import kernels

ops = torch.ops.pipeline


def test_attention_is_gqa_sdpa():
    # q: [B, H, S, D]; k, v: [B, Hkv, S, D]
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(ops.attention(q, k, v, mask, 0.3, False, 0.0), expected)
    causal = F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)
    torch.testing.assert_close(ops.attention(q, k, v, None, 0.25, True, 0.0), causal)


def test_softcapped_attention_is_gemma2s_eager_attention():
    """The logit cap as Gemma 2's own eager attention applies it, with its additive mask."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = torch.randn(2, 8, 5, 16) * 3, torch.randn(2, 2, 5, 16) * 3, torch.randn(2, 2, 5, 16)
    additive = torch.zeros(5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    module = SimpleNamespace(num_key_value_groups=4, training=False, head_dim=16)
    expected, _ = eager_attention_forward(module, q, k, v, additive[None, None], scaling=0.3, softcap=2.0)
    out = ops.attention(q, k, v, additive[None, None], 0.3, False, 2.0)
    torch.testing.assert_close(out.transpose(1, 2), expected)  # HF returns [B, S, H, D]
    # the cap changes the result: it is not plain attention
    assert not torch.allclose(out, ops.attention(q, k, v, additive[None, None], 0.3, False, 0.0), atol=1e-3)


def test_rope_is_hf_rotate_half():
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    cos, sin = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ops.rope(q, cos[:, None], sin[:, None]), q_ref)
    torch.testing.assert_close(ops.rope(k, cos[:, None], sin[:, None]), k_ref)


def test_rope_complex_is_llama4s():
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)  # [B, S, H, D]
    freqs = torch.polar(torch.ones(2, 6, 8), torch.randn(2, 6, 8))  # complex [B, S, D/2]
    q_ref, k_ref = llama4_rope(q, k, freqs)
    torch.testing.assert_close(ops.rope_complex(q, freqs[:, :, None]), q_ref)
    torch.testing.assert_close(ops.rope_complex(k, freqs[:, :, None]), k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_rmsnorm(dtype):
    norm = MistralRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 32, dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6), norm(x))
    x32 = x.float()
    torch.testing.assert_close(
        ops.rms_norm(x, None, 1e-6), (x32 * torch.rsqrt(x32.pow(2).mean(-1, True) + 1e-6)).to(dtype)
    )


def test_add_rms_norm_is_the_add_then_the_norm():
    x, residual, weight = torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.randn(32)
    normed, total = ops.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(total, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, ops.rms_norm(x + residual, weight, 1e-6), rtol=0, atol=0)


def test_silu_and_mul_is_the_gated_activation():
    gate_up = torch.randn(3, 5, 64)
    expected = F.silu(gate_up[..., :32]) * gate_up[..., 32:]
    torch.testing.assert_close(ops.silu_and_mul(gate_up), expected, rtol=0, atol=0)


def _llama4_moe(dtype):
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=1
    )
    block = Llama4TextMoe(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block.to(dtype)


@pytest.mark.parametrize("tokens", [1, 4, 24])  # decode batches, and a prefill with every expert hit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_is_llama4s_experts(tokens, dtype):
    """pipeline::moe on the router's own top-k equals Hugging Face's Llama-4 MoE block (all 8
    experts on every token, unrouted ones weighted 0) once its shared expert is added."""
    block = _llama4_moe(dtype)
    x = torch.randn(tokens, 64, dtype=dtype)
    with torch.no_grad():
        expected, router_logits = block(x)
        scores, _ = block.router(x)  # [T, E]: sigmoid of the top-k logits, 0 elsewhere
        selected = torch.topk(router_logits, 1, dim=1).indices  # [T, 1]
        weights = scores.gather(1, selected)
        experts = block.experts
        args = (x, selected, weights, experts.gate_up_proj, experts.down_proj, True, True)
        shared = block.shared_expert(x)
        for routed in (ops.moe(*args), pipeline.ops.moe_reference(*args)):
            out = shared + routed
            if dtype == torch.float32:
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            else:  # HF adds into the shared expert's output in place; same roundings up to GEMM order
                torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [1, 3, 24])
def test_moe_is_mixtrals_experts(tokens):
    """pipeline::moe on Mixtral's router output (top-2 of 8, renormalised) equals its sparse MoE
    block, the routing weights applied to the experts' outputs."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        expected = block(x[None])[0]
        _, weights, selected = block.gate(x)
        args = (x, selected, weights, block.experts.gate_up_proj, block.experts.down_proj, False, False)
        for out in (ops.moe(*args), pipeline.ops.moe_reference(*args)):
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_moe_reads_only_the_routed_experts():
    """Experts no token was routed to may hold anything (NaN here): the routed implementations (the
    Triton kernel in Triton's interpreter without a GPU) never read them; Hugging Face's all-experts
    form (the reference) does."""
    block = _llama4_moe(torch.float32)
    x = torch.randn(2, 64)
    selected, weights = torch.tensor([[3], [5]]), torch.rand(2, 1)
    gate_up, down = block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()
    unrouted = [e for e in range(8) if e not in (3, 5)]
    gate_up[unrouted], down[unrouted] = float("nan"), float("nan")
    args = (x, selected, weights, gate_up, down, True, True)
    assert torch.isfinite(ops.moe(*args)).all() and torch.isfinite(kernels.moe(*args)).all()
    assert not torch.isfinite(pipeline.ops.moe_reference(*args)).all()


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (
            ops.attention.default,
            (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), None, 0.3, True, 0.0),
        ),
        (ops.rope.default, (torch.randn(2, 4, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8))),
        (
            ops.rope_complex.default,
            (torch.randn(2, 5, 4, 8), torch.polar(torch.ones(2, 5, 1, 4), torch.randn(2, 5, 1, 4))),
        ),
        (ops.rms_norm.default, (torch.randn(3, 8), torch.randn(8), 1e-5)),
        (ops.add_rms_norm.default, (torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), 1e-5)),
        (ops.silu_and_mul.default, (torch.randn(3, 16),)),
        (
            ops.moe.default,
            (torch.randn(3, 8), torch.tensor([[0, 2], [1, 2], [3, 0]]), torch.rand(3, 2))
            + (torch.randn(4, 32, 8), torch.randn(4, 8, 16), False, False),
        ),
    ],
    ids=["attention", "rope", "rope_complex", "rms_norm", "add_rms_norm", "silu_and_mul", "moe"],
)
def test_fake_kernels_pass_opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
