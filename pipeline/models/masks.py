"""Which tokens a model attends both ways, as its own mask function does.

Most decoders are causal. Two families mark spans of the prompt, through the `token_type_ids` their
processor returns, that attend to each other both ways (the or-mask Hugging Face adds to the causal
one from `block_sequence_ids`):
- PaliGemma: the whole prompt (image and text) is the prefix, type 0, one block; generated tokens
  (the suffix) are causal (`PaliGemmaModel.forward`: `torch.where(token_type_ids == 0, 0, -1)`).
- Gemma 3: each run of image tokens, type 1, a block of its own (`get_block_sequence_ids_for_mask`);
  the begin/end-of-image tokens around it are text.
A sliding window still bounds a block from below (Gemma 3's `AND(sliding_window, OR(causal,
blockwise))`), as do attention chunks.

The cached attention takes, per new token, the [start, end) of its block (`token_block`, [T, 2];
(0, 0) for a causal token): it sees its causal history and its block. Three sources give the same
blocks: a request's spans (the runtime), the mask Hugging Face built for a call (what the language
model received: two tokens share a block when each sees the other), and the `token_type_ids` of a
call of the whole model.
"""

from __future__ import annotations

import torch

BIDIRECTIONAL = {"paligemma": "prompt", "gemma3": "image runs"}


def attention_options(hf_config) -> dict[str, str]:
    """What a cached attention must do for this model beyond causal attention over its cache:
    option -> the config that asks for it (attention.SUPPORTS names which backends can)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    types = set(getattr(text, "layer_types", None) or [])
    options = {}
    if "sliding_attention" in types or (not types and getattr(text, "sliding_window", None)):
        options["sliding_window"] = f"sliding_window={text.sliding_window}"
    if "chunked_attention" in types:
        options["chunked"] = f"attention_chunk_size={text.attention_chunk_size}"
    if uses_blocks(hf_config):
        options["bidirectional"] = (
            f"model_type={hf_config.model_type} attends {BIDIRECTIONAL[hf_config.model_type]} both ways"
        )
    if getattr(text, "attn_logit_softcapping", None):
        options["softcap"] = f"attn_logit_softcapping={text.attn_logit_softcapping}"
    if text.model_type in ("gpt_oss",):
        options["sinks"] = "attention sinks (per-head learned logits)"
    return options


def uses_blocks(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in BIDIRECTIONAL


def _image_token(hf_config) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        if isinstance(value := getattr(hf_config, name, None), int):
            return value
    return None


def span_past_window(hf_config, spans: list[tuple[int, int]]) -> str | None:
    """Where the cached attention's rule would differ from the family's: PaliGemma 2 ORs its prefix
    with the sliding-window mask (a prefix token sees the whole prefix however far), where the cached
    attention bounds a block by the window (Gemma 3's rule); the two agree while the prefix fits in
    the window."""
    text = getattr(hf_config, "text_config", None) or hf_config
    window = getattr(text, "sliding_window", None)
    if BIDIRECTIONAL.get(hf_config.model_type) != "prompt" or not window:
        return None
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ["sliding_attention"]):
        return None
    longest = max((end - start for start, end in spans), default=0)
    if longest <= window:
        return None
    return (
        f"its {longest}-token prefix, attended both ways, is longer than the sliding window ({window}), "
        "past which the cached attention would bound it where the model does not"
    )


def token_type_ids(hf_config, prompt: list[int]) -> list[int] | None:
    """What the family's processor returns with a prompt (no suffix yet); None for a family whose
    mask takes none."""
    kind = BIDIRECTIONAL.get(hf_config.model_type)
    if kind == "prompt":
        return [0] * len(prompt)
    if kind == "image runs":
        image = _image_token(hf_config)
        return [int(token == image) for token in prompt]
    return None


def bidirectional_spans(hf_config, prompt: list[int]) -> list[tuple[int, int]]:
    """[start, end) spans of a prompt the model attends both ways."""
    kind = BIDIRECTIONAL.get(hf_config.model_type)
    if kind == "prompt":
        return [(0, len(prompt))] if prompt else []
    if kind == "image runs":
        image = _image_token(hf_config)
        return _runs([token == image for token in prompt])
    return []


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive True."""
    spans, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


def token_blocks(spans: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """For sequence positions [start, end): each one's block, (0, 0) outside every span."""
    blocks = [(0, 0)] * (end - start)
    for span_start, span_end in spans:
        for i in range(max(start, span_start), min(end, span_end)):
            blocks[i - start] = (span_start, span_end)
    return blocks


def blocks_from_mask(mask) -> torch.Tensor | None:
    """The blocks a mask Hugging Face built encodes: [B, S, 2], or None for a causal one.
    mask: [B, 1, S, S] bool (True = attend) or additive (0 = attend), or a dict of them per layer
    type (Gemma 3), of which a full-attention one is read (a window may cut a block's pairs)."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention", next((m for m in mask.values() if m is not None), None))
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    seen = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B, S, S]
    mutual = seen & seen.transpose(-1, -2)
    index = torch.arange(mutual.shape[-1], device=mask.device)
    mutual &= index[:, None] != index[None, :]  # a token with itself says nothing
    if not mutual.any():
        return None
    # start: the first mutual key (or the token), end: one past the last; (0, 0) where none
    first = torch.where(mutual, index, mutual.shape[-1]).amin(-1).clamp(max=index)
    last = torch.where(mutual, index, -1).amax(-1).clamp(min=index) + 1
    has = mutual.any(-1)
    return torch.stack([torch.where(has, first, 0), torch.where(has, last, 0)], dim=-1)


def spans_from_token_types(hf_config, types: list[int]) -> list[tuple[int, int]]:
    """[start, end) spans attended both ways, from the token_type_ids of one sequence (the
    processor's, or a whole-model call's)."""
    if BIDIRECTIONAL.get(hf_config.model_type) == "prompt":  # the prefix: type 0 up to the suffix
        return _runs([True] * next((i for i, t in enumerate(types) if t != 0), len(types)))
    return _runs([t == 1 for t in types])


def blocks_from_token_types(hf_config, token_types: torch.Tensor) -> torch.Tensor:
    """[B, S] token_type_ids of a whole-model call -> [B, S, 2] blocks."""
    rows = []
    for types in token_types.tolist():
        rows.append(token_blocks(spans_from_token_types(hf_config, types), 0, len(types)))
    return torch.tensor(rows, dtype=torch.long, device=token_types.device).reshape(*token_types.shape, 2)
