"""How one step runs the model: two executors behind one interface (`prefill(chunks)`, `decode(requests,
ids)`, `release(request)`), each returning the logits of the rows that sample a token.

- `PagedExecutor` for a model whose captured graph has cached attention (insert_cached_attention):
  every step packs the new tokens of its sequences into one row [1, T] (prefill chunks of any
  length, or one token per sequence in decode), with explicit position ids, and binds the paged
  KV cache and the step's sequence metadata to the graph's inputs (and, for a family whose prompt
  spans attend both ways, each token's block from its request: models/masks.py; for one that
  cross-attends vision states, each request's cross-attention keys and values, made in its first
  step, with the step's block-diagonal mask: models/cross_attention.py). The eager parts (vision
  tower, image merging, lm_head) run as HF wrote them.
- `EagerExecutor` for `capture=none`: the HF model with its own attention and DynamicCache, a wave
  of whole prompts left-padded, so the eager baseline runs through the same loop and timers; the
  prefill gets the token_type_ids (or cross-attention mask) the family's processor would give, so
  HF builds the same mask.
Both pass positions as the model counts them (from 1 for PaliGemma: models/probe.py).
"""

from __future__ import annotations

import inspect
import itertools

import torch
from torch import fx, nn

from pipeline.attention.kv_cache import PagedKVCache, pages_for
from pipeline.config import RuntimeConfig
from pipeline.graphs import find_language_models, range_name, record_of
from pipeline.models import cross_attention, image_mask, masks, probe, vision_experts
from pipeline.models.images import concat_pixels
from pipeline.models.inputs import special_ids
from pipeline.runtime.positions import Positions
from pipeline.runtime.requests import Request
from pipeline.runtime.scheduler import Chunk


def engine_span(part: str):
    """A named range for the profiler: the engine's own work shows as `demollm.<part>` in the
    module tree instead of unattributed (a no-op when no profiler runs)."""
    return torch.profiler.record_function(range_name(f"demollm.{part}", "DemoLLM"))


def _three_rows(positions: torch.Tensor, mrope: bool) -> torch.Tensor:
    """[..., T] -> [3, ..., T] for multimodal RoPE (grid positions already have their three rows)."""
    if mrope and positions.shape[0] != 3:
        return positions[None].expand(3, *positions.shape)
    return positions


def _images(chunks: list[Chunk]) -> dict[str, torch.Tensor]:
    """The pixel tensors of the chunks that hold their request's images, in one call, in order."""
    return concat_pixels([c.request.images for c in chunks if c.has_images])


def _token_types(hf_config, request: Request) -> list[int] | None:
    """The token_type_ids of a request's prompt: its processor's, else the family's rule."""
    if "token_type_ids" in request.token_inputs:
        return request.token_inputs["token_type_ids"].tolist()
    return masks.token_type_ids(hf_config, request.prompt)


# Per-token outputs of the processor that the model reads in each prefill step: where Kosmos-2's
# image features go, which tokens ERNIE-4.5-VL sends to its vision experts. A decode step's
# generated tokens are text: the model is given none, and the graph its empty form (zeros).
PREFILL_TOKEN_INPUTS = (image_mask.MASK, vision_experts.TYPES)


def _packed(key: str, pieces: list[tuple[dict[str, torch.Tensor], int, int]]) -> torch.Tensor | None:
    """[1, T]: a packed step's values of one per-token input, each (request's token inputs, start,
    end) piece's slice of its request's (zeros for a request without it); None when all are 0."""
    if not any(key in inputs for inputs, _, _ in pieces):  # most families: no such input at all
        return None
    rows = [
        inputs[key][start:end] if key in inputs else torch.zeros(end - start, dtype=torch.long)
        for inputs, start, end in pieces
    ]
    values = torch.cat(rows)
    return values[None] if bool(values.any()) else None


