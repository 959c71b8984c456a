"""Hugging Face model folders as users have them, built offline from the tiny configs: weights saved
by Hugging Face's own `save_pretrained` in small safetensors shards with an index, and the family's
tokenizer, chat template, image processor and Processor as pipeline/models/families.py builds them
for the config. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.models.families import (
    PROCESSOR_KWARGS,
    build_image_processor,
    build_tokenizer,
    family_processor,
)


def save_checkpoint(
    model: torch.nn.Module, folder: Path, shard: str = "40KB", dtype=None, tokenizer: bool = True
) -> Path:
    """model (and its tokenizer, chat template and processor) as a Hugging Face model folder, in
    safetensors shards of at most `shard` with model.safetensors.index.json. tokenizer=False: the
    weights and config alone (families with no tokenizer layout here)."""
    folder.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, max_shard_size=shard)
    if not tokenizer:
        return folder
    config = model.config
    tokenizer = build_tokenizer(config)
    processor = build_image_processor(config)
    tokenizer.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    if config.model_type in PROCESSOR_KWARGS:
        family_processor(config, tokenizer, processor).save_pretrained(folder)
    return folder
