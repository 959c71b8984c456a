"""demollm's engine: batched prefill, then one token per sequence per step, greedy or sampled.

Two runners behind one interface:
- `PagedRunner` for a model whose captured graph has cached attention (insert_cached_attention):
  every step packs the new tokens of all running sequences into one row [1, T], with explicit
  position ids, and binds the paged KV cache and the step's sequence metadata to the graph's
  inputs. The eager parts (vision tower, image merging, lm_head) run as HF wrote them.
- `EagerRunner` for `capture=none`: the HF model with its own attention and DynamicCache, prompts
  left-padded, so the eager baseline runs through the same loop and timers.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from pipeline.attention.kv_cache import PagedKVCache, pages_for
from pipeline.config import RuntimeConfig
from pipeline.devices import sync
from pipeline.graphs import cached_graphs, find_graphs, range_name, record_of
from pipeline.models.images import concat_pixels
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams, sample


def engine_span(part: str):
    """A named range for the profiler: the engine's own work shows as `demollm.<part>` in the
    module tree instead of unattributed (a no-op when no profiler runs)."""
    return torch.profiler.record_function(range_name(f"demollm.{part}", "DemoLLM"))


def _positions(text_config, positions: torch.Tensor) -> torch.Tensor:
    """[1, T] -> [3, 1, T] for multimodal RoPE (Qwen2.5-VL: text positions on all three rows)."""
    if (getattr(text_config, "rope_parameters", None) or {}).get("mrope_section"):
        return positions[None].expand(3, -1, -1)
    return positions


def _images(requests: list[Request]) -> dict[str, torch.Tensor]:
    """The requests' pixel tensors in one call, in request order."""
    return concat_pixels([r.images for r in requests if r.images])


class PagedRunner:
    def __init__(self, model: nn.Module, graph: fx.GraphModule, hf_config, runtime: RuntimeConfig, device):
        self.model, self.graph, self.device = model, graph, device
        self.text_config = getattr(hf_config, "text_config", None) or hf_config
        specs = record_of(graph).cache_specs
        self.cache = PagedKVCache(specs, pages_for(runtime, specs), runtime.attn_page_size, device)
        self.step_inputs: dict[str, torch.Tensor] = {}
        record_of(graph).runtime_inputs = lambda call: self.step_inputs
        self.eager_lm_head = not isinstance(model, fx.GraphModule)

    def prefill(self, requests: list[Request]) -> torch.Tensor:
        """Every request's prompt (and images) packed into one step -> its last token's logits [B, V]."""
        with engine_span("step_inputs"):
            lengths = [len(r.prompt) for r in requests]
            meta = self._reserve(requests, lengths)
            ids = torch.tensor([t for r in requests for t in r.prompt], device=self.device)[None]  # [1, T]
            positions = torch.cat(
                [torch.arange(self.cache.lengths[r.seq_id], self.cache.lengths[r.seq_id] + n) for r, n in
                 zip(requests, lengths, strict=True)]
            )  # fmt: skip
            kwargs = {"input_ids": ids, "position_ids": positions[None].to(self.device), **_images(requests)}
            last = (meta["qo_indptr"][1:] - 1).long()  # [B]: each sequence's last token in the packed row
        return self._run(requests, lengths, kwargs, last)

    def decode(self, requests: list[Request], ids: torch.Tensor) -> torch.Tensor:
        """ids [B]: one new token per request, already on the device -> logits [B, V]."""
        with engine_span("step_inputs"):
            lengths = [1] * len(requests)
            meta = self._reserve(requests, lengths)
            # A decode token sits at its sequence's cached length: positions come from the metadata
            # already on the device, not from another host copy.
            kwargs = {"input_ids": ids[None], "position_ids": meta["cache_lens"].long()[None]}  # [1, B]
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
        kwargs["position_ids"] = _positions(self.text_config, kwargs["position_ids"])
        kwargs["use_cache"] = False
        if self.eager_lm_head:  # HF's lm_head then runs on B rows, not T (0: all rows)
            kwargs["logits_to_keep"] = 0 if last is None else last
        with torch.no_grad():
            logits = self.model(**kwargs).logits[0]  # [B or T, V]
        with engine_span("step_outputs"):
            for request, n in zip(requests, lengths, strict=True):
                self.cache.commit(request.seq_id, n)
        return logits if self.eager_lm_head or last is None else logits[last]

    def release(self, request: Request) -> None:
        self.cache.free(request.seq_id)


class EagerRunner:
    """HF's own cache and attention; prompts left-padded to the longest, as HF generate pads. The
    padded cache keeps a row per prefilled request: rows of finished requests are fed a token and
    their outputs dropped."""

    def __init__(self, model: nn.Module, pad_id: int, device):
        from transformers import DynamicCache

        self.model, self.pad_id, self.device = model, pad_id, device
        self.cache_cls = DynamicCache
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, S] of every prefilled row
        self.rows: dict[int, int] = {}  # seq_id -> its row
        self.ids: torch.Tensor | None = None  # [B]: each row's last fed token

    def prefill(self, requests: list[Request]) -> torch.Tensor:
        with engine_span("step_inputs"):
            width = max(len(r.prompt) for r in requests)
            ids = torch.tensor([[self.pad_id] * (width - len(r.prompt)) + r.prompt for r in requests])
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in requests])
            self.cache, self.mask = self.cache_cls(config=self.model.config), mask.to(self.device)
            self.rows = {r.seq_id: row for row, r in enumerate(requests)}
            self.ids = torch.full((len(requests),), self.pad_id, device=self.device)
            kwargs = {"input_ids": ids.to(self.device), **_images(requests)}
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
        logits = self._run(kwargs, 1)
        return logits if every_row else logits[rows]

    def _run(self, kwargs: dict, width: int) -> torch.Tensor:
        kwargs.update(
            attention_mask=self.mask,
            position_ids=(self.mask.cumsum(-1) - 1).clamp(min=0)[:, -width:],
            past_key_values=self.cache,
            use_cache=True,
        )
        with torch.no_grad():
            return self.model(**kwargs).logits[:, -1]

    def release(self, request: Request) -> None:
        pass  # one DynamicCache per batch


