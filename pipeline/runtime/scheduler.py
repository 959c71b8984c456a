"""Which prompts a prefill step takes: demollm's admission, within the limits the user set.

At most `runtime.max_batch_size` sequences are admitted at a time (prefilling or decoding); more
requests wait in arrival order and enter as others finish. A prefill step takes at most
`runtime.max_num_tokens` prompt tokens: a prompt longer than what is left of the budget continues in
the next prefill step (chunked prefill), with the part already in the KV cache attended as
history, and a chunk never ends inside a request's image tokens (the vision tower's features go in
whole). Partly prefilled prompts go first, then new requests. The budget is the user's: nothing
here raises it.

The eager runner (capture=none, Hugging Face's own padded cache) prefills whole prompts in waves:
a wave is admitted only when the previous one has finished, and its cost is its padded size,
requests x longest prompt. Where the runner names a wave key, a wave holds requests of one key
(consecutive in arrival order): Mllama's padded batch would give a text request cross-attention
over padding images, so its text and image requests go in separate waves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pipeline.runtime.requests import Request


@dataclass
class Chunk:
    request: Request
    start: int  # prompt tokens [start, end) go into this step; start tokens are cached already
    end: int

    @property
    def completes(self) -> bool:
        """The prompt's last token is in this chunk: its logits give the first generated token."""
        return self.end == len(self.request.prompt)

    @property
    def has_images(self) -> bool:
        """The request's images are in this chunk (all of them: a chunk never splits them)."""
        span = self.request.unsplit_span
        return bool(self.request.images) and self.start <= span[0] and span[1] <= self.end


class Scheduler:
    def __init__(
        self,
        requests: list[Request],
        max_batch_size: int,
        max_num_tokens: int,
        waves: bool = False,
        wave_key: Callable[[Request], Hashable] | None = None,
    ):
        """waves: the eager runner's whole-prompt waves; wave_key: what the requests of one wave share
        (see the module's docstring)."""
        self.wave_key = wave_key
        for request in requests:
            span = request.unsplit_span
            if span is not None and span[1] - span[0] > max_num_tokens:
                raise ValueError(
                    f"request {request.seq_id} has {span[1] - span[0]} tokens one prefill step must hold whole, "
                    f"more than runtime.max_num_tokens={max_num_tokens}; raise it"
                )
        self.waiting: deque[Request] = deque(requests)
        self.partial: deque[tuple[Request, int]] = deque()  # admitted, prompt cached up to the int
        self.admitted: set[int] = set()  # seq ids holding a slot
        self.max_batch_size, self.max_num_tokens, self.waves = max_batch_size, max_num_tokens, waves

    @property
    def done(self) -> bool:
        return not (self.waiting or self.partial or self.admitted)

    def release(self, seq_id: int) -> None:
        """The sequence finished: its slot is free."""
        self.admitted.discard(seq_id)

    def _cut(self, request: Request, start: int, budget: int) -> int:
        """Where a chunk from `start` with `budget` tokens ends: the prompt's end, the budget, or the
        start of the image span the budget would cut into."""
        end = min(len(request.prompt), start + budget)
        span = request.unsplit_span
        if span is not None and span[0] < end < span[1]:
            end = span[0]
        return max(end, start)

    def next_prefill(self) -> list[Chunk]:
        """The chunks of the next prefill step; empty when none is due (decode instead)."""
        if self.waves:
            return self._wave()
        budget, chunks = self.max_num_tokens, []
        for _ in range(len(self.partial)):
            request, start = self.partial[0]
            end = self._cut(request, start, budget)
            if end == start:
                break
            self.partial.popleft()
            chunks.append(Chunk(request, start, end))
            budget -= end - start
            if end < len(request.prompt):
                self.partial.appendleft((request, end))
                break
        while self.waiting and budget > 0 and len(self.admitted) < self.max_batch_size:
            request = self.waiting[0]
            end = self._cut(request, 0, budget)
            if end == 0:
                break  # its image begins the prompt and does not fit what is left: next step
            self.waiting.popleft()
            self.admitted.add(request.seq_id)
            chunks.append(Chunk(request, 0, end))
            budget -= end
            if end < len(request.prompt):
                self.partial.append((request, end))
        return chunks

    def _wave(self) -> list[Chunk]:
        if self.admitted:
            return []
        wave: list[Request] = []
        width = 0
        while self.waiting and len(wave) < self.max_batch_size:
            candidate = max(width, len(self.waiting[0].prompt))
            if wave and (len(wave) + 1) * candidate > self.max_num_tokens:
                break
            if wave and self.wave_key and self.wave_key(self.waiting[0]) != self.wave_key(wave[0]):
                break
            width = candidate
            wave.append(self.waiting.popleft())
        self.admitted |= {r.seq_id for r in wave}
        return [Chunk(r, 0, len(r.prompt)) for r in wave]
