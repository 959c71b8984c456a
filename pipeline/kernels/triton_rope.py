"""`pipeline::rope` on CUDA: rotate-half RoPE, one program per (batch, head, position) row.

x is read through its strides (HF's q and k are transposed views), cos and sin through broadcast
strides (HF passes [B, 1, S, D]), so nothing is copied or expanded in memory. Products and the sum
are rounded to the result dtype one by one, as the aten chain `x * cos + rotate_half(x) * sin` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def _rope_kernel(
    X,
    COS,
    SIN,
    OUT,
    H,
    S,
    sx_b,
    sx_h,
    sx_s,
    sc_b,
    sc_h,
    sc_s,
    ss_b,
    ss_h,
    ss_s,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # x: [B, H, S, D], cos/sin: broadcast to [B, H, S, D] (stride 0 where broadcast), all with a
    # unit last stride; out: [B, H, S, D] contiguous. D = 2 * HALF.
    row = tl.program_id(0)
    s = row % S
    h = (row // S) % H
    b = row // (S * H)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    x_row = X + b * sx_b + h * sx_h + s * sx_s
    cos_row = COS + b * sc_b + h * sc_h + s * sc_s
    sin_row = SIN + b * ss_b + h * ss_h + s * ss_s
    x1 = tl.load(x_row + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + i, mask=mask, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    # rotate_half(x) = cat(-x2, x1)
    first = _round(x1 * tl.load(cos_row + i, mask=mask, other=0.0).to(tl.float32), dtype) + _round(
        -x2 * tl.load(sin_row + i, mask=mask, other=0.0).to(tl.float32), dtype
    )
    second = _round(x2 * tl.load(cos_row + HALF + i, mask=mask, other=0.0).to(tl.float32), dtype) + _round(
        x1 * tl.load(sin_row + HALF + i, mask=mask, other=0.0).to(tl.float32), dtype
    )
    out_row = OUT + row * 2 * HALF
    tl.store(out_row + i, first.to(dtype), mask=mask)
    tl.store(out_row + HALF + i, second.to(dtype), mask=mask)


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, S, D] (or fewer leading dims); cos, sin: broadcastable to x; returns the
    broadcast shape, contiguous, in result_type(x, cos)."""
    shape = torch.broadcast_shapes(x.shape, cos.shape, sin.shape)
    if len(shape) > 4:
        raise ValueError(f"pipeline::rope on CUDA takes at most 4 dims [B, H, S, D], got {tuple(shape)}")
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    x4, cos4, sin4 = (_unit_last_stride(t).expand(shape).reshape(shape4) for t in (x, cos, sin))
    out = torch.empty(shape, dtype=torch.result_type(x, cos), device=x.device)
    b, h, s, d = shape4
    if out.numel() == 0:
        return out
    half = d // 2
    _rope_kernel[(b * h * s,)](
        x4, cos4, sin4, out, h, s,
        *x4.stride()[:3], *cos4.stride()[:3], *sin4.stride()[:3],
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
    )  # fmt: skip
    return out
