"""demollm: greedy tokens identical to Hugging Face generate, the paged cache's bookkeeping, sampling."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    FAMILY_VLMS,
    TINY_FAMILIES,
    TINY_MODELS,
    TINY_MOE,
    TINY_VLMS,
    YAML_ONLY_VLMS,
    build_tiny,
    capture_tiny,
    compose_cfg,
    run_pipeline,
    transform_context,
)

from pipeline.attention.kv_cache import CacheFull, CacheSpec, PagedKVCache
from pipeline.attention.torch_backend import allowed
from pipeline.graphs import record_of
from pipeline.models import masks, meta, zoo
from pipeline.models.families import family_processor
from pipeline.models.images import IMAGES_FIRST, synthetic_image
from pipeline.models.processor import processed
from pipeline.models.zoo import eos_ids
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.executors import EagerExecutor, PagedExecutor
from pipeline.runtime.requests import Request, build_requests, image_part, sources_of, with_mask_spans
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.scheduler import Chunk
from pipeline.transforms import registry

PAGE = 8  # smaller than the prompts, so sequences span several pages


def _skeleton(hf_config):
    """The VLM on the meta device: what counts a fixed-size family's image tokens."""
    from transformers import AutoModelForImageTextToText

    return meta.meta_model(AutoModelForImageTextToText._model_mapping[type(hf_config)], hf_config)


def _requests(hf_config, lengths: list[int], images: bool, seed: int = 1) -> list[Request]:
    """Text requests of random ids (`lengths` long); with images, every other one a chat with an
    image, as the family's Processor makes it (its ids, pixels and per-token tensors) where the
    family has one here, else laid out by the pipeline's rules for the family."""
    generator = torch.Generator().manual_seed(seed)
    images = images and zoo.is_vlm(hf_config)
    skeleton = _skeleton(hf_config) if images else None
    processor = family_processor(hf_config) if images else None
    requests = []
    for i, n in enumerate(lengths):
        ids = torch.randint(20, 400, (n,), generator=generator).tolist()
        pixels = {}
        if images and i % 2 == 0:  # every other request carries an image
            image = synthetic_image(28 * (2 + i % 3), generator)  # images of different sizes in one batch
            if hf_config.model_type == "llama4":
                image = synthetic_image(56, generator)
            if processor is not None:
                requests.append(_processed_chat(processor, hf_config, i, n, image, skeleton))
                continue
            tokens, pixels = image_part(hf_config, image, torch.float32, torch.device("cpu"), None, skeleton)
            at = 0 if hf_config.model_type in IMAGES_FIRST else 2
            ids = ids[:at] + tokens + ids[at:]
        spans = [(at, at + len(tokens))] if pixels else []
        requests.append(with_mask_spans(hf_config, Request(i, ids, pixels, image_spans=spans)))
    return requests


def _processed_chat(processor, hf_config, seq_id: int, words: int, image, skeleton) -> Request:
    """A chat of `words` words and the image, through the family's chat template and Processor."""
    chat = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": " ".join(["cats"] * words)}],
        }
    ]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    prompt, pixels, per_token, spans = processed(
        processor, hf_config, text, [image], skeleton, torch.float32, torch.device("cpu")
    )
    return with_mask_spans(hf_config, Request(seq_id, prompt, pixels, spans, token_inputs=per_token))


def _engine(name: str, capture: str = "partial", overrides=(), backend: str = "torch", device: str = "cpu"):
    model, hf_config, examples = build_tiny(name, device=device)
    cfg = compose_cfg([f"model={name}", f"runtime.attn_page_size={PAGE}", *overrides])
    if capture != "none":
        model, _ = capture_tiny(model, hf_config, examples)
        transforms = registry.parse(cfg.transforms)
        ctx = transform_context(device, attention=backend, page_size=PAGE, hf_config=hf_config)
        registry.run_transforms(model, transforms, ctx, registry.TransformHistory())
    return DemoLLM(model, hf_config, cfg.runtime, torch.device(device), eos_ids(hf_config)), hf_config


def _hf_generate(name: str, requests: list[Request], new_tokens: int) -> dict[int, list[int]]:
    """Hugging Face generate on the eager model, one request at a time (no padding)."""
    model, _, _ = build_tiny(name)
    out = {}
    for r in requests:
        with torch.no_grad():
            inputs = {k: v.cpu() for k, v in hf_inputs(model.config, r).items()}
            ids = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        out[r.seq_id] = ids[0, len(r.prompt) :].tolist()
    return out


