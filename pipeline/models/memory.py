"""Will the model fit? Parameters counted on the meta device (meta.py), bytes at the run's dtype,
plus the default KV cache, against what the device has free: refused before loading, with the
estimate and what would fit."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.config import RuntimeConfig
from pipeline.errors import ConfigError
from pipeline.graphs import eager_graphs

HEADROOM = 1.1  # activations, the transient copy when GEMMs are fused, allocator slack


def human_count(n: int) -> str:
    """2.89 B, 210.24 K: parameter counts as people say them."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def human_bytes(n: float) -> str:
    """5.86 GiB, 0.52 MiB: sizes of weights."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def decode_weights(model: torch.nn.Module, lm_path: str) -> list[torch.Tensor]:
    """Weights one decode step reads: the language model's decoder layers and final norm and the
    lm_head; not the input embedding (a step reads B of its rows) nor a vision tower. A mixture of
    experts counts every expert (a batch can route to all). On the eager model, or once export
    swapped the language model for its graph: then the graph's (fused weights included, and on a
    tensor-parallel rank its shards)."""
    decoder, head = decoder_and_head(model, lm_path)
    return decoder + head


def decoder_and_head(model: torch.nn.Module, lm_path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """decode_weights split in two: the decoder's, which every prompt token multiplies in a prefill,
    and the lm_head's, which a prefill runs on the last token only."""
    with eager_graphs(model) as eager:  # Hugging Face's accessors walk into the eager modules
        embedding = {id(p) for p in eager.get_input_embeddings().parameters()}
        head = list(eager.get_output_embeddings().parameters())
    lm = model.get_submodule(lm_path) if lm_path else model
    skipped = embedding | {id(p) for p in head}
    decoder = {id(p): p for p in lm.parameters() if id(p) not in skipped}
    return list(decoder.values()), head  # a head tied to the embedding is read whole all the same


def decode_weight_bytes(model: torch.nn.Module, lm_path: str) -> int:
    return sum(p.numel() * p.element_size() for p in decode_weights(model, lm_path))


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def kv_cache_bytes(hf_config, runtime: RuntimeConfig, dtype: torch.dtype) -> int:
    text = getattr(hf_config, "text_config", None) or hf_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if runtime.kv_cache_mb:
        return int(runtime.kv_cache_mb * 2**20)
    tokens = runtime.max_batch_size * runtime.max_seq_len
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads  # HF's default
    return 2 * text.num_hidden_layers * kv_heads * head_dim * tokens * dtype.itemsize


def weight_copies(runtime: RuntimeConfig, device: torch.device, tp_weights: str | None = None) -> float:
    """How many whole models' weights one memory holds under tensor parallelism. A rank with
    runtime.tp_weights=whole holds the whole model beside its slices (1 + 1/N); with shard, its
    slices (1/N; the replicated embedding, norms and vision tower put it a little above). A GPU
    holds one rank's; a CPU host every rank's. `tp_weights` in place of the runtime's: what the
    other mode would hold."""
    world = runtime.world_size
    if world <= 1:
        return 1.0
    per_rank = 1 / world if (tp_weights or runtime.tp_weights) == "shard" else 1 + 1 / world
    return per_rank if device.type == "cuda" else per_rank * world


def needed_bytes(
    params: int, hf_config, runtime: RuntimeConfig, dtype: torch.dtype, copies: float = 1.0
) -> float:
    """Weights at `dtype` (`copies` of them), the default KV cache and the headroom: what a load
    needs free."""
    return (params * dtype.itemsize * copies + kv_cache_bytes(hf_config, runtime, dtype)) * HEADROOM


def auto_dtype(params: int, hf_config, runtime: RuntimeConfig, device) -> tuple[torch.dtype, str | None]:
    """dtype=auto: bfloat16 on CUDA; on CPU float32, or bfloat16 (with a note saying so) when only
    that fits the free memory. params: counted on the meta device (models/meta.py)."""
    if device.type == "cuda":
        return torch.bfloat16, None
    free = free_bytes(device)
    need = needed_bytes(params, hf_config, runtime, torch.float32)
    if need <= free or needed_bytes(params, hf_config, runtime, torch.bfloat16) > free:
        return torch.float32, None
    return torch.bfloat16, (
        f"dtype=auto chose bfloat16: float32 would need about {need / 1e9:.1f} GB and "
        f"{free / 1e9:.1f} GB is free (dtype=float32 to insist)"
    )


