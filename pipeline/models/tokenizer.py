"""A tokenizer only ever comes from a local checkpoint folder (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tekken.json")


def has_tokenizer(checkpoint: str | None) -> bool:
    return bool(checkpoint) and any((Path(checkpoint) / name).is_file() for name in _FILES)


def load_tokenizer(checkpoint: str | None):
    if not has_tokenizer(checkpoint):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
