"""`pipeline::rms_norm` on CUDA: one program per row, the row held in registers.

Rounding follows the reference (and HF): the normalized row is computed in float32 and rounded to
the input dtype before it is multiplied by the weight in the result dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(X, W, OUT, stride_x, stride_out, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    # x: [rows, D] with row stride stride_x; w: [D]; out: [rows, D] with row stride stride_out
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv_rms).to(X.dtype.element_ty)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
    else:
        out = normed
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x: [..., D]; weight: [D] or None; returns [..., D] in result_type(weight, x), contiguous."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)  # a view unless x's rows are not evenly strided
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dtype = x.dtype if weight is None else torch.result_type(weight, x)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        rows if weight is None else weight.contiguous(),  # unread without a weight
        out,
        rows.stride(0),
        d,
        d,
        eps,
        HAS_WEIGHT=weight is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out
