"""The paged KV cache, the storage side of the cached attention contract (common.py): per-layer
page pools, a page allocator, and the per-step sequence metadata the ops read.

A layer's cache is one tensor [2, num_pages, page_size, Hkv, D] (keys, values). A sequence owns a
list of pages; its token at position p lives in page_table[p // page_size], slot p % page_size.
Pages are taken as sequences grow and returned when they finish. The last page is never handed
out: it is the scratch page that padded rows of a CUDA-graph bucket write into.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pipeline.config import RuntimeConfig


class CacheFull(RuntimeError):
    pass


@dataclass
class CacheSpec:
    """What one cached attention layer needs: its graph input name and KV geometry."""

    input_name: str  # e.g. kv_cache_0
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def pages_for(runtime: RuntimeConfig, specs: list[CacheSpec]) -> int:
    """From runtime.kv_cache_mb when set, else enough for max_batch_size sequences of max_seq_len;
    plus the scratch page."""
    page = runtime.attn_page_size
    if runtime.kv_cache_mb:
        bytes_per_page = sum(2 * page * s.num_kv_heads * s.head_dim * s.dtype.itemsize for s in specs)
        return max(1, int(runtime.kv_cache_mb * 2**20 // bytes_per_page)) + 1
    return runtime.max_batch_size * (runtime.max_seq_len // page) + 1


class PagedKVCache:
    def __init__(self, specs: list[CacheSpec], num_pages: int, page_size: int, device):
        self.page_size = page_size
        self.num_pages = num_pages
        self.tensors = {
            s.input_name: torch.zeros(
                2, num_pages, page_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device
            )
            for s in specs
        }
        self.scratch_page = num_pages - 1
        self.free_pages = list(range(num_pages - 2, -1, -1))  # pop() hands out low page ids first
        self.pages: dict[int, list[int]] = {}  # sequence id -> its pages, in order
        self.lengths: dict[int, int] = {}  # sequence id -> tokens cached

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def reserve(self, seq_id: int, new_tokens: int) -> None:
        """Make room for new_tokens more tokens of seq_id; CacheFull when the pool is exhausted."""
        pages = self.pages.setdefault(seq_id, [])
        self.lengths.setdefault(seq_id, 0)
        needed = -(-(self.lengths[seq_id] + new_tokens) // self.page_size) - len(pages)
        if needed > len(self.free_pages):
            raise CacheFull(
                f"KV cache out of pages: sequence {seq_id} needs {needed} more, {len(self.free_pages)} free of "
                f"{self.num_pages - 1}; raise runtime.kv_cache_mb or lower prompt.batch_size"
            )
        pages += [self.free_pages.pop() for _ in range(needed)]

    def commit(self, seq_id: int, new_tokens: int) -> None:
        self.lengths[seq_id] += new_tokens

    def free(self, seq_id: int) -> None:
        self.free_pages += reversed(self.pages.pop(seq_id, []))
        self.lengths.pop(seq_id, None)

    def metadata(self, seq_ids: list[int], new_tokens: list[int], device) -> dict[str, torch.Tensor]:
        """The graph's sequence inputs for one step over seq_ids (packed in that order).

        qo_indptr: [B + 1], where each sequence's new tokens start in the packed step;
        cache_lens: [B], tokens cached before this step; page_table: [B, max pages], -1 padded.
        Each is its own tensor: views of one shared buffer would differ in storage offset, which
        torch.compile guards on (it recompiled when an offset matched another size). On a GPU each
        goes from pinned memory, so the copies are asynchronous and the host runs on.
        """
        # At least two columns (-1 pads): a width of 1 would be a size torch.compile specializes.
        width = max(2, *(len(self.pages[s]) for s in seq_ids))
        values = {
            "qo_indptr": list(itertools.accumulate(new_tokens, initial=0)),
            "cache_lens": [self.lengths[s] for s in seq_ids],
            "page_table": [self.pages[s] + [-1] * (width - len(self.pages[s])) for s in seq_ids],
        }
        step = {}
        for name, value in values.items():
            host = torch.tensor(value, dtype=torch.int32)
            if device.type == "cuda":
                host = host.pin_memory()
            step[name] = host.to(device, non_blocking=True)
        return step