def hf_inputs(hf_config, request: Request) -> dict:
    """A request as Hugging Face's processor would hand it to generate: ids, pixels, and (Qwen2.5-VL)
    the image tokens marked in mm_token_type_ids, from which HF computes the grid positions, or
    (PaliGemma, Gemma 3) the token_type_ids its mask reads, or (Mllama) its cross-attention mask."""
    ids = torch.tensor([request.prompt])
    inputs = {"input_ids": ids, **request.images, **{k: v[None] for k, v in request.token_inputs.items()}}
    # the processor's mask of one unpadded prompt: generate would mask its tokens that equal the pad id
    inputs["attention_mask"] = torch.ones_like(ids)
    if request.token_inputs:  # what the family's Processor returned beside the ids, as it returned it
        return inputs
    if "image_grid_thw" in request.images:
        inputs["mm_token_type_ids"] = (ids == hf_config.image_token_id).int()
    if (types := masks.token_type_ids(hf_config, request.prompt)) is not None:
        inputs["token_type_ids"] = torch.tensor([types])
    if request.cross_attention_mask is not None:  # Mllama: the tiles each token attends
        inputs["cross_attention_mask"] = request.cross_attention_mask[None]
    return inputs


@pytest.mark.parametrize("name", [*TINY_MODELS, *TINY_FAMILIES, *TINY_MOE, *YAML_ONLY_VLMS, "tiny_mllama"])
@pytest.mark.parametrize("lengths", [[13], [5, 9, 13, 40]], ids=["batch1", "batch4-mixed"])
def test_greedy_tokens_equal_hf_generate(name, lengths):
    """Partly captured, transformed, cached model vs HF generate: the same tokens, image requests
    as the family's Processor makes them (_requests). The 40-token prompt crosses tiny Llama-4's
    attention chunk of 32."""
    engine, hf_config = _engine(name)
    requests = _requests(hf_config, lengths, images=zoo.is_vlm(hf_config))
    generation = engine.generate(requests, 8, SamplingParams(), seed=0)
    assert generation.tokens == _hf_generate(name, requests, 8)
    assert isinstance(engine.executor, PagedExecutor)
    assert (
        len(engine.executor.cache.free_pages) == engine.executor.cache.num_pages - 1
    )  # all back (but scratch)


@pytest.mark.parametrize("name", [*TINY_VLMS, *FAMILY_VLMS, "tiny_mllama"])
def test_vlm_text_only_requests(name):
    """Mllama's text requests too (its cross-attention layers skipped, as without images in HF)."""
    engine, hf_config = _engine(name)
    requests = _requests(hf_config, [6, 11], images=False)
    assert engine.generate(requests, 6, SamplingParams(), seed=0).tokens == _hf_generate(name, requests, 6)


@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_llama3_1_8b", *FAMILY_VLMS, "tiny_mllama"])
def test_capture_none_runs_the_same_loop(name):
    """The eager model in demollm's loop, on a batch where image and text requests mix."""
    engine, hf_config = _engine(name, capture="none")
    assert isinstance(engine.executor, EagerExecutor)
    requests = _requests(hf_config, [9, 9, 9], images=zoo.is_vlm(hf_config))
    assert engine.generate(requests, 6, SamplingParams(), seed=0).tokens == _hf_generate(name, requests, 6)


def _mllama_requests(hf_config, device: str = "cpu") -> list[Request]:
    """Image requests of different lengths side by side, one whose image sits 20 tokens in (the
    tokens before it attend its vision states evenly), then text requests."""
    generator = torch.Generator().manual_seed(4)
    skeleton = _skeleton(hf_config)
    requests = []
    for seq_id, (length, at) in enumerate([(9, 2), (40, 20), (30, 25), (7, None), (12, None)]):
        ids = torch.randint(20, 400, (length,), generator=generator).tolist()
        pixels, spans = {}, []
        if at is not None:
            image = synthetic_image(28 * (1 + seq_id), generator)
            tokens, pixels = image_part(hf_config, image, torch.float32, torch.device(device), None, skeleton)
            ids, spans = ids[:at] + tokens + ids[at:], [(at, at + len(tokens))]
        requests.append(with_mask_spans(hf_config, Request(seq_id, ids, pixels, image_spans=spans)))
    return requests


