"""Canonical ops: what the matchers rewrite HF's many spellings into, registered with torch.library.

Registered ops (pipeline/library.py) keep their names and input shapes in the profiler and survive
export and compile.
Each has a reference implementation that runs on CPU (and GPU) and a fake kernel for tracing;
rms_norm, add_rms_norm, rope and silu_and_mul run as one Triton kernel each on CUDA
(pipeline/kernels).
Layouts are explicit in the signatures; shapes are noted as [B, H, S, D] = batch, heads, sequence,
head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline import kernels
from pipeline.kernels import cpu_gemv, linear_choice
from pipeline.library import fake, op


@op("attention")
def attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: float, is_causal: bool, softcap: float
) -> Tensor:
    """Softmax(cap(q k^T * scale) + mask) v with grouped-query heads.

    q: [B, H, S, D]; k, v: [B, Hkv, S_kv, D] with H % Hkv == 0 (not repeated: a GQA-aware kernel
    reads each KV head once); attn_mask: bool (True = attend) or additive, broadcastable to
    [B, H, S, S_kv]; softcap: 0, or the cap of the scaled scores, `tanh(s / cap) * cap` (Gemma 2's
    attention logit soft-capping), before the mask; returns [B, H, S, D].
    """
    if softcap > 0:
        return softcapped_reference(q, k, v, attn_mask, scale, is_causal, softcap).contiguous()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.contiguous()  # the fake kernel promises a contiguous result (compile checks strides)


def softcapped_reference(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: float, is_causal: bool, softcap: float
) -> Tensor:
    """Hugging Face's eager attention with a logit cap, step by step (SDPA has no cap): scores
    capped, mask added (or applied), softmax in float32, cast back."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, S_kv, D]
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap  # [B, H, S, S_kv]
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(
            scores.shape[-1] - scores.shape[-2]
        )
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask
        )
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


@fake("attention")
def _attention_fake(q, k, v, attn_mask, scale, is_causal, softcap):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@op("rope", cuda=kernels.rope)
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, rotate-half form: x * cos + rotate_half(x) * sin.

    x: [B, H, S, D]; cos, sin: broadcastable to x (HF passes [B, 1, S, D]). The llama3-scaled and
    the multimodal (Qwen2.5-VL mrope) variants differ only in how cos/sin were computed.
    """
    return rope_reference(x, cos, sin).contiguous()


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """pipeline::rope in plain aten ops (what Inductor compiles it as; see backends/compile.py)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@fake("rope")
def _rope_fake(x, cos, sin):
    return x.new_empty(torch.broadcast_shapes(x.shape, cos.shape), dtype=torch.result_type(x, cos))