def check_fits(
    params: int,
    hf_config,
    runtime: RuntimeConfig,
    model_name: str,
    dtype: torch.dtype,
    device,
    shard_fix: str = "runtime.tp_weights=shard",
) -> None:
    """ConfigError when the load would not fit, naming each change that would. shard_fix: the
    overrides that turn on runtime.tp_weights=shard in this config (with what it refuses, e.g. the
    eager profile reference, turned off)."""
    copies = weight_copies(runtime, device)
    need = needed_bytes(params, hf_config, runtime, dtype, copies)
    free = free_bytes(device)
    if need > free:
        # every change that would fit, with what it would need
        fixes = []
        if dtype.itemsize > 2:
            fixes.append(("dtype=bfloat16", torch.bfloat16, copies))
        if runtime.world_size > 1 and runtime.tp_weights == "whole":
            slices = weight_copies(runtime, device, "shard")
            fixes.append((shard_fix, dtype, slices))  # each rank only its slices
            if dtype.itemsize > 2:
                fixes.append((f"dtype=bfloat16 {shard_fix}", torch.bfloat16, slices))
        fitting = [
            f"{fix} (about {fix_need / 1e9:.1f} GB)"
            for fix, fix_dtype, fix_copies in fixes
            if (fix_need := needed_bytes(params, hf_config, runtime, fix_dtype, fix_copies)) <= free
        ]
        hint = (
            " or ".join(fitting[:2])  # the pair of both changes shows only where one alone does not fit
            or "fewer layers (model.model_kwargs...num_hidden_layers) or a smaller runtime.kv_cache_mb"
        )
        ranks = (
            f", {copies:.2g}x the weights for {runtime.world_size} ranks with runtime.tp_weights={runtime.tp_weights}"
            if copies != 1
            else ""
        )
        raise ConfigError(
            f"model={model_name} needs about {need / 1e9:.1f} GB ({params / 1e9:.2f} B parameters in "
            f"{str(dtype).removeprefix('torch.')}{ranks} + KV cache), and {device.type} has {free / 1e9:.1f} GB "
            f"free; use {hint}"
        )


def piecewise_pool_bytes(hf_config, buckets: list[int], dtype: torch.dtype, capture_head: bool) -> int:
    """What piecewise capture's CUDA graph pool holds (backends/piecewise.py), estimated before the
    run: every bucket's segment outputs stay allocated (per layer and token: q, k and v, the
    attention output's capture buffer, the residual and the hidden states), one layer's MLP
    activations at the largest bucket are the temporaries all captures share, and with the head
    captured every bucket's logits."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads  # HF's default when absent
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    per_token = text.num_hidden_layers * ((2 * heads + 2 * kv_heads) * head_dim + 2 * text.hidden_size)
    if capture_head:
        per_token += text.vocab_size
    return (sum(buckets) * per_token + max(buckets) * 3 * intermediate) * dtype.itemsize


def check_piecewise_fits(
    params: int, hf_config, runtime: RuntimeConfig, buckets: list[int], capture_head: bool, dtype, free: int
) -> None:
    """ConfigError when the weights, the KV cache and the piecewise pool would not fit `free` bytes."""
    pool = piecewise_pool_bytes(hf_config, buckets, dtype, capture_head)
    need = needed_bytes(params, hf_config, runtime, dtype) + pool
    if need <= free:
        return
    fewer = buckets[: max(1, len(buckets) // 2)]
    raise ConfigError(
        f"backend.piecewise=true: the CUDA graph pool for token buckets {buckets} is about {pool / 1e9:.1f} GB "
        f"(about {need / 1e9:.1f} GB with the weights and KV cache), and the device has {free / 1e9:.1f} GB "
        f"free; use fewer or smaller buckets (backend.piecewise_tokens=[{','.join(map(str, fewer))}]), "
        "a smaller runtime.max_num_tokens, or backend.piecewise=false"
    )
