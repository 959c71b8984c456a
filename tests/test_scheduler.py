"""demollm keeps the limits the user set, whatever the request source: at most max_batch_size
sequences at a time (the rest queue), at most max_num_tokens prompt tokens per prefill step (longer
prompts are prefilled in chunks), and the tokens are the ones Hugging Face generates request by
request."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from test_runtime import _engine, _hf_generate, _requests

from pipeline.errors import ConfigError
from pipeline.models import zoo
from pipeline.runtime.requests import Request, build_requests
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.scheduler import Scheduler


def _steps(scheduler: Scheduler, finish_after: int = 0) -> list[list[tuple[int, int, int]]]:
    """The prefill steps the scheduler makes; every admitted sequence finishes once the next
    prefill step was made (finish_after=0) so slots free up."""
    steps = []
    while chunks := scheduler.next_prefill():
        steps.append([(c.request.seq_id, c.start, c.end) for c in chunks])
        for c in chunks:
            if c.completes:
                scheduler.release(c.request.seq_id)
    return steps


def test_admission_keeps_the_batch_and_token_limits():
    requests = [Request(i, list(range(n))) for i, n in enumerate([5, 5, 5, 12, 3])]
    scheduler = Scheduler(requests, max_batch_size=2, max_num_tokens=8)
    first = scheduler.next_prefill()
    assert [(c.request.seq_id, c.start, c.end) for c in first] == [(0, 0, 5), (1, 0, 3)]  # the budget cuts 1
    scheduler.release(0)
    assert [(c.request.seq_id, c.start, c.end) for c in scheduler.next_prefill()] == [(1, 3, 5), (2, 0, 5)]
    scheduler.release(1)
    scheduler.release(2)
    rest = _steps(scheduler)
    assert rest == [[(3, 0, 8)], [(3, 8, 12), (4, 0, 3)]]  # 12 tokens over two steps; 4 joins the second
    assert scheduler.done


def test_a_chunk_never_splits_an_image():
    request = Request(0, list(range(20)), {"pixel_values": torch.zeros(1)}, image_spans=[(6, 14)])
    steps = _steps(Scheduler([request], max_batch_size=1, max_num_tokens=10))
    assert steps == [[(0, 0, 6)], [(0, 6, 16)], [(0, 16, 20)]]


def test_a_chunk_never_splits_what_is_attended_both_ways():
    """A span attended both ways (Gemma 3's image tokens, PaliGemma's prompt) is prefilled in one
    step: its tokens see each other's keys, which a later chunk would not have computed yet."""
    request = Request(0, list(range(20)), bidirectional=[(4, 9)])
    assert _steps(Scheduler([request], max_batch_size=1, max_num_tokens=6)) == [
        [(0, 0, 4)],
        [(0, 4, 10)],
        [(0, 10, 16)],
        [(0, 16, 20)],
    ]
    with pytest.raises(ValueError, match="12 tokens one prefill step must hold whole"):
        Scheduler([Request(1, list(range(20)), bidirectional=[(0, 12)])], max_batch_size=1, max_num_tokens=10)


def test_eager_waves_take_whole_prompts_within_the_padded_budget():
    requests = [Request(i, list(range(n))) for i, n in enumerate([4, 6, 6, 3])]
    scheduler = Scheduler(requests, max_batch_size=3, max_num_tokens=12, waves=True)
    wave = scheduler.next_prefill()
    assert [c.request.seq_id for c in wave] == [0, 1]  # a third row would pad to 3 x 6 = 18 > 12
    assert scheduler.next_prefill() == []  # the next wave waits for this one
    scheduler.release(0)
    assert scheduler.next_prefill() == []
    scheduler.release(1)
    assert [c.request.seq_id for c in scheduler.next_prefill()] == [2, 3]


@pytest.mark.parametrize("capture", ["partial", "none"])
@pytest.mark.parametrize("lookahead", [0, 1])
def test_more_requests_than_slots_queue_and_keep_their_tokens(capture, lookahead):
    """6 requests, 2 slots: all finish with Hugging Face's tokens (each generated alone), the later
    ones after waiting in the queue."""
    name = "tiny_mistral3"
    engine, hf_config = _engine(
        name, capture=capture, overrides=["runtime.max_batch_size=2", f"runtime.lookahead={lookahead}"]
    )
    requests = _requests(hf_config, [5, 9, 13, 7, 11, 6], images=True)
    generation = engine.generate(requests, 5, SamplingParams(), seed=0)
    assert generation.tokens == _hf_generate(name, requests, 5)
    timings = generation.requests
    assert all(t.ttft_s >= t.queue_s and t.tokens == 5 and t.tpot_s > 0 for t in timings.values())
    assert max(t.queue_s for t in timings.values()) > timings[0].ttft_s  # the last ones waited
    assert sum(s.kind == "prefill" for s in generation.steps) >= 3


@pytest.mark.parametrize("name", ["tiny_llama3_1_8b", "tiny_qwen2_5_vl", "tiny_gemma3"])
def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks(name):
    """max_num_tokens=16: prompts of 40 and 25 tokens (with an image for the VLM) go over several
    prefill steps, and generate what one whole prefill (Hugging Face's) does."""
    engine, hf_config = _engine(name, overrides=["runtime.max_num_tokens=16"])
    requests = _requests(hf_config, [40, 25], images=zoo.is_vlm(hf_config))
    generation = engine.generate(requests, 4, SamplingParams(), seed=0)
    assert generation.tokens == _hf_generate(name, requests, 4)
    assert sum(s.kind == "prefill" for s in generation.steps) >= 4  # at least 65 / 16 steps


def test_capture_none_refuses_a_prompt_over_the_budget_up_front():
    cfg = compose_cfg(
        ["model=tiny_magistral", "capture=none", "runtime.max_num_tokens=16", "prompt.prompt_len=20"]
    )
    hf_config = zoo.build_hf_config(cfg.model)
    with pytest.raises(
        ConfigError, match="capture=none prefills a prompt whole.*raise runtime.max_num_tokens"
    ):
        build_requests(
            cfg.prompt, cfg.runtime, 0, hf_config, torch.float32, torch.device("cpu"), chunked=False
        )
    build_requests(cfg.prompt, cfg.runtime, 0, hf_config, torch.float32, torch.device("cpu"), chunked=True)


def test_queries_cycle_to_the_batch_size():
    cfg = compose_cfg(["model=tiny_magistral", "prompt.queries=[[5,6,7],[8,9]]", "prompt.batch_size=5"])
    hf_config = zoo.build_hf_config(cfg.model)
    requests = build_requests(cfg.prompt, cfg.runtime, 0, hf_config, torch.float32, torch.device("cpu"))
    assert [r.prompt for r in requests] == [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9], [5, 6, 7]]
    cfg = compose_cfg(["model=tiny_magistral", "prompt.queries=[[5,6,7],[8,9],[4]]", "prompt.batch_size=2"])
    assert len(build_requests(cfg.prompt, cfg.runtime, 0, hf_config, torch.float32, torch.device("cpu"))) == 3