@op("rope_complex")
def rope_complex(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotary embedding on interleaved (real, imag) pairs, as Llama-4 computes it.

    x: [B, S, H, D]; freqs_cis: complex [B, S, 1, D/2] (broadcast over heads); returns x's dtype.
    """
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis).flatten(-2).to(x.dtype).contiguous()


@fake("rope_complex")
def _rope_complex_fake(x, freqs_cis):
    return x.new_empty(x.shape)


@op("rms_norm", cuda=kernels.rms_norm)
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32 as HF does: weight * (x / rms(x)).to(x.dtype).

    x: [..., D]; weight: [D] or None (Llama-4's QK-norm has none).
    """
    return rms_norm_reference(x, weight, eps).contiguous()


def rms_norm_reference(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """pipeline::rms_norm in plain aten ops (what Inductor compiles it as; see backends/compile.py)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


@fake("rms_norm")
def _rms_norm_fake(x, weight, eps):
    dtype = x.dtype if weight is None else torch.result_type(weight, x)
    return x.new_empty(x.shape, dtype=dtype)


@op("add_rms_norm", cuda=kernels.add_rms_norm)
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the RMSNorm after it: (rms_norm(x + residual), x + residual).

    x, residual: [..., D] of one shape and dtype (the decoder layer's output and its residual
    stream); the sum is also returned, since the next residual add reads it.
    """
    normed, total = add_rms_norm_reference(x, residual, weight, eps)
    return normed.contiguous(), total.contiguous()


def add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """pipeline::add_rms_norm in plain aten ops (what Inductor compiles it as)."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


@fake("add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps):
    total = x.new_empty(x.shape, dtype=torch.result_type(x, residual))
    return _rms_norm_fake(total, weight, eps), total


@op("silu_and_mul", cuda=kernels.silu_and_mul)
def silu_and_mul(x: Tensor) -> Tensor:
    """The gated MLP's activation on its fused gate/up projection: silu(gate) * up.

    x: [..., 2 * I], gate then up on the last dim; returns [..., I]. The product is written into
    silu's fresh output: one [..., I] allocation instead of two (at 1024 tokens of mistral3 each is
    128 MiB float32).
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """pipeline::silu_and_mul in plain aten ops (what Inductor compiles it as)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@fake("silu_and_mul")
def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@op("onednn_linear")
def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight^T + bias through oneDNN's inner product on CPU (float32, bfloat16), or through
    F.linear for a decode-size call where F.linear was timed faster on this host (linear_choice.py).

    x: [..., K]; weight: [N, K] as nn.Linear stores it; bias: [N] or None; returns [..., N].
    Same result as F.linear up to accumulation order; the point is speed: this build's F.linear
    goes to MKL, which on some hosts reads a [N, K] weight at a third of the memory bandwidth at
    decode sizes and runs prefill GEMMs at half oneDNN's rate (see onednn_linear.py).
    """
    if x.numel() == 0:
        return F.linear(x, weight, bias)
    candidates = (
        lambda: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""),
        lambda: F.linear(x, weight, bias),
    )
    n = linear_choice.rows(x)
    if n > linear_choice.DECODE_ROWS:
        return candidates[0]()
    return candidates[linear_choice.fastest(("onednn_linear", x.dtype, n, *weight.shape), candidates)]()