def _first_with_images(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks that begin a request with images: a cross-attention family's every prompt token
    reads the request's vision states, so they are made in its first step."""
    return [c for c in chunks if c.start == 0 and c.request.images]


class PagedExecutor:
    chunked = True  # a prompt may be prefilled over several steps

    def __init__(self, model: nn.Module, graph: fx.GraphModule, hf_config, runtime: RuntimeConfig, device):
        self.model, self.graph, self.device = model, graph, device
        self.positions = Positions(model, hf_config, record_of(graph).position_offset)
        self.blocks = any(n.op == "placeholder" and n.target == "token_block" for n in graph.graph.nodes)
        specs = record_of(graph).cache_specs
        self.cache = PagedKVCache(specs, pages_for(runtime, specs), runtime.attn_page_size, device)
        self.step_inputs: dict[str, torch.Tensor] = {}
        self.eager_lm_head = not isinstance(model, fx.GraphModule)
        # a language model that cross-attends vision states: each request's, kept from its first step
        self.cross = record_of(graph).cross_kv is not None
        if cross_attention.STATES in record_of(graph).vision_inputs and not self.cross:
            raise ValueError(
                "the captured graph cross-attends vision states without their keys and values split "
                "out (insert_cached_attention), so demollm cannot keep them per request"
            )
        self.vision: dict[int, cross_attention.SequenceStates] = {}
        self.cross_zero: cross_attention.SequenceStates | None = None  # the zero states' keys and values
        self.cross_dtype = (
            record_of(graph).vision_inputs[cross_attention.STATES].leaves[0][1] if self.cross else None
        )
        self.cross_step: list[tuple[Request, int, int, bool]] = []  # (request, start, end, decode)
        self.cross_new: list[Request] = []  # requests whose pixels this step's call takes

    def prefill(self, chunks: list[Chunk]) -> torch.Tensor:
        """Each chunk's prompt tokens packed into one step -> the logits of the chunks that complete
        their prompt [C, V] (the others only fill the cache)."""
        with engine_span("step_inputs"):
            lengths = [c.end - c.start for c in chunks]
            self._reserve([c.request for c in chunks], lengths)
            ids = [t for c in chunks for t in c.request.prompt[c.start : c.end]]
            pieces = [self.positions.prompt(c.request, c.start, c.end) for c in chunks]
            if any(p.dim() == 2 for p in pieces):  # grid positions: every piece on three rows
                pieces = [_three_rows(p, True) for p in pieces]
            positions = torch.cat(pieces, dim=-1)[..., None, :]  # [1, T] or [3, 1, T]
            kwargs = {
                "input_ids": torch.tensor(ids, device=self.device)[None],  # [1, T]
                "position_ids": positions.to(self.device),
            }
            if self.cross:
                self.cross_new = [c.request for c in _first_with_images(chunks)]
                self.cross_step = [(c.request, c.start, c.end, False) for c in chunks]
                kwargs.update(concat_pixels([r.images for r in self.cross_new]))
            else:
                kwargs.update(_images(chunks))
            for key in PREFILL_TOKEN_INPUTS:
                rows = _packed(key, [(c.request.token_inputs, c.start, c.end) for c in chunks])
                if rows is not None:  # [1, T]
                    kwargs[key] = rows.to(self.device)
            ends = torch.tensor(lengths).cumsum(0) - 1
            last = ends[[i for i, c in enumerate(chunks) if c.completes]].to(self.device)  # rows to keep
            if self.blocks:  # [T, 2]: each token's bidirectional block in its sequence
                blocks = [
                    b for c in chunks for b in masks.token_blocks(c.request.bidirectional, c.start, c.end)
                ]
                self.step_inputs["token_block"] = torch.tensor(blocks).to(self.device)
        return self._run([c.request for c in chunks], lengths, kwargs, last)

    def decode(self, requests: list[Request], ids: torch.Tensor) -> torch.Tensor:
        """ids [B]: one new token per request, already on the device -> logits [B, V]."""
        with engine_span("step_inputs"):
            lengths = [1] * len(requests)
            meta = self._reserve(requests, lengths)
            # A decode token sits at its sequence's cached length (plus its grid delta): positions
            # come from the metadata already on the device, not from another host copy.
            positions = meta["cache_lens"].long() + self.positions.offset
            deltas = [self.positions.of(r)[1] for r in requests] if self.positions.mrope else []
            if any(deltas):
                positions = positions + torch.tensor(deltas).to(self.device, non_blocking=True)
            kwargs = {"input_ids": ids[None], "position_ids": positions[None]}  # [1, B]
            if self.cross:
                self.cross_new, self.cross_step = [], [(r, 0, 1, True) for r in requests]
            if self.blocks:  # generated tokens are in no block
                self.step_inputs["token_block"] = torch.zeros(
                    len(requests), 2, dtype=torch.long, device=self.device
                )
        return self._run(requests, lengths, kwargs, last=None)

    def _reserve(self, requests: list[Request], lengths: list[int]) -> dict[str, torch.Tensor]:
        seq_ids = [r.seq_id for r in requests]
        for seq_id, n in zip(seq_ids, lengths, strict=True):
            self.cache.reserve(seq_id, n)
        meta = self.cache.metadata(seq_ids, lengths, self.device)
        self.step_inputs = {**self.cache.tensors, **meta}
        return meta

    def _run(self, requests: list[Request], lengths: list[int], kwargs: dict, last: torch.Tensor | None):
        """last: the rows to keep of a packed step (None: every row, one per sequence in decode)."""
        kwargs["position_ids"] = _three_rows(kwargs["position_ids"], self.positions.mrope)
        kwargs["use_cache"] = False
        if self.eager_lm_head:  # HF's lm_head then runs on the kept rows only (0: all rows)
            kwargs["logits_to_keep"] = 0 if last is None else last
        # The graph takes this step's cache and metadata for this call only: a plain call of the
        # model after it (a check, numerics) gets fresh ones again.
        record = record_of(self.graph)
        fresh, record.runtime_inputs = record.runtime_inputs, self._step_inputs
        try:
            with torch.no_grad():
                logits = self.model(**kwargs).logits[0]  # [kept or T, V]
        finally:
            record.runtime_inputs = fresh
        with engine_span("step_outputs"):
            for request, n in zip(requests, lengths, strict=True):
                self.cache.commit(request.seq_id, n)
        return logits if self.eager_lm_head or last is None else logits[last]

    def _step_inputs(self, call: dict) -> dict[str, torch.Tensor]:
        if not self.cross:
            return self.step_inputs
        return {**self.step_inputs, **self._cross_inputs(call)}

    def _cross_inputs(self, call: dict) -> dict[str, torch.Tensor]:
        """The step's cross-attention keys and values, block-diagonal mask and row mask
        (models/cross_attention.py)."""
        with engine_span("cross_kv"):
            self._make_cross_kv(call)
        pieces = []
        for request, start, end, decode in self.cross_step:
            sequence = self.vision.get(request.seq_id)
            rows = sequence.step_rows(start, end, decode) if sequence is not None else None
            pieces.append((sequence, rows, end - start))
        names = record_of(self.graph).cross_kv_inputs
        return cross_attention.packed_inputs(pieces, self.cross_zero, names, self.cross_dtype, self.device)

    def _make_cross_kv(self, call: dict) -> None:
        """The keys and values of the zero states (once), and of each request beginning this step,
        made once of the vision states the model made of its pixels in this step's call:
        [R * images * tiles, patches, H], each request's slot [images_max * tiles * patches, H]."""
        record = record_of(self.graph)
        if self.cross_zero is None:
            hidden = record.text_config.hidden_size
            zeros = torch.zeros(
                cross_attention.ZERO_STATES, hidden, dtype=self.cross_dtype, device=self.device
            )
            self.cross_zero = cross_attention.SequenceStates(cross_attention.sequence_kv(record, zeros), None)
        if not self.cross_new:
            return
        states = call[cross_attention.STATES]
        slots = states.reshape(len(self.cross_new), -1, states.shape[-1])
        images = max(r.cross_attention_mask.shape[1] for r in self.cross_new)
        for slot, request in zip(slots, self.cross_new, strict=True):
            mask = request.cross_attention_mask  # [P, images, tiles]
            per_tile = slot.shape[0] // (images * mask.shape[-1])
            rows = cross_attention.expand_rows(mask, per_tile)  # [P, N]
            kv = cross_attention.sequence_kv(record, slot[: rows.shape[1]])
            self.vision[request.seq_id] = cross_attention.SequenceStates(kv, rows)

    def release(self, request: Request) -> None:
        self.cache.free(request.seq_id)
        self.positions.forget(request)
        self.vision.pop(request.seq_id, None)


def _image_count(request: Request) -> int:
    mask = request.cross_attention_mask
    return 0 if mask is None else int(mask.shape[1])


class EagerExecutor:
    """What Hugging Face's `generate` runs: HF's own cache and attention, a wave of whole prompts
    left-padded to the longest, as generate pads, and `logits_to_keep=1` where the model's forward
    takes it (generate's own rule, `_supports_logits_to_keep`), so the lm_head computes one row per
    sequence as demollm's does. The padded cache keeps a row per prefilled request: rows of
    finished requests are fed a token and their outputs dropped."""

    chunked = False  # whole prompts, in waves (runtime/scheduler.py)

    def __init__(self, model: nn.Module, hf_config, pad_id: int, device):
        from transformers import DynamicCache

        self.model, self.pad_id, self.device = model, pad_id, device
        self.hf_config = hf_config
        supports = getattr(model, "_supports_logits_to_keep", None)
        self.last_logits_only = {"logits_to_keep": 1} if supports is not None and supports() else {}
        lm_paths = find_language_models(model, getattr(hf_config, "text_config", None) or hf_config)
        # a plain token: a model that counts its own positions skips padding (Kosmos-2's)
        special = special_ids(hf_config) | {pad_id}
        plain = next(i for i in itertools.count() if i not in special)
        offset = probe.first_position(
            model, lm_paths[0] if len(lm_paths) == 1 else "", torch.tensor([[plain]], device=device)
        )
        self.positions = Positions(model, hf_config, offset)
        self.cache_cls = DynamicCache
        self.cache = None
        # transformers renamed the forward's past_key_values to cache (the old name warns)
        self.cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.mask: torch.Tensor | None = None  # [B, S] of every prefilled row
        self.rows: dict[int, int] = {}  # seq_id -> its row
        self.deltas: torch.Tensor | None = None  # [B, 1]: each row's grid-position delta
        self.ids: torch.Tensor | None = None  # [B]: each row's last fed token
        # Mllama: [B, 1, images, tiles], the tiles each row's new token attends (its prompt's last row,
        # as generate repeats it); None for a text wave
        self.cross_rows: torch.Tensor | None = None
        if cross_attention.takes_vision_states(model):
            self.wave_key = _image_count

    def prefill(self, chunks: list[Chunk]) -> torch.Tensor:
        requests = [c.request for c in chunks]
        with engine_span("step_inputs"):
            width = max(len(r.prompt) for r in requests)
            ids = torch.tensor([[self.pad_id] * (width - len(r.prompt)) + r.prompt for r in requests])
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in requests])
            self.cache, self.mask = self.cache_cls(config=self.model.config), mask.to(self.device)
            self.rows = {r.seq_id: row for row, r in enumerate(requests)}
            self.ids = torch.full((len(requests),), self.pad_id, device=self.device)
            grids = [self.positions.of(r) for r in requests]
            self.deltas = torch.tensor([[delta] for _, delta in grids]).to(self.device)  # [B, 1]
            kwargs = {"input_ids": ids.to(self.device), **_images(chunks)}
            self.cross_rows = None
            if requests[0].cross_attention_mask is not None:  # a wave of one image count (wave_key)
                padded = torch.stack(
                    [
                        torch.nn.functional.pad(
                            r.cross_attention_mask, (0, 0, 0, 0, width - len(r.prompt), 0)
                        )
                        for r in requests
                    ]
                ).to(self.device)  # [B, W, images, tiles], left-padded with rows that attend nothing
                kwargs["cross_attention_mask"] = padded
                self.cross_rows = padded[:, -1:]
            for key in PREFILL_TOKEN_INPUTS:
                rows = _packed(key, [(r.token_inputs, 0, len(r.prompt)) for r in requests])
                if rows is not None:  # [B, W], left-padded as the ids
                    kwargs[key] = torch.stack(
                        [
                            torch.nn.functional.pad(row, (width - len(row), 0))
                            for row in rows[0].split([len(r.prompt) for r in requests])
                        ]
                    ).to(self.device)
            types = [_token_types(self.hf_config, r) for r in requests]
            if types[0] is not None:  # left-padded as the ids; pads are masked out anyway
                kwargs["token_type_ids"] = torch.tensor(
                    [[0] * (width - len(t)) + t for t in types], device=self.device
                )
            if any(grid is not None for grid, _ in grids):  # [3, B, W], left-padded with position 0
                kwargs["position_ids"] = torch.stack(
                    [
                        torch.nn.functional.pad(
                            _three_rows(self.positions.prompt(r, 0, len(r.prompt)), True),
                            (width - len(r.prompt), 0),
                        )
                        for r in requests
                    ],  # fmt: skip
                    dim=1,
                ).to(self.device)
        return self._run(kwargs, width)

    def decode(self, requests: list[Request], ids: torch.Tensor) -> torch.Tensor:
        with engine_span("step_inputs"):
            every_row = len(requests) == len(self.rows)  # batches keep request order
            if every_row:
                self.ids = ids
            else:
                rows = torch.tensor([self.rows[r.seq_id] for r in requests], device=self.device)
                self.ids = self.ids.index_copy(0, rows, ids)
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
            kwargs = {"input_ids": self.ids[:, None]}
            if self.cross_rows is not None:
                kwargs["cross_attention_mask"] = self.cross_rows
        logits = self._run(kwargs, 1)
        return logits if every_row else logits[rows]

    def _run(self, kwargs: dict, width: int) -> torch.Tensor:
        if "position_ids" not in kwargs:  # text positions of each row plus its grid delta: [B, S]
            positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
            kwargs["position_ids"] = positions + self.deltas + self.positions.offset
        kwargs.update({"attention_mask": self.mask, self.cache_kwarg: self.cache, "use_cache": True})
        with torch.no_grad():
            return self.model(**kwargs, **self.last_logits_only).logits[:, -1]

    def release(self, request: Request) -> None:
        self.positions.forget(request)  # one DynamicCache per wave
