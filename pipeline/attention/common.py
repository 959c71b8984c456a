"""The contract every cached attention backend shares, registered once per backend.

`pipeline::<name>(q, k, v, kv_cache, qo_indptr, cache_lens, page_table, token_seq, token_offset,
token_pos, token_slot, token_block, scale, softcap, window, chunk)`:
q: [N, H, S, D] and k, v: [N, Hkv, S, D], the new tokens of all sequences taken in (N, S) order as
one packed run of T = N * S tokens (the runtime packs into N = 1; a plain batch of N sequences of
S new tokens each works too); kv_cache: [2, num_pages, page_size, Hkv, D], written in place;
qo_indptr: [B + 1] into the packed run; cache_lens: [B], tokens cached before this step;
page_table: [B, max_pages]; token_seq/offset/pos/slot: [T], from `pipeline::attention_plan`;
token_block: [T, 2] or None, the [start, end) positions each token also sees both ways ((0, 0):
none; models/masks.py); softcap: the logit cap, `tanh(s / cap) * cap` of the scaled scores (0:
none; Gemma 2); window/chunk: 0 for none, and both bound a block too. Which token a query sees:
(key <= its position, or key in its block) and key within its window and chunk. Returns q's
shape, contiguous. A backend that lacks an option says so in `SUPPORTS` (attention/__init__.py),
and the run is refused up front.

`pipeline::attention_plan(q, kv_cache, qo_indptr, cache_lens, page_table)` computes, once per step
for every layer (they share the step's sequences): each packed token's sequence, its offset among
the sequence's new tokens, its absolute position and its flat cache slot (page * page_size +
position % page_size). The shared part of each layer's op writes the new keys/values into those
slots; a backend supplies only the attention over the paged history.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipeline import kernels
from pipeline.library import fake, op

SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor qo_indptr, Tensor cache_lens, "
    "Tensor page_table, Tensor token_seq, Tensor token_offset, Tensor token_pos, Tensor token_slot, "
    "Tensor? token_block, float scale, float softcap, int window, int chunk) -> Tensor"
)


@op("attention_plan", cuda=kernels.attention_plan)
def attention_plan(
    q: Tensor, kv_cache: Tensor, qo_indptr: Tensor, cache_lens: Tensor, page_table: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q: [N, H, S, D] (only its T = N * S is read); kv_cache: [2, P, page_size, Hkv, D] (its page
    size) -> (token_seq, token_offset, token_pos, token_slot), each [T] int64."""
    total_tokens, page_size = q.shape[0] * q.shape[2], kv_cache.shape[2]
    qo_indptr, cache_lens = qo_indptr.long(), cache_lens.long()
    new_lens = qo_indptr[1:] - qo_indptr[:-1]  # [B]
    seq = torch.repeat_interleave(
        torch.arange(new_lens.numel(), device=q.device), new_lens, output_size=total_tokens
    )  # [T]
    offset = torch.arange(total_tokens, device=q.device) - qo_indptr[seq]  # [T]
    pos = cache_lens[seq] + offset
    slot = (
        page_table.long()[seq, torch.div(pos, page_size, rounding_mode="floor")] * page_size + pos % page_size
    )
    return seq, offset, pos, slot


@fake("attention_plan")
def _attention_plan_fake(q, kv_cache, qo_indptr, cache_lens, page_table):
    total_tokens = q.shape[0] * q.shape[2]
    return tuple(q.new_empty(total_tokens, dtype=torch.long) for _ in range(4))


def write_cache(kv_cache: Tensor, k: Tensor, v: Tensor, slot: Tensor) -> None:
    # kv_cache: [2, P, page, Hkv, D] viewed as [2, P * page, Hkv, D]; k, v: [T, Hkv, D]; slot: [T]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0, slot] = k.to(kv_cache.dtype)
    flat[1, slot] = v.to(kv_cache.dtype)


# attend(q [T, H, D], kv_cache, qo_indptr, cache_lens, page_table, seq [T], offset [T], pos [T],
#        block [T, 2] | None, scale, softcap, window, chunk) -> [T, H, D]
Attend = Callable[..., Tensor]


def register(name: str, attend: Attend):
    """`pipeline::<name>` with the shared contract around `attend`, and its fake kernel."""

    def cached_attention(
        q, k, v, kv_cache, qo_indptr, cache_lens, page_table, seq, offset, pos, slot, block, scale, softcap,
        window, chunk,
    ):  # fmt: skip
        shape = q.shape  # [N, H, S, D]
        q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (q, k, v))  # [T, H, D]
        write_cache(kv_cache, k, v, slot)
        out = attend(
            q.contiguous(),
            kv_cache,
            qo_indptr,
            cache_lens,
            page_table,
            seq,
            offset,
            pos,
            block,
            scale,
            softcap,
            window,
            chunk,
        )
        return out.reshape(shape[0], shape[2], shape[1], -1).transpose(1, 2).contiguous()  # [N, H, S, D]

    registered = op(name, schema=SCHEMA)(cached_attention)
    fake(name)(lambda q, *rest: q.new_empty(q.shape))  # contiguous, as the implementation returns
    return registered