@pytest.mark.parametrize(
    ("capture", "device"),
    [("partial", "cpu"), ("none", "cpu"), pytest.param("partial", "cuda", marks=pytest.mark.cuda)],
)
def test_cross_attention_to_images_generates_what_hf_generate_does(capture, device):
    """Mllama's language model cross-attends each request's vision states at every step. Captured:
    prompts prefilled in chunks of 8 tokens beside other requests' (an image's cross-attention keys
    and values made in its request's first chunk, kept for its later chunks and decode steps). Eager: image requests
    of different lengths in one left-padded wave, text requests in the next (in one wave, HF's model
    would give them cross-attention over padding images)."""
    chunks = ["runtime.max_num_tokens=8"] if capture == "partial" else []
    attention = "triton" if device == "cuda" else "torch"
    engine, hf_config = _engine("tiny_mllama", capture, chunks, backend=attention, device=device)
    requests = _mllama_requests(hf_config, device)
    assert [r.cross_attention_mask is not None for r in requests] == [True, True, True, False, False]
    made = []  # the cross-attention keys and values: made once per image request (and zero states)
    if capture == "partial":
        record_of(engine.executor.graph).cross_kv.register_forward_hook(lambda *_: made.append(1))
    generation = engine.generate(requests, 6, SamplingParams(), seed=0)
    assert generation.tokens == _hf_generate("tiny_mllama", requests, 6)
    if capture == "none":
        lengths = [len(r.prompt) for r in requests]
        assert [s.fed for s in generation.steps if s.kind == "prefill"] == [
            sum(lengths[:3]),
            sum(lengths[3:]),
        ]
    else:
        assert not engine.executor.vision  # each request's keys and values go with it
        record = record_of(engine.executor.graph)
        # layer 0's self-attention has the paged KV cache; layer 1's cross-attention keys and values
        # are graph inputs, made of the states outside the graph, which no longer reads the states
        assert len(record.cache_specs) == 1 and record.cross_kv_inputs == ["cross_key_0", "cross_value_0"]
        assert "cross_attention_states" in record.unused_inputs
        assert len(made) == 1 + 3


def test_cross_attention_image_requests_run_from_the_command_line(tmp_path):
    """`python -m pipeline model=tiny_mllama`: the synthetic workload's requests each carry an
    image in a chat turn made by the family's Processor, and the tokens the run writes are Hugging
    Face generate's on those requests."""
    overrides = ["model=tiny_mllama", "prompt.batch_size=2", "prompt.prompt_len=24", "prompt.output_len=5"]
    quiet = [
        "tracking.enabled=false",
        "profile.enabled=false",
        "report.enabled=false",
        "backend=torch-simple",
    ]
    proc = run_pipeline([*overrides, *quiet], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((tmp_path / "run" / "generation" / "tokens.json").read_text())
    cfg = compose_cfg(overrides)
    hf_config = zoo.build_hf_config(cfg.model)
    sources = sources_of(None, hf_config, _skeleton(hf_config))  # the family's Processor lays them out
    requests = build_requests(
        cfg.prompt, cfg.runtime, cfg.seed, hf_config, torch.float32, torch.device("cpu"), sources
    )
    assert all(r.images and r.cross_attention_mask is not None for r in requests)
    want = _hf_generate("tiny_mllama", requests, 5)
    assert {row["seq_id"]: row["tokens"] for row in written} == want


@pytest.mark.parametrize("name", TINY_MODELS + TINY_MOE)
def test_the_eager_reference_computes_what_hf_generate_does(name):
    """capture=none's executor, the profile's eager reference: its prefill logits are the first
    scores of Hugging Face's own generate, and its lm_head computes one row per sequence, as
    generate's logits_to_keep=1 has it (a reference computing every prompt row would credit
    capture with lm_head work the captured side never does)."""
    engine, hf_config = _engine(name, capture="none")
    request = _requests(hf_config, [13], images=zoo.is_vlm(hf_config))[0]
    rows = []
    head = engine.executor.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2]))
    try:
        logits = engine.executor.prefill([Chunk(request, 0, len(request.prompt))])  # [1, V]
    finally:
        handle.remove()
    assert rows == [1]
    model, _, _ = build_tiny(name)
    with torch.no_grad():
        first = model.generate(
            **hf_inputs(model.config, request), max_new_tokens=1, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        ).logits[0]  # fmt: skip
    torch.testing.assert_close(logits, first, rtol=0, atol=1e-5)