@dataclass
class Generation:
    tokens: dict[int, list[int]]  # seq_id -> generated token ids
    prefill_s: float
    decode_step_s: list[float] = field(default_factory=list)
    decode_step_tokens: list[int] = field(default_factory=list)  # sequences advanced per step

    @property
    def decode_ms(self) -> float:
        return 1000 * statistics.median(self.decode_step_s) if self.decode_step_s else float("nan")

    @property
    def decode_p90_ms(self) -> float:
        if not self.decode_step_s:
            return float("nan")
        ordered = sorted(self.decode_step_s)
        return 1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    @property
    def decode_tok_s(self) -> float:
        total = sum(self.decode_step_s)
        return sum(self.decode_step_tokens) / total if total else float("nan")


class DemoLLM:
    def __init__(
        self, model: nn.Module, hf_config, runtime: RuntimeConfig, device: torch.device, eos_ids: set[int]
    ):
        graphs = [gm for _, gm in cached_graphs(model)]
        if find_graphs(model) and not graphs:
            raise ValueError(
                "the captured graph has no cached attention, so demollm cannot decode with it: enable "
                "transforms.match_attention and transforms.insert_cached_attention"
            )
        if len(graphs) > 1:
            raise ValueError(f"demollm drives one cached graph; this model has {len(graphs)}")
        if graphs and graphs[0] is model and getattr(hf_config, "vision_config", None) is not None:
            raise ValueError(
                "a full graph of a VLM takes image inputs in every call, so it cannot decode; use capture=partial"
            )
        self.device, self.eos_ids = device, eos_ids
        self.lookahead = runtime.lookahead
        text_config = getattr(hf_config, "text_config", None) or hf_config
        if graphs:
            self.runner: PagedRunner | EagerRunner = PagedRunner(model, graphs[0], hf_config, runtime, device)
        else:
            pad = text_config.pad_token_id if text_config.pad_token_id is not None else 0
            self.runner = EagerRunner(model, pad, device)

    def generate(
        self,
        requests: list[Request],
        max_new_tokens: int,
        params: SamplingParams,
        seed: int,
        after_step: Callable[[], None] | None = None,
    ) -> Generation:
        """after_step runs after each step (prefill, then every decode step), outside its timing:
        the profiler closes one window per step there, so with it every step is read before the
        next is launched. Without it the host launches up to `lookahead` steps ahead of the tokens
        it has read: each decode step's input ids are the previous step's sampled tokens, still on
        the device, so on a GPU the host builds the next step while the device runs this one. A
        sequence that ended (EOS) in a step the host had not read yet has its later tokens computed
        and dropped. A decode step's time is the interval between the host receiving its tokens and
        receiving the previous step's: what a user streaming tokens waits per token."""
        lookahead = 0 if after_step else self.lookahead
        generator = torch.Generator().manual_seed(seed)
        out: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        finished: set[int] = set()

        def read(step: _Step) -> int:
            """Take a step's tokens; returns how many were kept."""
            kept = 0
            for request, token in zip(step.batch, step.tokens_on_host(), strict=True):
                if request.seq_id in finished:
                    continue  # computed ahead for a sequence that had already ended
                out[request.seq_id].append(token)
                kept += 1
                if token in self.eos_ids or len(out[request.seq_id]) >= max_new_tokens:
                    finished.add(request.seq_id)
                    self.runner.release(request)  # its pages go back to the pool (steps in flight are
                    # ordered before any later step that reuses them)
            return kept

        sync(self.device)
        start = time.perf_counter()
        last = self._launch(requests, self.runner.prefill(requests), params, generator)
        read(last)
        read_at = time.perf_counter()
        result = Generation(out, prefill_s=read_at - start)
        launched = {r.seq_id: 1 for r in requests}  # tokens launched per sequence
        in_flight: deque[_Step] = deque()
        while True:
            batch = [
                r for r in last.batch if r.seq_id not in finished and launched[r.seq_id] < max_new_tokens
            ]
            if after_step:
                after_step()
                read_at = time.perf_counter()
            if batch:
                ids = last.tokens  # [B] on the device
                if len(batch) < len(last.batch):
                    going_on = {r.seq_id for r in batch}
                    rows = [i for i, r in enumerate(last.batch) if r.seq_id in going_on]
                    ids = ids[torch.tensor(rows, device=ids.device)]
                last = self._launch(batch, self.runner.decode(batch, ids), params, generator)
                in_flight.append(last)
                for request in batch:
                    launched[request.seq_id] += 1
            while len(in_flight) > (lookahead if batch else 0):
                kept = read(in_flight.popleft())
                now = time.perf_counter()
                if kept:
                    result.decode_step_s.append(now - read_at)
                    result.decode_step_tokens.append(kept)
                read_at = now
            if not batch:
                return result

    def _launch(self, batch: list[Request], logits: torch.Tensor, params, generator) -> _Step:
        with engine_span("sample"):
            return _Step(batch, sample(logits, params, generator))


class _Step:
    """A launched step's sampled tokens [B] on the device, and their copy on the way to the host."""

    def __init__(self, batch: list[Request], tokens: torch.Tensor):
        self.batch, self.tokens = batch, tokens
        self.done: torch.cuda.Event | None = None
        if tokens.is_cuda:  # pinned: the copy runs behind the queued work, the host goes on
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = tokens

    def tokens_on_host(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()