@fake("onednn_linear")
def _onednn_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@op("bf16_linear")
def bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight^T + bias for bfloat16 on CPU through the GEMV kernel (kernels/cpu_gemv.py) where it
    takes x (decode-size calls) and was timed faster than F.linear on this host for the shape
    (linear_choice.py), other tensors through F.linear.

    x: [..., K]; weight: [N, K]; bias: [N] or None; returns [..., N]. Same result as F.linear up to
    the float32 summation order.
    """
    if not cpu_gemv.applies(x, weight):
        return F.linear(x, weight, bias)

    def kernel() -> Tensor:
        out = cpu_gemv.gemv(x, weight)
        return out if bias is None else out + bias

    candidates = (kernel, lambda: F.linear(x, weight, bias))
    key = ("bf16_linear", x.dtype, linear_choice.rows(x), *weight.shape)
    return candidates[linear_choice.fastest(key, candidates)]()


@fake("bf16_linear")
def _bf16_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@op("moe", cuda=kernels.moe)
def moe(
    x: Tensor,
    selected: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    transposed: bool,
    weights_on_input: bool,
) -> Tensor:
    """The routed experts of a mixture-of-experts layer (gated SiLU MLPs), reading only the experts
    the tokens were routed to: tokens are grouped by expert id, and each expert hit runs its two
    GEMMs on its tokens (one row at decode), so a decode step reads k of the E experts' weights.

    x: [T, H]; selected: [T, k] expert ids; weights: [T, k] routing weights (any float dtype);
    gate_up: [E, 2I, H] (nn.Linear layout) or, `transposed`, [E, H, 2I]; down: [E, H, I] or,
    `transposed`, [E, I, H]; gate then up on the 2I dim. `weights_on_input`: the expert runs on
    x * weight (Llama-4), else its output is weighted (Mixtral, Qwen3-MoE). Returns [T, H], the sum
    over each token's k experts; a router, a shared expert and the residual stay the model's own.
    The expert ids are read on the host (one sync), so CUDA graphs cannot capture this
    implementation; on CUDA the Triton kernel (kernels/triton_moe.py) reads nothing on the host.
    """
    tokens, k = selected.shape
    flat = selected.reshape(-1)  # [T*k], token t's j-th expert at t*k + j
    order = flat.argsort(stable=True)  # [T*k], grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = torch.zeros_like(x, dtype=torch.float32)  # [T, H], summed in float32 as HF's experts do
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = order[start : start + count]  # [n] positions in flat
        start += count
        token = rows // k  # [n]
        weight = weights.reshape(-1)[rows].unsqueeze(-1)  # [n, 1]
        h = x[token] * weight.to(x.dtype) if weights_on_input else x[token]  # [n, H]
        y = _expert_mlp(h, gate_up[expert], down[expert], transposed, _expert_gemv).float()  # [n, H]
        out.index_add_(0, token, y if weights_on_input else y * weight.float())
    return out.to(x.dtype)


def _expert_linear(h: Tensor, weight: Tensor, transposed: bool) -> Tensor:
    """h: [n, K]; weight: [N, K] or, `transposed`, [K, N] -> [n, N]."""
    return h @ weight if transposed else F.linear(h, weight)


def _expert_gemv(h: Tensor, weight: Tensor, transposed: bool) -> Tensor:
    """_expert_linear through the linear ops the transforms route to: an expert in the nn.Linear
    layout (Mixtral, Qwen3-MoE) on CPU runs pipeline::onednn_linear in float32 (F.linear's MKL GEMM
    reads it at a third of the bandwidth on some hosts) and pipeline::bf16_linear in bfloat16 (the
    GEMV kernel); Llama-4's [K, N] experts in bfloat16 take the kernel's [K, N] GEMV where PyTorch
    has no oneDNN bf16 matmul (ATen's fallback reads them so slowly that it is not even timed), and
    where it has, whichever of the two was timed faster for the shape (linear_choice.py)."""
    on_cpu = h.device.type == "cpu" and h.dtype == weight.dtype
    if on_cpu and transposed and cpu_gemv.applies(h, weight):
        if not cpu_gemv.onednn_bf16():
            return cpu_gemv.gemv_kn(h, weight)
        candidates = (lambda: cpu_gemv.gemv_kn(h, weight), lambda: h @ weight)
        key = ("moe_kn", h.dtype, linear_choice.rows(h), *weight.shape)
        return candidates[linear_choice.fastest(key, candidates)]()
    if on_cpu and not transposed and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return onednn_linear(h, weight, None)
    if on_cpu and not transposed and weight.dtype == torch.bfloat16:
        return bf16_linear(h, weight, None)
    return _expert_linear(h, weight, transposed)


def _expert_mlp(h: Tensor, gate_up: Tensor, down: Tensor, transposed: bool, linear=_expert_linear) -> Tensor:
    """One expert's silu(h Wg) * (h Wu) Wd. h: [n, H]; gate_up: [2I, H] or [H, 2I]; down: [H, I] or [I, H]."""
    projected = linear(h, gate_up, transposed)  # [n, 2I]
    gate, up = projected.chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down, transposed)


def moe_reference(
    x: Tensor,
    selected: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    transposed: bool,
    weights_on_input: bool,
) -> Tensor:
    """pipeline::moe as Hugging Face's Llama-4 computes it: every expert on every token, with a
    zero routing weight where the token was not routed, reading all E experts' weights."""
    experts = gate_up.shape[0]
    # functional (no in-place op), so that it can also serve as an Inductor decomposition (measured
    # as one: backends/compile.py)
    dense = torch.zeros(x.shape[0], experts, dtype=weights.dtype, device=x.device).scatter(
        1, selected, weights
    )
    out = torch.zeros_like(x, dtype=torch.float32)  # [T, H]
    for expert in range(experts):
        weight = dense[:, expert : expert + 1]  # [T, 1]
        h = x * weight.to(x.dtype) if weights_on_input else x
        y = _expert_mlp(h, gate_up[expert], down[expert], transposed).float()
        out = out + (y if weights_on_input else y * weight.float())
    return out.to(x.dtype)


@fake("moe")
def _moe_fake(x, selected, weights, gate_up, down, transposed, weights_on_input):
    return x.new_empty(x.shape)
