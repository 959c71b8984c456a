"""`attention=torch`: the reference cached attention, plain PyTorch, CPU and GPU.

Vectorized over the batch: the new tokens of every sequence are scattered into their slots with
one indexed write, then each sequence's pages are gathered through its page table into a padded
[B, L, Hkv, D] block and one masked SDPA call covers all sequences (no Python loop over
sequences, in prefill or decode). A logit cap (Gemma 2) takes the same masked attention written
out, since SDPA has no cap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.attention.common import register


def allowed(
    q_pos: Tensor, k_pos: Tensor, total: Tensor, window: int, chunk: int, block: Tensor | None = None
) -> Tensor:
    """Which keys each query sees: causal or in its block, within the sequence, and within the
    window or chunk. q_pos: [B, Sq]; k_pos: [L]; total: [B]; block: [B, Sq, 2] ([start, end)) ->
    [B, Sq, L] bool."""
    qp, kp = q_pos[:, :, None], k_pos[None, None, :]
    mask = kp <= qp
    if block is not None:
        mask |= (kp >= block[..., :1]) & (kp < block[..., 1:])
    mask &= kp < total[:, None, None]
    if window > 0:
        mask &= kp > qp - window
    if chunk > 0:
        mask &= torch.div(kp, chunk, rounding_mode="floor") == torch.div(qp, chunk, rounding_mode="floor")
    return mask


def softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float
) -> Tensor:
    """SDPA's result with the scaled scores capped, `tanh(s / cap) * cap` (SDPA takes no cap), in
    float32 as Hugging Face's eager attention computes it. q: [B, H, Sq, D]; k, v: [B, Hkv, L, D];
    mask: [B, 1, Sq, L] bool -> [B, H, Sq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)).float() * scale / softcap) * softcap  # [B, H, Sq, L]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
    return probs @ v


def attend(
    q, kv_cache, qo_indptr, cache_lens, page_table, seq, offset, pos, block, scale, softcap, window, chunk
):
    """q: [T, H, D] -> [T, H, D]: one masked SDPA over every sequence's gathered pages."""
    batch = cache_lens.numel()
    page_size = kv_cache.shape[2]
    new_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
    total = cache_lens.long() + new_lens  # [B]
    # The longest run of new tokens sizes the padded queries and the longest sequence the keys;
    # reading them is a device sync, which a CUDA graph capture forbids: there the packed length (an
    # upper bound, and 1 per row in decode) and every page of the table serve.
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        q_len, key_len = q.shape[0], page_table.shape[1] * page_size
    else:
        q_len, key_len = int(new_lens.max()), int(total.max())  # SDPA's work grows with the keys
    pages = -(-key_len // page_size)
    k_pos = torch.arange(key_len, device=q.device)
    # Whole pages through the table: [2, B, pages, page_size, Hkv, D] -> keys, values [B, Hkv, L, D]
    # (unused table entries are -1: page 0 is read there and masked out by `total`).
    paged = kv_cache[:, page_table[:, :pages].long().clamp(min=0)].to(q.dtype)
    keys, values = (
        x.reshape(batch, pages * page_size, *x.shape[3:])[:, :key_len].transpose(1, 2) for x in paged
    )

    heads, dim = q.shape[1], q.shape[2]
    # Decode: one new token per sequence, so packed token b is sequence b's, no padding needed.
    decode = q_len == 1 and q.shape[0] == batch
    if decode:
        q_pad = q[:, None]  # [B, 1, H, D]
    else:
        q_pad = q.new_zeros(batch, q_len, heads, dim)  # [B, Sq, H, D]
        q_pad[seq, offset] = q
    q_pos = cache_lens.long()[:, None] + torch.arange(q_len, device=q.device)[None, :]  # [B, Sq]
    block_pad = None
    if block is not None:  # [T, 2] -> [B, Sq, 2], padded rows (0, 0)
        block_pad = block.new_zeros(batch, q_len, 2)
        block_pad[seq, offset] = block
    mask = allowed(q_pos, k_pos, total, window, chunk, block_pad)
    if not decode:  # padded query rows see one key instead of none (no NaN); dropped below
        mask[:, :, 0] |= ~mask.any(-1)
    if softcap > 0:
        out = softcapped_attention(q_pad.transpose(1, 2), keys, values, mask[:, None], scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys,
            values,
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=heads != keys.shape[1],
        )  # [B, H, Sq, D]
    return out[:, :, 0] if decode else out.transpose(1, 2)[seq, offset]  # [T, H, D]


cached_attention = register("cached_attention", attend)
