"""The contract every cached attention backend shares, registered once per backend.

`pipeline::<name>(q, k, v, kv_cache, qo_indptr, cache_lens, page_table, scale, window, chunk)`:
q: [N, H, S, D] and k, v: [N, Hkv, S, D], the new tokens of all sequences taken in (N, S) order as
one packed run of T = N * S tokens (the runtime packs into N = 1; a plain batch of N sequences of
S new tokens each works too); kv_cache: [2, num_pages, page_size, Hkv, D], written in place;
qo_indptr: [B + 1] into the packed run; cache_lens: [B], tokens cached before this step;
page_table: [B, max_pages]; window/chunk: 0 for none. Returns q's shape, contiguous.

The shared part packs the tokens, finds each one's sequence and position, and writes the new
keys/values into their pages; a backend supplies only the attention over the paged history.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor qo_indptr, Tensor cache_lens, "
    "Tensor page_table, float scale, int window, int chunk) -> Tensor"
)


def token_positions(
    qo_indptr: Tensor, cache_lens: Tensor, total_tokens: int
) -> tuple[Tensor, Tensor, Tensor]:
    """For each packed token: (its sequence, its offset among the new tokens, its absolute position)."""
    new_lens = qo_indptr[1:] - qo_indptr[:-1]  # [B]
    seq = torch.repeat_interleave(
        torch.arange(new_lens.numel(), device=qo_indptr.device), new_lens, output_size=total_tokens
    )  # [T]
    offset = torch.arange(total_tokens, device=qo_indptr.device) - qo_indptr[seq]  # [T]
    return seq, offset, cache_lens[seq] + offset


def write_cache(kv_cache: Tensor, k: Tensor, v: Tensor, page_table: Tensor, seq: Tensor, pos: Tensor) -> None:
    # kv_cache: [2, P, page, Hkv, D]; k, v: [T, Hkv, D]
    page_size = kv_cache.shape[2]
    pages = page_table[seq, torch.div(pos, page_size, rounding_mode="floor")].long()
    slots = (pos % page_size).long()
    kv_cache[0, pages, slots] = k.to(kv_cache.dtype)
    kv_cache[1, pages, slots] = v.to(kv_cache.dtype)


# attend(q [T, H, D], kv_cache, qo_indptr, cache_lens, page_table, seq [T], offset [T], pos [T],
#        scale, window, chunk) -> [T, H, D]
Attend = Callable[..., Tensor]


def register(name: str, attend: Attend):
    """`pipeline::<name>` with the shared contract around `attend`, and its fake kernel."""

    def cached_attention(q, k, v, kv_cache, qo_indptr, cache_lens, page_table, scale, window, chunk):
        shape = q.shape  # [N, H, S, D]
        q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (q, k, v))  # [T, H, D]
        seq, offset, pos = token_positions(qo_indptr.long(), cache_lens.long(), q.shape[0])
        write_cache(kv_cache, k, v, page_table.long(), seq, pos)
        out = attend(
            q.contiguous(),
            kv_cache,
            qo_indptr,
            cache_lens,
            page_table,
            seq,
            offset,
            pos,
            scale,
            window,
            chunk,
        )
        return out.reshape(shape[0], shape[2], shape[1], -1).transpose(1, 2).contiguous()  # [N, H, S, D]

    op = torch.library.custom_op(
        f"pipeline::{name}", cached_attention, mutates_args=("kv_cache",), schema=SCHEMA
    )
    op.register_fake(lambda q, *rest: q.new_empty(q.shape))  # contiguous, as the implementation returns
    return op
