"""Seeded random weights in fixed chunks: a parameter's elements [i * CHUNK, (i + 1) * CHUNK) come
from a generator seeded by (the parameter's seed, i), so the values depend on neither the thread
count that fills them nor on whether a process fills the whole tensor (models/build.py) or only its
tensor-parallel slice (models/deferred.py)."""

from __future__ import annotations

import torch

CHUNK = 1 << 22  # elements per independently seeded chunk: fixed, so weights never depend on threads


def chunk_seed(*parts: int) -> int:
    """A 32-bit seed from several integers. The CPU generator (mt19937) keeps only the low 32 bits
    of its seed, so (seed, parameter, chunk) must be mixed, not shifted apart (splitmix64)."""
    x = 0
    for part in parts:
        x = (x + part + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0xFFFFFFFF


def fill_chunk(values: torch.Tensor, bound: float, seed: int, index: int) -> None:
    """Chunk `index` of a parameter whose generator seed is `seed`, U(-bound, bound): values, 1-D
    and contiguous, are its elements [index * CHUNK, index * CHUNK + len(values))."""
    generator = torch.Generator(device=values.device).manual_seed(chunk_seed(seed, index))
    values.uniform_(-bound, bound, generator=generator)


def chunk_count(numel: int) -> int:
    return (numel + CHUNK - 1) // CHUNK
