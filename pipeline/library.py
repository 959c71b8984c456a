"""The `pipeline` torch.library namespace: every op this project registers goes through `op`.

Why not `torch.library.custom_op`: it registers the same dispatcher op, but runs every call through
a Python wrapper (autograd, aliasing and mutation checks) that cost 6 us a call for a one-argument
op and about 65 us for the fourteen-argument cached attention op on this machine, against 2 us
through a plain `torch.library.Library` registration. On the small benchmark configuration that was
about 0.3 ms of a 4.6 ms decode step. The ops are for inference: they have no autograd formula.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

LIBRARY = torch.library.Library("pipeline", "FRAGMENT")
REFERENCES: dict[str, Callable] = {}  # ops with a CUDA kernel: name -> its reference implementation


def op(name: str, schema: str | None = None, cuda: Callable | None = None):
    """Register the decorated function as `pipeline::<name>` for every device, and `cuda` (when
    given) in its place for CUDA tensors; returns the op (`torch.ops.pipeline.<name>.default`). The
    schema is inferred from the type hints (no argument mutated) unless given, as the cached
    attention ops give theirs (they write the KV cache)."""

    def register(impl: Callable) -> torch._ops.OpOverload:
        LIBRARY.define(name + (schema or torch.library.infer_schema(impl, mutates_args=())))
        LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        if cuda is not None:
            LIBRARY.impl(name, cuda, "CUDA")
            REFERENCES[name] = impl
        return getattr(torch.ops.pipeline, name).default

    return register


def fake(name: str):
    """Register the decorated function as `pipeline::<name>`'s fake kernel (shapes for tracing)."""
    return torch.library.register_fake(f"pipeline::{name}", lib=LIBRARY)


@contextlib.contextmanager
def references_on_cuda() -> Iterator[None]:
    """Inside, CUDA tensors take the ops' reference implementations (chains of aten kernels) in
    place of their CUDA kernels; the kernels are back on exit. For the benchmark's A/B of them."""
    with kernels_replaced(REFERENCES, "CUDA"):
        yield


@contextlib.contextmanager
def kernels_replaced(impls: dict[str, Callable], dispatch_key: str) -> Iterator[None]:
    """Inside, `pipeline::<name>` runs impls[name] for tensors of the dispatch key ("CPU", "CUDA");
    the registered kernels are back on exit. Captured graphs and compiled code call the ops through
    the dispatcher, so they take the replacement too."""
    with torch.library._scoped_library("pipeline", "IMPL") as overrides, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name, impl in impls.items():
            overrides.impl(name, impl, dispatch_key)
        yield
