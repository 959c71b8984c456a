"""`pipeline::attention_plan` on CUDA: one program per sequence, in place of about eighteen small
aten kernels (index arithmetic, a repeat_interleave, gathers) once per step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _attention_plan_kernel(
    QO_INDPTR,
    CACHE_LENS,
    PAGE_TABLE,
    SEQ,
    OFFSET,
    POS,
    SLOT,
    stride_pt,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # qo_indptr: [B + 1]; cache_lens: [B]; page_table: [B, max_pages]; seq/offset/pos/slot: [T] int64
    b = tl.program_id(0)
    start = tl.load(QO_INDPTR + b).to(tl.int64)
    end = tl.load(QO_INDPTR + b + 1).to(tl.int64)
    cached = tl.load(CACHE_LENS + b).to(tl.int64)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        mask = t < end
        offset = t - start
        pos = cached + offset
        page = tl.load(PAGE_TABLE + b * stride_pt + pos // PAGE, mask=mask, other=0).to(tl.int64)
        tl.store(SEQ + t, t * 0 + b, mask=mask)
        tl.store(OFFSET + t, offset, mask=mask)
        tl.store(POS + t, pos, mask=mask)
        tl.store(SLOT + t, page * PAGE + pos % PAGE, mask=mask)


def attention_plan(
    q: Tensor, kv_cache: Tensor, qo_indptr: Tensor, cache_lens: Tensor, page_table: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reference's contract (pipeline/attention/common.py); qo_indptr[-1] must be T."""
    total_tokens, page_size = q.shape[0] * q.shape[2], kv_cache.shape[2]
    seq, offset, pos, slot = (torch.empty(total_tokens, dtype=torch.long, device=q.device) for _ in range(4))
    sequences = qo_indptr.shape[0] - 1
    if sequences and total_tokens:
        table = page_table.contiguous()
        _attention_plan_kernel[(sequences,)](
            qo_indptr.contiguous(), cache_lens.contiguous(), table, seq, offset, pos, slot, table.stride(0),
            PAGE=page_size,
            BLOCK=min(triton.next_power_of_2(total_tokens), 256),
        )  # fmt: skip
    return seq, offset, pos, slot
