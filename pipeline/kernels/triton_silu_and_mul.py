"""`pipeline::silu_and_mul` on CUDA: silu(gate) * up in one pass over the fused gate/up output.

Rounding follows the aten chain: silu's result is rounded to the dtype before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pipeline.kernels.layout import as_rows

BLOCK = 1024  # columns per program: the intermediate size is up to tens of thousands


@triton.jit
def _silu_and_mul_kernel(X, OUT, width, stride_x, BLOCK: tl.constexpr):
    # x: [rows, 2 * width] (gate, then up) with row stride stride_x; out: [rows, width] contiguous
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(OUT + row * width + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul(x: Tensor) -> Tensor:
    """x: [..., 2 * I] -> [..., I], contiguous."""
    width = x.shape[-1] // 2
    rows = as_rows(x)
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if rows.shape[0] and width:
        block = min(BLOCK, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
            rows, out, width, rows.stride(0), BLOCK=block
        )
    return out
