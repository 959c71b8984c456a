"""Weights a tensor-parallel rank allocates only as its slice (`runtime.tp_weights=shard`).

Most of a language model's bytes are its linears' weights, and the shard transform splits most of
them N ways. Building them whole and slicing afterwards needs the whole model's memory on every
rank, the memory tensor parallelism is there to divide. So load gives each such weight a
placeholder: a tensor of the weight's shape, dtype and device whose strides are all 0 over a storage
of one element. That is all torch.export reads of a parameter (shape, dtype, device, never values),
and the forward passes that run before export (models/probe.py, export/graph_capture.py's
record_calls) stop at the language model's entry, so no placeholder is ever computed with.

The shard transform asks for the slice it keeps of each weight it splits (`slice`), and fills the
placeholders it keeps whole at the end of its passes (`materialize_rest`); the transforms stage
fails if any is left. Values are the ones models/build.py would have given the whole weight: the
same per-(seed, parameter, chunk) generators (models/seeded.py), so world_size 1 and N hold the
same model. A row slice generates only the chunks its rows lie in; a column slice (a row-parallel
linear's [M, N/ws]) generates every chunk and keeps its columns: the time of the whole init, the
memory of the slice and one chunk per thread.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.seeded import CHUNK, chunk_count, fill_chunk


@dataclass(frozen=True)
class Recipe:
    """Where the whole weight's values come from: a checkpoint's safetensors file, or the seeded
    random init (models/build.py)."""

    name: str  # its path in the whole model
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    source: tuple[str, str] | None = None  # (safetensors file, key) in a checkpoint; None: random
    kind: str = "weight"  # random: weight (uniform) | bias (zeros) | norm (ones)
    seed: int = 0  # random: the parameter's generator seed (its index among the model's parameters)
    bound: float = 0.0  # random: U(-bound, bound)


class DeferredWeights:
    """The placeholders load handed out, by the address of their one element."""

    def __init__(self) -> None:
        self._recipes: dict[int, Recipe] = {}
        self.filled_bytes = 0  # what slices and wholes allocated so far

    def __len__(self) -> int:
        """Placeholders handed out (each holds one element of storage)."""
        return len(self._recipes)

    def whole_bytes(self) -> int:
        """What the deferred weights would have taken whole."""
        return sum(math.prod(r.shape) * r.dtype.itemsize for r in self._recipes.values())

    def placeholder(self, recipe: Recipe) -> nn.Parameter:
        one = torch.empty((1,) * len(recipe.shape), dtype=recipe.dtype, device=recipe.device)
        tensor = one.expand(recipe.shape)  # strides all 0: one element of storage
        self._recipes[tensor.data_ptr()] = recipe
        return nn.Parameter(tensor, requires_grad=False)

    def recipe(self, tensor: torch.Tensor) -> Recipe | None:
        """The recipe when tensor is one of this load's placeholders, else None."""
        if (
            tensor.numel() <= 1
            or any(tensor.stride())
            or tensor.untyped_storage().nbytes() > tensor.element_size()
        ):
            return None
        return self._recipes.get(tensor.data_ptr())

    def slice(self, placeholder: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """The whole weight's [start, start + length) along dim, filled as the whole would be."""
        recipe = self._need(placeholder)
        shape = list(recipe.shape)
        shape[dim] = length
        if recipe.source is not None:
            out = _read(recipe, dim, start, length)
        elif dim > 1 or (dim == 1 and len(shape) != 2):
            raise ValueError(
                f"{recipe.name}: slices along dim {dim} of a {len(shape)}-D weight are not filled here"
            )
        else:
            out = torch.empty(shape, dtype=recipe.dtype, device=recipe.device)
            _random(out, recipe, dim, start, length)
        self.filled_bytes += out.numel() * out.element_size()
        return out

    def whole(self, placeholder: torch.Tensor) -> torch.Tensor:
        recipe = self._need(placeholder)
        return self.slice(placeholder, 0, 0, recipe.shape[0])

    def materialize_rest(self, module: nn.Module) -> int:
        """Every placeholder still in module, filled whole (one tensor for a placeholder held twice);
        returns how many."""
        filled: dict[int, nn.Parameter] = {}
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is None or self.recipe(param) is None:
                    continue
                if param.data_ptr() not in filled:
                    filled[param.data_ptr()] = nn.Parameter(self.whole(param), requires_grad=False)
                owner._parameters[name] = filled[param.data_ptr()]
        return len(filled)

    def left(self, module: nn.Module) -> list[str]:
        """The names of the whole-model weights whose placeholders module still holds."""
        return sorted({r.name for p in module.parameters() if (r := self.recipe(p)) is not None})

    def _need(self, tensor: torch.Tensor) -> Recipe:
        recipe = self.recipe(tensor)
        if recipe is None:
            raise ValueError("not a placeholder of this load")
        return recipe


def _read(recipe: Recipe, dim: int, start: int, length: int) -> torch.Tensor:
    """The slice from the checkpoint's file alone: safetensors reads the slice's bytes (a column
    slice: its part of every row), not the tensor."""
    from safetensors import safe_open

    file, key = recipe.source
    index = (slice(None),) * dim + (slice(start, start + length),)
    with safe_open(file, framework="pt", device="cpu") as f:
        part = f.get_slice(key)[index]
    return part.to(device=recipe.device, dtype=recipe.dtype).contiguous()


def _random(out: torch.Tensor, recipe: Recipe, dim: int, start: int, length: int) -> None:
    if recipe.kind == "bias":
        out.zero_()
    elif recipe.kind == "norm":
        out.fill_(1.0)
    elif dim == 0:
        _rows(out, recipe, start, length)
    else:
        _columns(out, recipe, start, length)


def _rows(out: torch.Tensor, recipe: Recipe, start: int, length: int) -> None:
    """out: [length, ...] = rows [start, start + length) of the whole: one contiguous range of its
    flat elements, so only the chunks that range lies in are generated."""
    row = math.prod(recipe.shape[1:])
    lo, hi = start * row, (start + length) * row
    total = math.prod(recipe.shape)
    flat = out.view(-1)

    def fill(index: int) -> None:
        a, b = index * CHUNK, min((index + 1) * CHUNK, total)
        first, last = max(a, lo), min(b, hi)
        if (first, last) == (a, b):
            fill_chunk(flat[a - lo : b - lo], recipe.bound, recipe.seed, index)
            return
        values = torch.empty(b - a, dtype=out.dtype, device=out.device)
        fill_chunk(values, recipe.bound, recipe.seed, index)
        flat[first - lo : last - lo] = values[first - a : last - a]

    _each(fill, range(lo // CHUNK, (hi - 1) // CHUNK + 1))


def _columns(out: torch.Tensor, recipe: Recipe, start: int, length: int) -> None:
    """out: [M, length] = columns [start, start + length) of the whole [M, N]: every chunk is
    generated, and the part of each row it holds that lies in those columns kept."""
    _, n = recipe.shape
    total = math.prod(recipe.shape)
    stop = start + length

    def fill(index: int) -> None:
        a, b = index * CHUNK, min((index + 1) * CHUNK, total)
        values = torch.empty(b - a, dtype=out.dtype, device=out.device)
        fill_chunk(values, recipe.bound, recipe.seed, index)
        first_row, last_row = a // n, (b - 1) // n
        full_from = first_row if a == first_row * n else first_row + 1  # rows wholly in [a, b)
        full_to = last_row if b == (last_row + 1) * n else last_row - 1
        if full_from <= full_to:
            band = values[full_from * n - a : (full_to + 1) * n - a].view(-1, n)  # [rows, N]
            out[full_from : full_to + 1] = band[:, start:stop]
        for r in {first_row, last_row} - set(range(full_from, full_to + 1)):
            lo, hi = max(a, r * n) - r * n, min(b, (r + 1) * n) - r * n  # the columns of row r held here
            lo, hi = max(lo, start), min(hi, stop)
            if lo < hi:
                out[r, lo - start : hi - start] = values[r * n + lo - a : r * n + hi - a]

    _each(fill, range(chunk_count(total)))


def _each(fill, indices: range) -> None:
    # chunks write disjoint parts of the slice: in parallel, as the whole init fills them
    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
        list(pool.map(fill, indices))
