"""demollm's engine: requests admitted by the scheduler, prompts prefilled (in chunks when longer
than the token budget), then one token per running sequence per step, greedy or sampled.

The executors (executors.py) run a step; the scheduler (scheduler.py) decides which prompts a prefill
step takes. A step is a prefill step when the scheduler has chunks for one, else a decode step of
every running sequence. Each request's queue time, time to first token and time per output token
are kept beside the step times.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.config import RuntimeConfig
from pipeline.devices import sync
from pipeline.graphs import cached_graphs, find_graphs
from pipeline.models import zoo
from pipeline.runtime.executors import EagerExecutor, PagedExecutor, engine_span
from pipeline.runtime.host_memory import retain_freed_memory
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams, sample
from pipeline.runtime.scheduler import Scheduler


@dataclass
class StepTiming:
    kind: str  # prefill | decode
    seconds: float  # from the host receiving the previous step's tokens to receiving this one's
    tokens: int  # tokens this step gave sequences (0 for a prefill chunk that ends no prompt)
    fed: int = 0  # tokens it fed the model: a prefill's prompt tokens, one per sequence in decode
    # tokens whose keys and values its attention reads: each sequence's cache after the step, summed
    context: int = 0
    # its time holds model work: a step was launched since the previous read, or the device runs
    # apart from the host (on CPU a step read after the last launch ran at launch, timed before)
    worked: bool = True


@dataclass
class RequestTiming:
    """Seconds from the start of the generation (every request arrives then)."""

    admitted_s: float = 0.0  # its first prefill step was launched
    first_token_s: float = 0.0  # the host received its first token
    finished_s: float = 0.0  # the host received its last token
    tokens: int = 0

    @property
    def queue_s(self) -> float:
        return self.admitted_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a request of one token."""
        return (self.finished_s - self.first_token_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Generation:
    tokens: dict[int, list[int]]  # seq_id -> generated token ids
    steps: list[StepTiming] = field(default_factory=list)
    requests: dict[int, RequestTiming] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def prefill_s(self) -> float:
        """All prefill steps together: one step unless prompts queued or were chunked."""
        return sum(s.seconds for s in self.steps if s.kind == "prefill")

    @property
    def decode_step_s(self) -> list[float]:
        return [s.seconds for s in self.steps if s.kind == "decode"]

    @property
    def decode_step_tokens(self) -> list[int]:
        return [s.tokens for s in self.steps if s.kind == "decode"]

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
            raise ValueError("the captured graph has no cached attention, so demollm cannot decode with it")
        if len(graphs) > 1:
            raise ValueError(f"demollm drives one cached graph; this model has {len(graphs)}")
        if graphs and graphs[0] is model and zoo.is_vlm(hf_config):
            raise ValueError(
                "a full graph of a VLM takes image inputs in every call, so it cannot decode; use capture=partial"
            )
        self.device, self.eos_ids = device, eos_ids
        if device.type == "cpu" and runtime.retain_host_memory:
            retain_freed_memory()
        self.lookahead = runtime.lookahead
        self.max_batch_size, self.max_num_tokens = runtime.max_batch_size, runtime.max_num_tokens
        text_config = getattr(hf_config, "text_config", None) or hf_config
        if graphs:
            self.executor: PagedExecutor | EagerExecutor = PagedExecutor(
                model, graphs[0], hf_config, runtime, device
            )
        else:
            pad = text_config.pad_token_id if text_config.pad_token_id is not None else 0
            self.executor = EagerExecutor(model, hf_config, pad, device)

    def generate(
        self,
        requests: list[Request],
        max_new_tokens: int,
        params: SamplingParams,
        seed: int,
        after_step: Callable[[str], None] | None = None,
    ) -> Generation:
        """after_step(kind) runs after each step (prefill or decode), outside its timing: the profiler
        closes one window per step there, so with it every step is read before
        the next is launched. Without it the host launches up to `lookahead` steps ahead of the
        tokens it has read: each decode step's input ids are the earlier steps' sampled tokens,
        still on the device, so on a GPU the host builds the next step while the device runs this
        one. A sequence that ended (EOS) in a step the host had not read yet has its later tokens
        computed and dropped; its slot goes to a waiting request once the host has read it. A
        step's time is the interval between the host receiving its tokens and receiving the
        previous step's: what a user streaming tokens waits per token."""
        lookahead = 0 if after_step else self.lookahead
        generator = torch.Generator().manual_seed(seed)
        scheduler = Scheduler(
            requests,
            self.max_batch_size,
            self.max_num_tokens,
            waves=not self.executor.chunked,
            wave_key=getattr(self.executor, "wave_key", None),
        )
        result = Generation(
            {r.seq_id: [] for r in requests}, requests={r.seq_id: RequestTiming() for r in requests}
        )
        finished: set[int] = set()
        launched: dict[int, int] = {}  # seq_id -> tokens launched
        latest: dict[int, tuple[_Step, int]] = {}  # seq_id -> the step and row of its latest token
        in_flight: deque[_Step] = deque()
        order = itertools.count()  # launch order of the steps
        sync(self.device)
        on_device, worked = self.device.type != "cpu", False
        start = read_at = time.perf_counter()

        def read(step: _Step) -> int:
            """Take a step's tokens; returns how many were kept."""
            kept, now = 0, time.perf_counter() - start
            for request, token in zip(step.batch, step.tokens_on_host(), strict=True):
                seq, timing = request.seq_id, result.requests[request.seq_id]
                if seq in finished:
                    continue  # computed ahead for a sequence that had already ended
                result.tokens[seq].append(token)
                kept += 1
                timing.tokens += 1
                timing.first_token_s = timing.first_token_s or now
                if token in self.eos_ids or timing.tokens >= max_new_tokens:
                    finished.add(seq)
                    timing.finished_s = now
                    # its pages go back to the pool (steps in flight are ordered before any later
                    # step that reuses them) and its slot to the queue
                    self.executor.release(request)
                    scheduler.release(seq)
            return kept

        while True:
            step = None
            if chunks := scheduler.next_prefill():
                for chunk in chunks:
                    if chunk.start == 0:
                        result.requests[chunk.request.seq_id].admitted_s = time.perf_counter() - start
                completing = [c.request for c in chunks if c.completes]
                logits = self.executor.prefill(chunks)
                fed, context = sum(c.end - c.start for c in chunks), sum(c.end for c in chunks)
                step = self._launch(
                    "prefill", completing, logits, params, generator, next(order), fed, context
                )
                for row, request in enumerate(completing):
                    launched[request.seq_id], latest[request.seq_id] = 1, (step, row)
            elif batch := self._decoding(latest, launched, finished, max_new_tokens):
                logits = self.executor.decode(batch, _ids(batch, latest))
                context = sum(len(r.prompt) + launched[r.seq_id] for r in batch)
                step = self._launch(
                    "decode", batch, logits, params, generator, next(order), len(batch), context
                )
                for row, request in enumerate(batch):
                    launched[request.seq_id] += 1
                    latest[request.seq_id] = (step, row)
            if step is None and not in_flight:
                if not scheduler.done:  # a bug, not an input: the scheduler refuses what cannot fit
                    raise RuntimeError("demollm's scheduler stalled with requests left")
                result.wall_s = time.perf_counter() - start
                return result
            if step is not None:
                in_flight.append(step)
                worked = True
            # Read what running ahead allows; with nothing launched, everything (finished sequences
            # free their slots for the queue).
            while in_flight and (len(in_flight) > lookahead or step is None or after_step):
                done = in_flight.popleft()
                kept = read(done)
                now = time.perf_counter()
                if done.kind == "prefill" or kept:
                    result.steps.append(
                        StepTiming(
                            done.kind, now - read_at, kept, done.fed, done.context, worked or on_device
                        )
                    )
                worked = False
                if after_step:
                    after_step(done.kind)
                    now = time.perf_counter()
                read_at = now

    @staticmethod
    def _decoding(latest, launched, finished, max_new_tokens) -> list[Request]:
        """The sequences a decode step takes: every one whose prompt is in and that has tokens to go,
        ordered by where its latest token sits (so the step's ids are slices of earlier steps'
        tokens, not a gather)."""
        going = [
            (step.index, row, step.batch[row])
            for step, row in latest.values()
            if step.batch[row].seq_id not in finished and launched[step.batch[row].seq_id] < max_new_tokens
        ]
        return [request for *_, request in sorted(going, key=lambda g: g[:2])]

    @staticmethod
    def _launch(
        kind: str,
        batch: list[Request],
        logits: torch.Tensor,
        params,
        generator,
        index: int,
        fed: int,
        context: int,
    ) -> _Step:
        with engine_span("sample"):
            tokens = sample(logits, params, generator) if batch else logits.new_zeros(0, dtype=torch.long)
            return _Step(kind, batch, tokens, index, fed, context)


def _ids(batch: list[Request], latest: dict[int, tuple[_Step, int]]) -> torch.Tensor:
    """[B] on the device: each sequence's latest token, from the steps that sampled them."""
    pieces: list[torch.Tensor] = []
    run_step, rows = None, []
    for request in batch:
        step, row = latest[request.seq_id]
        if step is not run_step and run_step is not None:
            pieces.append(_rows(run_step, rows))
            rows = []
        run_step = step
        rows.append(row)
    pieces.append(_rows(run_step, rows))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _rows(step: _Step, rows: list[int]) -> torch.Tensor:
    if rows == list(range(len(step.batch))):
        return step.tokens
    return step.tokens[torch.tensor(rows, device=step.tokens.device)]


class _Step:
    """A launched step's sampled tokens [B] on the device, and their copy on the way to the host."""

    def __init__(
        self, kind: str, batch: list[Request], tokens: torch.Tensor, index: int, fed: int, context: int
    ):
        self.kind, self.batch, self.tokens, self.index = kind, batch, tokens, index  # index: launch order
        self.fed, self.context = fed, context
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
