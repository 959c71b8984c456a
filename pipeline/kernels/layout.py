"""How the row kernels see a tensor: [..., D] as [rows, D] with a unit last stride."""

from __future__ import annotations

from torch import Tensor


def as_rows(t: Tensor) -> Tensor:
    """[..., D] -> [rows, D] with a unit last stride: a view (any row stride) unless the rows are not
    evenly strided or the last dim is, then a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
