"""A tokenizer and chat template only ever come from a local checkpoint folder (nothing is downloaded).

The chat template is where Hugging Face keeps it: `chat_template.jinja` (read by the tokenizer
itself), `chat_template` in tokenizer_config.json, or in the older places `chat_template.json` and
processor_config.json, which the tokenizer does not read and this module does.
"""

from __future__ import annotations

import json
from pathlib import Path

_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tekken.json")


def has_tokenizer(checkpoint: str | None) -> bool:
    return bool(checkpoint) and any((Path(checkpoint) / name).is_file() for name in _FILES)


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def chat_template_of(checkpoint: str | None) -> str | None:
    """The folder's chat template text, wherever it keeps it; None when it has none."""
    if not checkpoint:
        return None
    folder = Path(checkpoint)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("tokenizer_config.json", "chat_template.json", "processor_config.json"):
        template = _json(folder / name).get("chat_template")
        if isinstance(template, str) and template:
            return template
    return None


def load_tokenizer(checkpoint: str | None):
    if not has_tokenizer(checkpoint):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    if not tokenizer.chat_template and (template := chat_template_of(checkpoint)):
        tokenizer.chat_template = template
    return tokenizer
