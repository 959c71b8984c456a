"""`attention=flashinfer`: flashinfer's paged prefill/append kernel, on CUDA with the package installed.

The pipeline's metadata (per-sequence page table, cached lengths, qo_indptr) is turned into
flashinfer's CSR page layout (kv_indptr, kv_indices, last_page_len) and the batch is planned on
every call; one wrapper serves prefill and decode (decode is an append of one token). The cache
layout [2, pages, page_size, Hkv, D] is flashinfer's NHD as a (keys, values) pair.
A logit cap goes to flashinfer's `logits_soft_cap`. Chunked attention (Llama-4's chunked layers)
and bidirectional blocks (PaliGemma, Gemma 3's images) have no flashinfer equivalent here: a run
that needs them is refused up front (SUPPORTS in attention/__init__.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.attention.common import register

_WORKSPACE: dict[torch.device, Tensor] = {}
_WORKSPACE_BYTES = 128 * 2**20


def _wrapper(device: torch.device):
    import flashinfer  # at the first call: the page layout (csr_pages) needs no flashinfer

    if device not in _WORKSPACE:
        _WORKSPACE[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(_WORKSPACE[device], "NHD")


def csr_pages(page_table: Tensor, total: Tensor, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(kv_indptr [B + 1], kv_indices [used pages], last_page_len [B]) from a padded page table."""
    used = torch.div(total + page_size - 1, page_size, rounding_mode="floor")  # [B]
    indptr = torch.zeros(total.numel() + 1, dtype=torch.int32, device=total.device)
    indptr[1:] = torch.cumsum(used, 0)
    columns = torch.arange(page_table.shape[1], device=page_table.device)[None, :]
    indices = page_table[columns < used[:, None]].to(torch.int32)
    last = (total - (used - 1) * page_size).to(torch.int32)
    return indptr, indices, last


def attend(
    q, kv_cache, qo_indptr, cache_lens, page_table, seq, offset, pos, block, scale, softcap, window, chunk
):
    """q: [T, H, D] -> [T, H, D]: flashinfer's paged prefill/append, planned for this batch."""
    if chunk > 0 or block is not None:  # refused before the run (SUPPORTS); this guards direct calls
        raise NotImplementedError(
            "attention=flashinfer has no chunked attention (Llama-4) nor bidirectional blocks; use attention=triton"
        )
    page_size = kv_cache.shape[2]
    total = cache_lens + (qo_indptr[1:] - qo_indptr[:-1])
    kv_indptr, kv_indices, last_page_len = csr_pages(page_table, total, page_size)
    wrapper = _wrapper(q.device)
    wrapper.plan(
        qo_indptr.to(torch.int32), kv_indptr, kv_indices, last_page_len,
        q.shape[1], kv_cache.shape[3], q.shape[2], page_size,
        causal=True, sm_scale=scale, window_left=window - 1 if window > 0 else -1,
        logits_soft_cap=softcap if softcap > 0 else None,
        q_data_type=q.dtype, kv_data_type=kv_cache.dtype,
    )  # fmt: skip
    return wrapper.run(q, (kv_cache[0], kv_cache[1]))


cached_attention_flashinfer = register("cached_attention_flashinfer", attend)
