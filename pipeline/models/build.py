"""Build a Hugging Face model fast with random weights: parameters on the meta device, then filled
directly (checkpoints load in checkpoint.py).

Hugging Face's own random init runs every module's initializer on real memory (about 50 s for the
default mistral3 configuration here). Building with parameters on meta skips that; buffers stay
real so the rotary `inv_freq` tables are computed as usual. Then every parameter is allocated once
at the target dtype and device and filled in parallel chunks, each from a generator seeded by
(seed, parameter index, chunk index): the same seed gives the same weights on any thread count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn


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


_CHUNK = 1 << 22  # elements per independently seeded chunk: fixed, so weights never depend on threads


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


def _fill_uniform(flat: torch.Tensor, bound: float, seed: int, pool: ThreadPoolExecutor) -> None:
    """U(-bound, bound) in parallel chunks, each from its own generator seeded by (seed, chunk).

    A CPU generator fills single-threaded (about 180 M/s with first-touch page faults); chunks on
    a thread pool use every core, and the chunk seeds keep the result independent of the pool size.
    """

    def fill_chunk(index: int) -> None:
        generator = torch.Generator(device=flat.device).manual_seed(chunk_seed(seed, index))
        flat[index * _CHUNK : (index + 1) * _CHUNK].uniform_(-bound, bound, generator=generator)

    list(pool.map(fill_chunk, range((flat.numel() + _CHUNK - 1) // _CHUNK)))


def _fill(kind: str, tensor: torch.Tensor, std: float, seed: int, pool: ThreadPoolExecutor) -> None:
    # Norm scales at one and biases at zero keep activations at a sane scale through the layers;
    # everything else (linears, embeddings, experts, convs) is uniform with the config's
    # initializer_range as standard deviation: uniform_ runs about 3x faster than normal_ here, and
    # a uniform init is what PyTorch itself uses for nn.Linear.
    if kind == "bias":
        tensor.zero_()
    elif kind == "norm":
        tensor.fill_(1.0)
    else:
        bound = std * 3**0.5  # U(-b, b) has standard deviation b / sqrt(3)
        _fill_uniform(tensor.view(-1), bound, seed, pool)


def _kind(module: nn.Module, name: str) -> str:
    if name == "bias" or name.endswith("_bias"):
        return "bias"
    return "norm" if "norm" in type(module).__name__.lower() else "weight"


@dataclass
class InitReport:
    params: int
    bytes: int
    seconds: float


def materialize_random(
    model: nn.Module, dtype: torch.dtype, device: torch.device, seed: int, std: float, progress: bool = True
) -> InitReport:
    """Replace each meta parameter by a real, seeded random one; tied parameters stay tied."""
    start = time.perf_counter()
    owners = [
        (module, name, param) for module in model.modules() for name, param in module._parameters.items()
    ]
    total = sum(p.numel() for _, _, p in owners if p is not None)
    bar = _progress(total, progress)
    materialized: dict[int, nn.Parameter] = {}  # id(meta param) -> real param, so tied weights stay one
    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
        for module, name, param in owners:
            if param is None:
                continue
            if id(param) not in materialized:
                # zero_ first: its parallel first touch of the pages is 3x faster than the fill's.
                real = torch.empty(param.shape, dtype=dtype, device=device).zero_()
                _fill(_kind(module, name), real, std, chunk_seed(seed, len(materialized)), pool)
                materialized[id(param)] = nn.Parameter(real, requires_grad=False)
                bar.update(param.numel())
            module._parameters[name] = materialized[id(param)]
    bar.close()
    unique = list(materialized.values())
    return InitReport(
        params=sum(p.numel() for p in unique),
        bytes=sum(p.numel() * p.element_size() for p in unique),
        seconds=time.perf_counter() - start,
    )


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    # Only worth a bar when the fill takes seconds (100 M parameters: about half a second here).
    return tqdm(
        total=total,
        unit="param",
        unit_scale=True,
        desc="init weights",
        disable=not enabled or total < 100_000_000,
        leave=False,
    )


def build_random(
    model_cls: type,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    attn_implementation: str | None = None,
) -> tuple[nn.Module, InitReport]:
    with parameters_on_meta():
        model = model_cls._from_config(hf_config, attn_implementation=attn_implementation)
    # Buffers (rotary tables) were built in float32 on CPU; move them, keeping their dtype.
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    std = getattr(getattr(hf_config, "text_config", None) or hf_config, "initializer_range", 0.02)
    report = materialize_random(model, dtype, device, seed, std)
    model.eval()
    return model, report
