"""`pipeline::rms_norm` and `pipeline::add_rms_norm` on CUDA: one program per row, the row held in
registers.

Rounding follows the reference (and HF): the residual sum is rounded to its dtype (it is what the
next residual add reads), the normalized row is computed in float32 and rounded to the input dtype
before it is multiplied by the weight in the result dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pipeline.kernels.layout import as_rows


@triton.jit
def _rms_norm_kernel(
    X,
    RESIDUAL,
    SUM,
    W,
    OUT,
    D,
    eps,
    stride_x,
    stride_r,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # x, residual: [rows, D] with row strides stride_x, stride_r; sum, out: [rows, D] contiguous;
    # w: [D]. Without a residual the norm is of x itself.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(RESIDUAL + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(SUM.dtype.element_ty)
        tl.store(SUM + row * D + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv_rms).to(SUM.dtype.element_ty if HAS_RESIDUAL else X.dtype.element_ty)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
    else:
        out = normed
    tl.store(OUT + row * D + cols, out.to(OUT.dtype.element_ty), mask=mask)


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    d = x.shape[-1]
    rows = as_rows(x)
    residual_rows = rows if residual is None else as_rows(residual)
    total = (
        torch.empty(x.shape, dtype=torch.result_type(x, residual), device=x.device)
        if residual is not None
        else x
    )
    dtype = total.dtype if weight is None else torch.result_type(weight, total)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, total, rows if weight is None else weight.contiguous(), out,  # unread when absent
            d, eps, rows.stride(0), residual_rows.stride(0),
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
        )  # fmt: skip
    return out, total


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x: [..., D]; weight: [D] or None; returns [..., D] in result_type(weight, x), contiguous."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual: [..., D], one shape; returns (rms_norm(x + residual), x + residual), contiguous."""
    return _launch(x, residual, weight, eps)
