"""`attention=torch`: the reference cached attention, plain PyTorch, CPU and GPU.

Vectorized over the batch: the new tokens of every sequence are scattered into their pages with
one indexed write, then each sequence's cached keys are gathered through its page table into a
padded [B, L, Hkv, D] block and one masked SDPA call covers all sequences (no Python loop over
sequences, in prefill or decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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


def allowed(q_pos: Tensor, k_pos: Tensor, total: Tensor, window: int, chunk: int) -> Tensor:
    """Which keys each query sees: causal, within the sequence, and within the window or chunk.
    q_pos: [B, Sq]; k_pos: [L]; total: [B] -> [B, Sq, L] bool."""
    qp, kp = q_pos[:, :, None], k_pos[None, None, :]
    mask = (kp <= qp) & (kp < total[:, None, None])
    if window > 0:
        mask &= kp > qp - window
    if chunk > 0:
        mask &= torch.div(kp, chunk, rounding_mode="floor") == torch.div(qp, chunk, rounding_mode="floor")
    return mask


@torch.library.custom_op("pipeline::cached_attention", mutates_args=("kv_cache",))
def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    qo_indptr: Tensor,
    cache_lens: Tensor,
    page_table: Tensor,
    scale: float,
    window: int,
    chunk: int,
) -> Tensor:
    """Write this step's keys/values into the paged cache, then attend over each sequence's history.

    q: [N, H, S, D] and k, v: [N, Hkv, S, D]: the new tokens of all sequences, taken in (N, S) order
    as one packed run of T = N * S tokens (the runtime packs into N = 1; a plain batch of N
    sequences of S new tokens each works too); kv_cache: [2, num_pages, page_size, Hkv, D];
    qo_indptr: [B + 1] into the packed run; cache_lens: [B] (tokens cached before this step);
    page_table: [B, max_pages]; window/chunk: 0 for none. Returns q's shape.
    """
    shape = q.shape
    q, k, v = (x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[3]) for x in (q, k, v))  # [1, H, T, D]
    total_tokens = q.shape[2]
    seq, offset, pos = token_positions(qo_indptr.long(), cache_lens.long(), total_tokens)
    write_cache(kv_cache, k[0].transpose(0, 1), v[0].transpose(0, 1), page_table.long(), seq, pos)

    batch = cache_lens.numel()
    page_size = kv_cache.shape[2]
    new_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
    total = cache_lens.long() + new_lens  # [B]
    # The longest run of new tokens sizes the padded queries; reading it is a device sync, which a
    # CUDA graph capture forbids: there the packed length (an upper bound, and 1 per row in decode) serves.
    q_len = total_tokens if q.is_cuda and torch.cuda.is_current_stream_capturing() else int(new_lens.max())
    key_len = page_table.shape[1] * page_size  # L: every page a sequence holds
    k_pos = torch.arange(key_len, device=q.device)
    pages = page_table.long().clamp(min=0)[:, torch.div(k_pos, page_size, rounding_mode="floor")]  # [B, L]
    slots = (k_pos % page_size)[None, :].expand(batch, -1)
    keys = kv_cache[0, pages, slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    values = kv_cache[1, pages, slots].to(q.dtype).transpose(1, 2)

    heads, dim = q.shape[1], q.shape[3]
    q_pad = q.new_zeros(batch, q_len, heads, dim)  # [B, Sq, H, D]
    q_pad[seq, offset] = q[0].transpose(0, 1)
    q_pos = cache_lens.long()[:, None] + torch.arange(q_len, device=q.device)[None, :]  # [B, Sq]
    mask = allowed(q_pos, k_pos, total, window, chunk)
    mask[:, :, 0] |= ~mask.any(-1)  # padded query rows see one key instead of none (no NaN); dropped below
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys,
        values,
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=heads != keys.shape[1],
    )  # [B, H, Sq, D]
    packed = out.transpose(1, 2)[seq, offset]  # [T, H, D]
    return packed.reshape(shape[0], shape[2], heads, dim).transpose(1, 2).contiguous()  # [N, H, S, D]


@cached_attention.register_fake
def _cached_attention_fake(q, k, v, kv_cache, qo_indptr, cache_lens, page_table, scale, window, chunk):
    return q.new_empty(q.shape)  # contiguous, as the kernel returns
