"""Canonical ops: reference implementations equal HF's own functions; fake kernels pass opcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama4.modeling_llama4 import apply_rotary_emb as llama4_rope
from transformers.models.mistral.modeling_mistral import MistralRMSNorm, apply_rotary_pos_emb, repeat_kv

import pipeline.ops  # noqa: F401

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
    ],
    ids=["attention", "rope", "rope_complex", "rms_norm", "add_rms_norm", "silu_and_mul"],
)
def test_fake_kernels_pass_opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