def test_cached_keys_equal_eager_keys():
    """After prefill + k decode steps the paged cache holds, for one sequence, the keys (post-RoPE)
    that HF's own cache holds for the same prefix."""
    engine, hf_config = _engine("tiny_llama3_1_8b")
    requests = _requests(hf_config, [11, 19], images=False)
    executor = engine.executor
    logits = executor.prefill([Chunk(r, 0, len(r.prompt)) for r in requests])
    tokens = [requests[i].prompt + [int(logits[i].argmax())] for i in range(2)]
    for _ in range(3):
        logits = executor.decode(requests, torch.tensor([t[-1] for t in tokens]))
        for i in range(2):
            tokens[i].append(int(logits[i].argmax()))
    seq = requests[1]
    length = executor.cache.lengths[seq.seq_id]
    assert length == len(seq.prompt) + 3
    pages = torch.tensor(executor.cache.pages[seq.seq_id])
    positions = torch.arange(length)
    cache = executor.cache.tensors["kv_cache_0"]  # [2, P, page, Hkv, D]
    cached_keys = cache[0, pages[positions // PAGE], positions % PAGE]  # [S, Hkv, D]

    from transformers import DynamicCache

    eager, _, _ = build_tiny("tiny_llama3_1_8b")
    hf_cache = DynamicCache(config=eager.config)
    with torch.no_grad():
        eager(input_ids=torch.tensor([tokens[1][:length]]), past_key_values=hf_cache, use_cache=True)
    eager_keys = hf_cache.layers[0].keys[0].transpose(0, 1)  # [Hkv, S, D] -> [S, Hkv, D]
    torch.testing.assert_close(cached_keys, eager_keys, rtol=1e-5, atol=1e-5)


def test_cache_allocation_and_release():
    spec = [CacheSpec("kv_cache_0", 2, 4, torch.float32)]
    cache = PagedKVCache(spec, num_pages=5, page_size=8, device=torch.device("cpu"))  # 4 + scratch
    cache.reserve(0, 10)  # 2 pages
    cache.commit(0, 10)
    cache.reserve(0, 6)  # 16 tokens still fit 2 pages
    assert len(cache.pages[0]) == 2 and len(cache.free_pages) == 2
    cache.commit(0, 6)
    cache.reserve(1, 16)
    with pytest.raises(CacheFull, match="runtime.kv_cache_mb"):
        cache.reserve(2, 1)
    cache.free(0)
    assert len(cache.free_pages) == 2
    meta = cache.metadata([1], [16], torch.device("cpu"))
    assert meta["qo_indptr"].tolist() == [0, 16] and meta["cache_lens"].tolist() == [0]


def test_step_metadata():
    cache = PagedKVCache([CacheSpec("kv_cache_0", 2, 4, torch.float32)], 8, 4, torch.device("cpu"))
    for seq_id, n in ((3, 9), (5, 2), (7, 5)):
        cache.reserve(seq_id, n)
        cache.commit(seq_id, n)
        cache.reserve(seq_id, 1)
    meta = cache.metadata([3, 5, 7], [1, 1, 1], torch.device("cpu"))
    assert meta["qo_indptr"].tolist() == [0, 1, 2, 3] and meta["cache_lens"].tolist() == [9, 2, 5]
    assert meta["page_table"].tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    # Separate tensors at offset 0: torch.compile guards on storage offsets.
    assert all(t.storage_offset() == 0 and t.dtype == torch.int32 for t in meta.values())


@pytest.mark.parametrize(
    ("capture", "device"),
    [("partial", "cpu"), ("none", "cpu"), pytest.param("partial", "cuda", marks=pytest.mark.cuda)],
)
def test_lookahead_keeps_tokens_and_drops_those_past_eos(capture, device):
    """The host launching steps ahead of the tokens it has read changes nothing a user sees: a
    sequence that ends at EOS mid-batch ends there, its token computed ahead is dropped, and its
    pages go back. On CUDA the tokens travel through pinned asynchronous copies."""
    engine, hf_config = _engine("tiny_llama3_1_8b", capture=capture, device=device)
    requests = _requests(hf_config, [5, 9, 13], images=False)
    engine.lookahead = 0
    full = engine.generate(requests, 8, SamplingParams(), seed=0).tokens
    eos = full[1][2]  # the third token of the second sequence ends it
    expected = {s: t[: t.index(eos) + 1] if eos in t else t for s, t in full.items()}
    assert expected != full
    engine.eos_ids = {eos}
    for lookahead in (0, 1, 2):
        engine.lookahead = lookahead
        generation = engine.generate(requests, 8, SamplingParams(), seed=0)
        assert generation.tokens == expected, lookahead
        assert sum(generation.decode_step_tokens) == sum(len(t) - 1 for t in expected.values())
        if capture == "partial":
            assert len(engine.executor.cache.free_pages) == engine.executor.cache.num_pages - 1


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_only_the_steps_read_after_the_last_launch_did_no_model_work_on_cpu(lookahead):
    """On CPU a step runs at its launch, so each read's time holds the step launched before it; the
    steps read after the last launch did no model work and are marked so (the decode step chart
    leaves them out), as many as the engine runs ahead."""
    engine, hf_config = _engine("tiny_llama3_1_8b")
    engine.lookahead = lookahead
    steps = engine.generate(_requests(hf_config, [5, 9], images=False), 6, SamplingParams(), seed=0).steps
    decode = [s for s in steps if s.kind == "decode"]
    assert [s.worked for s in decode] == [True] * (len(decode) - lookahead) + [False] * lookahead
    assert all(s.worked for s in steps if s.kind == "prefill")


def test_out_of_pages_is_a_clear_error():
    engine, hf_config = _engine("tiny_magistral", overrides=["runtime.kv_cache_mb=1"])
    engine.executor.cache = PagedKVCache(
        record_of(engine.executor.graph).cache_specs, 4, PAGE, torch.device("cpu")
    )
    with pytest.raises(CacheFull, match="out of pages"):
        engine.generate(_requests(hf_config, [20, 20], images=False), 4, SamplingParams(), seed=0)


def test_allowed_mask_window_and_chunk():
    q_pos = torch.tensor([[5, 6]])
    k_pos = torch.arange(8)
    total = torch.tensor([7])
    assert allowed(q_pos, k_pos, total, 0, 0)[0, 1].tolist() == [True] * 7 + [False]
    assert allowed(q_pos, k_pos, total, 3, 0)[0, 1].tolist() == [False] * 4 + [True] * 3 + [False]
    assert allowed(q_pos, k_pos, total, 0, 4)[0, 1].tolist() == [False] * 4 + [True] * 3 + [False]


def test_sampling_is_seeded():
    engine, hf_config = _engine("tiny_magistral")
    requests = _requests(hf_config, [7, 7], images=False)
    hot = SamplingParams(temperature=1.5, top_k=50, top_p=0.9)
    first = engine.generate(requests, 8, hot, seed=3).tokens
    assert engine.generate(requests, 8, hot, seed=3).tokens == first
    assert engine.generate(requests, 8, hot, seed=4).tokens != first
    greedy = engine.generate(requests, 8, SamplingParams(), seed=0).tokens
    assert engine.generate(requests, 8, SamplingParams(temperature=1.0, top_k=1), seed=9).tokens == greedy


def test_local_image_files_go_through_the_preprocessing(tmp_path):
    from PIL import Image

    from pipeline.runtime.requests import build_requests

    path = tmp_path / "photo.png"
    Image.new("RGB", (150, 100), (200, 30, 30)).save(path)
    cfg = compose_cfg(
        ["model=tiny_mistral3", f"prompt.images=[{path}]", "prompt.batch_size=2", "prompt.prompt_len=40"]
    )
    from pipeline.config import validate

    validate(cfg, cuda_available=False)
    hf_config = zoo.build_hf_config(cfg.model)
    requests = build_requests(
        cfg.prompt, cfg.runtime, cfg.seed, hf_config, torch.float32, torch.device("cpu")
    )
    # 150 x 100 within the tower's 112 longest edge -> 112 x 84 (multiples of 28): 4 x 3 image tokens
    assert requests[0].images["image_sizes"].tolist() == [[84, 112]]
    assert requests[0].prompt.count(hf_config.image_token_index) == 12 and len(requests[0].prompt) == 40
    engine, _ = _engine("tiny_mistral3")
    assert engine.generate(requests, 4, SamplingParams(), seed=0).tokens == _hf_generate(
        "tiny_mistral3", requests, 4
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("prompt.images=[https://example.com/a.png]", "is a URL"),
        ("prompt.images=[/no/such.png]", "does not exist"),
    ],
)
def test_image_sources_are_checked_up_front(override, message):
    from pipeline.config import validate
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(["model=tiny_mistral3", override]), cuda_available=False)
