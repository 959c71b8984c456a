"""Images through cross-attention: a family whose language model reads the vision states in
cross-attention layers (its forward takes `cross_attention_states` and `cross_attention_mask`, as
Mllama's does) instead of embedding image tokens in the prompt.

Such a prompt holds one image token per image; which images each token attends comes from the
family's processor code (`get_cross_attention_token_mask` and
`convert_sparse_cross_attention_mask_to_dense` of the processor module transformers maps the
model type to): [P, images, tiles], 1 where a token attends a tile. The model expands it over each
tile's vision states and turns it additive; a row that attends nothing (the text before the first
image) attends all of its sequence's states evenly, with its MLP output zeroed
(`full_text_row_masked_out_mask`). Generation repeats the prompt's last row for each new token.

The captured graph takes the cross-attention keys and values as inputs (insert_cached_attention
splits out the nodes that make them of the states: `make_kv`). demollm packs several sequences
into one step [1, T] (runtime/executors.py) and lays the inputs out itself (`packed_inputs`): every
sequence's keys and values, made once per request, side by side behind the zero states', a
block-diagonal additive mask, and each token's row mask. A sequence without images attends only
the zero states, whose keys and values are zero (k_proj and v_proj have no bias, and k_norm of zero
is zero), so its cross-attention adds nothing and its MLP is zeroed: what the model computes when
it skips the layer for a text call. A call without images gets the same (graphs.VisionInput).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError

STATES = "cross_attention_states"  # [B, N, H] as the graph is exported with: N states per sequence
MASK = "cross_attention_mask"  # the model's input [B, S, images, tiles]; the graph's [B, 1, S, N]
ROWS = "full_text_row_masked_out_mask"  # [B, 1, S, 1]: 1 where the token attends some state
# States a sequence without images attends, all zero. Two, not one: export specializes a state
# count of 1 (a size of 1 broadcasts), so the graph takes any count but 1.
ZERO_STATES = 2


@functools.cache
def _takes(model_cls: type) -> bool:
    parameters = inspect.signature(model_cls.forward).parameters
    return STATES in parameters and MASK in parameters


def takes_vision_states(model_or_cls) -> bool:
    """Whether images reach this model's language model through cross-attention."""
    cls = model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)
    return _takes(cls)


def _processing_functions(model_type: str):
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    module = (
        importlib.import_module(getattr(transformers, name).__module__)
        if hasattr(transformers, name or "")
        else None
    )
    token_mask = getattr(module, "get_cross_attention_token_mask", None)
    dense = getattr(module, "convert_sparse_cross_attention_mask_to_dense", None)
    if token_mask is None or dense is None:
        raise ConfigError(
            f"model_type={model_type} cross-attends images, and its processor in transformers ({name}) has "
            "no cross-attention mask functions to say which images each token attends; give text-only "
            "prompt.queries"
        )
    return token_mask, dense


def token_mask(model_type: str, prompt: list[int], image_token: int, tiles: list[int], max_tiles: int):
    """[P, images, max_tiles] int64: which tiles of which image each prompt token attends, as the
    family's processor computes it (tiles: each image's real tile count)."""
    sparse, dense = _processing_functions(model_type)
    spans = sparse(prompt, image_token)
    if len(spans) != len(tiles):
        raise ValueError(f"{len(spans)} image tokens in the prompt for {len(tiles)} images")
    return torch.from_numpy(dense([spans], [tiles], max_tiles, len(prompt)))[0]


def tile_counts(pixels: dict[str, torch.Tensor]) -> tuple[list[int], int]:
    """(each image's real tiles, the tiles an image is padded to) of one sequence's pixel tensors:
    aspect_ratio_mask [1, images, max_tiles] marks the real ones."""
    mask = pixels["aspect_ratio_mask"][0]
    return [int(n) for n in mask.sum(-1).tolist()], int(mask.shape[-1])


def graph_states(states: torch.Tensor, batch: int) -> torch.Tensor:
    """The model's vision states [B * images * tiles, patches, H] as its cross-attention reads them
    (`view(B, -1, ...)`): [B, N, H], N = images * tiles * patches, the graph's layout."""
    return states.reshape(batch, -1, states.shape[-1])


def expand_rows(rows: torch.Tensor, states_per_tile: int) -> torch.Tensor:
    """[T, images, tiles] 0/1 -> [T, N] bool over each tile's states, as the model expands it."""
    return rows.repeat_interleave(states_per_tile, dim=-1).reshape(rows.shape[0], -1).bool()


def make_kv(record, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The cross-attention keys and values of a graph (GraphRecord.cross_kv, split out by
    insert_cached_attention) made of its vision inputs in graph form: [B, Hkv, N, D] each."""
    names = [n.target for n in record.cross_kv.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        return tuple(record.cross_kv(**{name: inputs[name] for name in names}))


def sequence_kv(record, states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One sequence's keys and values of its states [N, H], as one call of one token makes them."""
    ones = states.new_ones(1, 1, 1, 1)
    return make_kv(
        record, {STATES: states[None], MASK: states.new_zeros(1, 1, 1, states.shape[0]), ROWS: ones}
    )


@dataclass
class SequenceStates:
    """One sequence's cross-attention keys and values and prompt mask, kept for every step it runs in."""

    kv: tuple[torch.Tensor, ...]  # per graph input of GraphRecord.cross_kv_inputs: [1, Hkv, N, D]
    rows: torch.Tensor | None  # [P, N] bool: which states each prompt token attends; None: the zero states

    def step_rows(self, start: int, end: int, decode: bool) -> torch.Tensor:
        """The mask rows of prompt tokens [start, end), or of one generated token (the prompt's
        last row, as generation repeats it)."""
        return self.rows[-1:] if decode else self.rows[start:end]


def packed_inputs(
    pieces: list[tuple[SequenceStates | None, torch.Tensor | None, int]],
    zero: SequenceStates,
    names: list[str],
    dtype,
    device,
) -> dict[str, torch.Tensor]:
    """The graph's cross-attention inputs for one packed step. pieces: per sequence in step order,
    (its keys and values or None, its rows [n, N] or None, its token count n); zero: the keys and
    values of the zero states; names: the graph inputs the keys and values go to."""
    blocks = [zero, *(s for s, _, _ in pieces if s is not None)]
    kv = [torch.cat([b.kv[i] for b in blocks], dim=2) for i in range(len(names))]  # [1, Hkv, Z + ΣN, D]
    total, tokens = kv[0].shape[2], sum(n for *_, n in pieces)
    allowed = torch.zeros(tokens, total, dtype=torch.bool, device=device)  # [T, Z + ΣN]
    attends = torch.zeros(tokens, dtype=dtype, device=device)  # [T]
    row, column = 0, ZERO_STATES
    for sequence, rows, n in pieces:
        if sequence is None:
            allowed[row : row + n, :ZERO_STATES] = True  # zero keys and values: nothing added
        else:
            width = sequence.kv[0].shape[2]
            rows = rows.to(device)
            some = rows.any(-1)  # [n]; a row that attends nothing attends all its states evenly
            allowed[row : row + n, column : column + width] = rows | ~some[:, None]
            attends[row : row + n] = some.to(dtype)
            column += width
        row += n
    mask = torch.zeros(tokens, total, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
    return {
        **dict(zip(names, kv, strict=True)),
        MASK: mask[None, None],  # [1, 1, T, Z + ΣN]
        ROWS: attends[None, None, :, None],  # [1, 1, T, 1]
    }
