"""runtime.tp_weights=shard: a weight load leaves as a placeholder costs one element, and the slice a
rank fills later is, element for element, the same slice of what the whole random init gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.models import build
from pipeline.models.deferred import DeferredWeights
from pipeline.models.seeded import CHUNK

# 3 chunks, and neither rows nor columns line up with a chunk's end: a chunk starts and ends
# inside a row, and a column slice takes parts of rows from two chunks
ROWS, COLS = 3001, 2897
assert ROWS * COLS > 2 * CHUNK and CHUNK % COLS


def _linear(dtype: torch.dtype, deferred: DeferredWeights | None = None) -> nn.Linear:
    with build.parameters_on_meta():
        linear = nn.Linear(COLS, ROWS)
    defer = (lambda path, module, name: True) if deferred is not None else None
    build.materialize_random(linear, dtype, torch.device("cpu"), 7, 0.02, False, defer, deferred)
    return linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_slice_is_the_whole_inits_slice(dtype):
    whole = _linear(dtype)
    deferred = DeferredWeights()
    lazy = _linear(dtype, deferred)
    assert lazy.weight.shape == whole.weight.shape and lazy.weight.dtype == dtype
    assert lazy.weight.untyped_storage().nbytes() == dtype.itemsize  # one element, not 8.7 M
    for dim, start, length in [
        (0, 0, 1500),  # rank 0 of 2: rows
        (0, 1500, 1501),
        (0, 2999, 2),  # inside the last chunk
        (1, 0, 1448),  # a row-parallel rank's columns
        (1, 1448, 1449),
        (1, 5, 3),
    ]:
        part = deferred.slice(lazy.weight, dim, start, length)
        assert torch.equal(part, whole.weight.narrow(dim, start, length)), (dim, start, length)
    assert torch.equal(deferred.slice(lazy.bias, 0, 100, 50), torch.zeros(50, dtype=dtype))
    rows, columns = (1500 + 1501 + 2) * COLS, (1448 + 1449 + 3) * ROWS
    assert deferred.filled_bytes == (rows + columns + 50) * dtype.itemsize  # the slices, nothing whole


def test_what_no_shard_took_is_filled_whole_and_nothing_is_left():
    whole = _linear(torch.float32)
    deferred = DeferredWeights()
    lazy = _linear(torch.float32, deferred)
    assert deferred.left(lazy) == ["bias", "weight"]
    assert deferred.materialize_rest(lazy) == 2
    assert deferred.left(lazy) == []
    assert torch.equal(lazy.weight, whole.weight) and torch.equal(lazy.bias, whole.bias)
    assert deferred.recipe(lazy.weight) is None  # a real tensor now
    with pytest.raises(ValueError, match="not a placeholder"):
        deferred.slice(whole.weight, 0, 0, 1)
