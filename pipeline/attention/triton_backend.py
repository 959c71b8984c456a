"""`attention=triton`: a Triton paged-attention kernel, for prefill and decode alike.

One program per (new token, query head): it walks the token's sequence through the page table in
blocks of keys, from the first key its window or chunk allows up to its own position (or the end of
its bidirectional block, models/masks.py), with an online softmax (running max and sum in float32),
so no [S, L] score matrix is materialized. A logit cap (Gemma 2) caps each block's scaled scores,
tanh written through the sigmoid (2 * sigmoid(2x) - 1), which the interpreter and every GPU have. New
keys/values are written into their pages first, with the same indexed write as the torch backend.
On a GPU the kernel is compiled; without one, Triton's interpreter (TRITON_INTERPRET=1, set by the
tests) runs it on CPU tensors, which is how its parity tests run in CI.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.attention.common import register

BLOCK_N = 16  # keys per step of the walk


@triton.jit
def _paged_attention_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    OUT,
    TOK_SEQ,
    TOK_POS,
    TOK_BLOCK,
    PAGE_TABLE,
    scale,
    softcap,
    window,
    chunk,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_pt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # q: [T, H, D]; k/v cache: [pages, PAGE, Hkv, D]; page table: [B, max_pages]; out: [T, H, D]
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seq = tl.load(TOK_SEQ + t)
    pos = tl.load(TOK_POS + t)
    d = tl.arange(0, D)
    q = tl.load(Q + t * stride_qt + h * stride_qh + d).to(tl.float32)

    block_start = pos * 0
    block_end = pos * 0
    if HAS_BLOCKS:  # [T, 2]: the token's bidirectional block, (0, 0) for none
        block_start = tl.load(TOK_BLOCK + 2 * t)
        block_end = tl.load(TOK_BLOCK + 2 * t + 1)
    hi = tl.maximum(pos + 1, block_end)
    lo = pos * 0
    if window > 0:
        lo = tl.maximum(lo, pos - window + 1)
    if chunk > 0:
        lo = tl.maximum(lo, (pos // chunk) * chunk)

    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for start in range(lo, hi, BLOCK):
        n = start + tl.arange(0, BLOCK)
        valid = (n <= pos) | ((n >= block_start) & (n < block_end))
        page = tl.load(PAGE_TABLE + seq * stride_pt + n // PAGE, mask=valid, other=0)
        offsets = (
            page[:, None] * stride_kp + (n % PAGE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        )
        k = tl.load(K_CACHE + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(V_CACHE + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], 1) * scale
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(OUT + t * stride_ot + h * stride_oh + d, (acc / l_i).to(OUT.dtype.element_ty))


def attend(
    q, kv_cache, qo_indptr, cache_lens, page_table, seq, offset, pos, block, scale, softcap, window, chunk
):
    """q: [T, H, D] -> [T, H, D]: the kernel, one program per (token, head)."""
    out = torch.empty_like(q)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    heads, kv_heads, dim = q.shape[1], kv_cache.shape[3], q.shape[2]
    table = page_table.contiguous()
    # seq, pos: [T] int64 from attention_plan, read as they are: converting them would add two
    # kernels to every layer of every step
    _paged_attention_kernel[(q.shape[0], heads)](
        q, k_cache, v_cache, out, seq, pos, pos if block is None else block.contiguous(), table,
        scale, softcap, window, chunk,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, PAGE=kv_cache.shape[2], D=dim, BLOCK=BLOCK_N,
        HAS_BLOCKS=block is not None, HAS_SOFTCAP=softcap > 0,
    )  # fmt: skip
    return out


cached_attention_triton = register("cached_attention_triton", attend)
