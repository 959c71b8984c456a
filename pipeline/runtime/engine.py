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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from pipeline.models.images import concat_pixels
from pipeline.profiler.events import range_name
from pipeline.runtime.kv_cache import PagedKVCache, pages_for
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams, sample


def engine_span(part: str):
    """A named range for the profiler: the engine's own work shows as `demollm.<part>` in the
    module tree instead of unattributed (a no-op when no profiler runs)."""
    return torch.profiler.record_function(range_name(f"demollm.{part}", "DemoLLM"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _positions(text_config, positions: torch.Tensor) -> torch.Tensor:
    """[1, T] -> [3, 1, T] for multimodal RoPE (Qwen2.5-VL: text positions on all three rows)."""
    if (getattr(text_config, "rope_parameters", None) or {}).get("mrope_section"):
        return positions[None].expand(3, -1, -1)
    return positions


def _images(requests: list[Request]) -> dict[str, torch.Tensor]:
    """The requests' pixel tensors in one call, in request order."""
    return concat_pixels([r.images for r in requests if r.images])


class PagedRunner:
    def __init__(self, model: nn.Module, graph: fx.GraphModule, hf_config, cfg_runtime, device):
        self.model, self.graph, self.device = model, graph, device
        self.text_config = getattr(hf_config, "text_config", None) or hf_config
        self.cache = PagedKVCache(
            graph.cache_specs, pages_for(cfg_runtime, graph.cache_specs), cfg_runtime.attn_page_size, device
        )
        self.step_inputs: dict[str, torch.Tensor] = {}
        graph.runtime_inputs = lambda call: self.step_inputs
        self.eager_lm_head = not isinstance(model, fx.GraphModule)

    def forward(self, requests: list[Request], new_tokens: list[list[int]], images: bool) -> torch.Tensor:
        """One step: each request's new tokens (its prompt in prefill, one token in decode) -> [B, V]."""
        with engine_span("step_inputs"):
            kwargs, last = self._step_inputs(requests, new_tokens, images)
        with torch.no_grad():
            logits = self.model(**kwargs).logits[0]  # [B or T, V]
        with engine_span("step_outputs"):
            for request, tokens in zip(requests, new_tokens, strict=True):
                self.cache.commit(request.seq_id, len(tokens))
            return logits if self.eager_lm_head else logits[last]

    def _step_inputs(
        self, requests: list[Request], new_tokens: list[list[int]], images: bool
    ) -> tuple[dict, torch.Tensor]:
        """The model's kwargs for one packed step, the graph's cache inputs set aside, and each
        sequence's last token index in the packed row."""
        seq_ids = [r.seq_id for r in requests]
        for seq_id, tokens in zip(seq_ids, new_tokens, strict=True):
            self.cache.reserve(seq_id, len(tokens))
        lengths = [len(t) for t in new_tokens]
        meta = self.cache.metadata(seq_ids, lengths, self.device)
        positions = torch.cat(
            [
                torch.arange(self.cache.lengths[s], self.cache.lengths[s] + n)
                for s, n in zip(seq_ids, lengths, strict=True)
            ]
        )
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], device=self.device)[None]  # [1, T]
        self.step_inputs = {**self.cache.tensors, **meta}
        last = (meta["qo_indptr"][1:] - 1).long()  # [B]
        kwargs = {
            "input_ids": ids,
            "position_ids": _positions(self.text_config, positions[None].to(self.device)),
            "use_cache": False,
        }
        if images:
            kwargs.update(_images(requests))
        if self.eager_lm_head:
            kwargs["logits_to_keep"] = last  # HF's lm_head then runs on B rows, not T
        return kwargs, last

    def release(self, request: Request) -> None:
        self.cache.free(request.seq_id)


class EagerRunner:
    """HF's own cache and attention; prompts left-padded to the longest, as HF generate pads."""

    def __init__(self, model: nn.Module, pad_id: int, device):
        from transformers import DynamicCache

        self.model, self.pad_id, self.device = model, pad_id, device
        self.cache_cls = DynamicCache
        self.cache = None
        self.mask: torch.Tensor | None = None

    def forward(self, requests: list[Request], new_tokens: list[list[int]], images: bool) -> torch.Tensor:
        with engine_span("step_inputs"):
            width = max(len(t) for t in new_tokens)
            ids = torch.tensor([[self.pad_id] * (width - len(t)) + t for t in new_tokens], device=self.device)
            step_mask = torch.tensor(
                [[0] * (width - len(t)) + [1] * len(t) for t in new_tokens], device=self.device
            )
            if images:  # prefill: a new batch
                self.cache, self.mask = self.cache_cls(config=self.model.config), step_mask
            else:
                self.mask = torch.cat([self.mask, step_mask], dim=1)
            positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
            kwargs = {
                "input_ids": ids,
                "attention_mask": self.mask,
                "position_ids": positions,
                "past_key_values": self.cache,
                "use_cache": True,
            }
            if images:
                kwargs.update(_images(requests))
        with torch.no_grad():
            return self.model(**kwargs).logits[:, -1]

    def release(self, request: Request) -> None:
        pass  # one DynamicCache per batch; finished rows keep decoding, their tokens are ignored


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
    def __init__(self, model: nn.Module, hf_config, cfg_runtime, device: torch.device, eos_ids: set[int]):
        graphs = [m for m in model.modules() if isinstance(m, fx.GraphModule) and hasattr(m, "cache_specs")]
        captured = [m for m in model.modules() if isinstance(m, fx.GraphModule)]
        if captured and not graphs:
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
        text_config = getattr(hf_config, "text_config", None) or hf_config
        if graphs:
            self.runner: PagedRunner | EagerRunner = PagedRunner(
                model, graphs[0], hf_config, cfg_runtime, device
            )
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
        the profiler closes one window per step there."""
        generator = torch.Generator().manual_seed(seed)
        out: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        eager = isinstance(self.runner, EagerRunner)
        _sync(self.device)
        start = time.perf_counter()
        logits = self.runner.forward(requests, [r.prompt for r in requests], images=True)
        with engine_span("sample"):
            last = sample(logits, params, generator).tolist()
        _sync(self.device)
        result = Generation(out, prefill_s=time.perf_counter() - start)
        if after_step:
            after_step()
        running = list(requests)
        while True:
            continuing = []
            for request, token in zip(running, last, strict=True):
                out[request.seq_id].append(token)
                if token in self.eos_ids or len(out[request.seq_id]) >= max_new_tokens:
                    self.runner.release(request)  # its pages go back to the pool now
                else:
                    continuing.append(request)
            if not continuing:
                return result
            # The eager runner's padded cache keeps a row per request; finished rows are fed their last
            # token and their outputs dropped.
            batch = requests if eager else continuing
            _sync(self.device)
            start = time.perf_counter()
            logits = self.runner.forward(batch, [[out[r.seq_id][-1]] for r in batch], images=False)
            if eager:
                logits = logits[[requests.index(r) for r in continuing]]
            with engine_span("sample"):
                last = sample(logits, params, generator).tolist()
            _sync(self.device)
            result.decode_step_s.append(time.perf_counter() - start)
            result.decode_step_tokens.append(len(continuing))
            if after_step:
                after_step()
            running = continuing
