"""The device and dtype a run uses, and the few device operations every package needs the same way."""

from __future__ import annotations

import gc

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock reads the work's end (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    """Let go of compiled code and cached device memory: Dynamo's caches keep compiled graphs (and
    the weights they close over) alive, so a failed capture, or the next job of a sweep in the same
    process, would otherwise find the memory still taken."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
