"""Build a Hugging Face model fast with random weights: parameters on the meta device, then filled
directly (checkpoints load in checkpoint.py).

Hugging Face's own random init runs every module's initializer on real memory (BENCHMARKS.md, "load":
several times our load for the default mistral3 configuration). Building with parameters on meta skips that; buffers stay
real so the rotary `inv_freq` tables are computed as usual. Then every parameter is allocated once
at the target dtype and device and filled in parallel chunks, each from a generator seeded by
(seed, parameter index, chunk index): the same seed gives the same weights on any thread count.
A tensor-parallel rank leaves the weights it will hold a slice of as placeholders (`defer`), and
fills only its slice later with the same values (models/deferred.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.deferred import DeferredWeights, Recipe
from pipeline.models.seeded import CHUNK, chunk_count, chunk_seed, fill_chunk


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lands on the meta device; buffers are untouched."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _fill_uniform(flat: torch.Tensor, bound: float, seed: int, pool: ThreadPoolExecutor) -> None:
    """U(-bound, bound) in parallel chunks, each from its own generator seeded by (seed, chunk).

    A CPU generator fills single-threaded (about 180 M/s with first-touch page faults); chunks on
    a thread pool use every core, and the chunk seeds keep the result independent of the pool size.
    """

    def fill(index: int) -> None:
        fill_chunk(flat[index * CHUNK : (index + 1) * CHUNK], bound, seed, index)

    list(pool.map(fill, range(chunk_count(flat.numel()))))


def _fill(kind: str, tensor: torch.Tensor, bound: float, seed: int, pool: ThreadPoolExecutor) -> None:
    # Norm scales at one and biases at zero keep activations at a sane scale through the layers;
    # everything else (linears, embeddings, experts, convs) is uniform with the config's
    # initializer_range as standard deviation: uniform_ runs several times faster than normal_, and
    # a uniform init is what PyTorch itself uses for nn.Linear.
    if kind == "bias":
        tensor.zero_()
    elif kind == "norm":
        tensor.fill_(1.0)
    else:
        _fill_uniform(tensor.view(-1), bound, seed, pool)


def _kind(module: nn.Module, name: str) -> str:
    if name == "bias" or name.endswith("_bias"):
        return "bias"
    return "norm" if "norm" in type(module).__name__.lower() else "weight"


def first_touch(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A parameter's memory, allocated and zeroed: zero_ first, since its parallel first touch of
    the pages is 3x faster than the fill's (the load bench times this step alone as the touch)."""
    return torch.empty(shape, dtype=dtype, device=device).zero_()


@dataclass
class InitReport:
    params: int  # of the whole model
    bytes: int  # allocated here: less than the whole where weights were deferred
    seconds: float


# (module path, module, parameter name) -> True where the parameter is left as a placeholder, for
# its rank's slice to be filled later (models/deferred.py)
DeferWhere = Callable[[str, nn.Module, str], bool]


def materialize_random(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    std: float,
    progress: bool = True,
    defer: DeferWhere | None = None,
    deferred: DeferredWeights | None = None,
) -> InitReport:
    """Replace each meta parameter by a real, seeded random one; tied parameters stay tied. Where
    `defer` says so, by a placeholder that `deferred` can fill later, whole or a slice, with the
    values it would have had here (the parameter's generator seed is its index among all of them)."""
    start = time.perf_counter()
    owners = parameter_owners(model)
    total = sum(p.numel() for _, _, _, p in owners)
    bar = _progress(total, progress)
    materialized: dict[int, nn.Parameter] = {}  # id(meta param) -> real param, so tied weights stay one
    bound = std * 3**0.5  # U(-b, b) has standard deviation b / sqrt(3)
    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
        for path, module, name, param in owners:
            if id(param) not in materialized:
                kind, param_seed = _kind(module, name), chunk_seed(seed, len(materialized))
                if defer is not None and deferred is not None and defer(path, module, name):
                    recipe = Recipe(
                        f"{path}.{name}".lstrip("."),
                        tuple(param.shape),
                        dtype,
                        device,
                        kind=kind,
                        seed=param_seed,
                        bound=bound,
                    )
                    materialized[id(param)] = deferred.placeholder(recipe)
                else:
                    real = first_touch(param.shape, dtype, device)
                    _fill(kind, real, bound, param_seed, pool)
                    materialized[id(param)] = nn.Parameter(real, requires_grad=False)
                bar.update(param.numel())
            module._parameters[name] = materialized[id(param)]
    bar.close()
    unique = list(materialized.values())
    return InitReport(
        params=sum(p.numel() for p in unique),
        bytes=sum(p.untyped_storage().nbytes() for p in unique),
        seconds=time.perf_counter() - start,
    )


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    # Only worth a bar when the fill takes seconds (100 M parameters: under a second).
    return tqdm(
        total=total,
        unit="param",
        unit_scale=True,
        desc="init weights",
        disable=not enabled or total < 100_000_000,
        leave=False,
    )


def parameter_owners(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(module path, module, name, parameter) of every registered parameter, in module order; a
    tied parameter once per owner."""
    return [
        (path, module, name, param)
        for path, module in model.named_modules()
        for name, param in module._parameters.items()
        if param is not None
    ]


def on_meta(model_cls: type, hf_config, device: torch.device, attn_implementation: str | None) -> nn.Module:
    """The model with its parameters on the meta device (Hugging Face's initializers do nothing
    there) and its buffers, built real in float32 on CPU (the rotary tables), moved to device."""
    with parameters_on_meta():
        model = model_cls._from_config(hf_config, attn_implementation=attn_implementation)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    return model


def build_random(
    model_cls: type,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    attn_implementation: str | None = None,
    defer: DeferWhere | None = None,
    deferred: DeferredWeights | None = None,
) -> tuple[nn.Module, InitReport]:
    model = on_meta(model_cls, hf_config, device, attn_implementation)
    std = getattr(getattr(hf_config, "text_config", None) or hf_config, "initializer_range", 0.02)
    report = materialize_random(model, dtype, device, seed, std, defer=defer, deferred=deferred)
    model.eval()
    return model, report
