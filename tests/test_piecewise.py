"""Piecewise capture (backend.piecewise=true): the split at the layout ops, the token buckets, the
padding, the dispatch between the segments and the full graph, and the bucket table, against Hugging
Face's own generate; the capture itself where a GPU exists."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import COMPILED_SEEDS, compose_cfg, generated_tokens, staged, transform_context
from test_capture import engine_runtime
from test_runtime import PAGE, _engine, _hf_generate, _requests

from pipeline.backends import cudagraph, install, piecewise
from pipeline.config import BackendConfig
from pipeline.errors import ConfigError
from pipeline.graphs import SEGMENT, record_of
from pipeline.models import zoo
from pipeline.runtime.sampling import SamplingParams
from pipeline.transforms import registry
from pipeline.transforms.split_piecewise import SplitPiecewise


def _piecewise_engine(name: str, backend: str, tokens: list[int]):
    """A demollm engine whose graph is split and runs `backend` piecewise over `tokens` buckets, on
    CPU: the capturing backends' runners call each segment uncaptured."""
    engine, hf_config = _engine(name)
    history = registry.TransformHistory()
    ctx = transform_context(page_size=PAGE, hf_config=hf_config)
    registry.run_transforms(engine.executor.model, [SplitPiecewise()], ctx, history)
    graph = engine.executor.graph
    config = BackendConfig(backend, cuda_graph_batch_sizes=[2, 4], piecewise=True, piecewise_tokens=tokens)
    runners = install.apply(backend, [("lm", graph)], engine_runtime(name), config, on_cuda=False)
    return engine, hf_config, runners["lm (piecewise)"], history


def test_the_split_is_recorded_and_cuts_at_every_layout_op():
    """Static and layout segments alternate; every attention plan and cached attention is in a
    layout segment, nothing else is; the record says what each holds."""
    engine, _, runner, history = _piecewise_engine("tiny_mistral3", "torch-simple", [16, 64])
    graph = engine.executor.graph
    segments = record_of(graph).segments
    assert [s.kind for s in segments] == ["static", "layout", "static", "layout", "static"]
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target.__name__ == "getitem":
            continue
        layout = node.target._schema.name in ("pipeline::attention_plan", "pipeline::cached_attention")
        assert (segments[node.meta[SEGMENT]].kind == "layout") == layout, node
    record = next(r for r in history.records if r.transform == "split_piecewise")
    assert record.matches == 2 and record.matched[1].startswith("segment 1 layout:")
    assert "layers.0" in record.matched[1] and "layers.1" in record.matched[3]
    assert len(runner.segments) == 3
    # Segment labels name modules the language model holds, never a torch internal
    held = dict(record_of(graph).original.named_modules())
    assert all(module in held for s in segments for module in s.modules), [s.modules for s in segments]


def test_pieces_compute_the_full_graph_on_a_mixed_step():
    """One step that prefills a chunk of 5 tokens and decodes one token of another sequence, padded
    to bucket 8: the segments give the full graph's output on the real tokens."""
    engine, hf_config, runner, _ = _piecewise_engine("tiny_llama3_1_8b", "torch-simple", [8, 64])
    cache = engine.executor.cache
    for seq, n in ((0, 5), (1, 3)):  # sequence 1 has 3 tokens cached, sequence 0 none
        cache.reserve(seq, n if seq == 0 else n + 1)
    cache.commit(1, 3)
    meta = cache.metadata([0, 1], [5, 1], torch.device("cpu"))
    ids = torch.randint(5, 100, (1, 6))
    step = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 4, 3]]), **cache.tensors, **meta}
    before = {name: t.clone() for name, t in cache.tensors.items()}
    segmented = runner(**step)
    after = {name: t.clone() for name, t in cache.tensors.items()}
    for name, t in before.items():
        cache.tensors[name].copy_(t)
    full = runner.full_fn(**step)
    assert runner.stats.buckets[8].steps == 1 and runner.stats.buckets[8].tokens == 6
    torch.testing.assert_close(segmented[0], full[0], rtol=1e-5, atol=1e-5)
    scratch = runner.scratch_page
    for name, t in cache.tensors.items():  # the padding wrote only into the scratch page
        torch.testing.assert_close(after[name][:, :scratch], t[:, :scratch])


@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt", "torch-compile"])
def test_capturing_backends_dispatch_and_pad_on_cpu(backend):
    """Buckets [16, 64]: three prompts of mixed lengths (with images) prefill in bucket 64, a 70-token
    prompt is past the largest bucket and runs the full graph; decode steps go to the full graph;
    tokens equal Hugging Face's generate."""
    name = "tiny_mistral3"
    engine, hf_config, runner, _ = _piecewise_engine(name, backend, [16, 64])
    requests = _requests(hf_config, [5, 9, 13], images=True)
    assert engine.generate(requests, 5, SamplingParams(), seed=0).tokens == _hf_generate(name, requests, 5)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    report = runner.report()
    assert [r["bucket"] for r in report["rows"]] == [64] and report["rows"][0]["tokens"] == prompt_tokens
    # Read from the tensors the segments received: every static segment ran the bucket's 64 tokens
    (row,) = report["rows"]
    assert row["padded_tokens"] == 64 and row["segment_tokens"] == [64] and report["decode_steps"] == 4
    assert row["segment_calls"] == len(runner.segments) and report["suggested"][-1] == runner.max_tokens
    assert report["suggested_from_steps"] == 1
    long = _requests(hf_config, [70], images=False)
    assert engine.generate(long, 2, SamplingParams(), seed=0).tokens == _hf_generate(name, long, 2)
    assert runner.report()["uncaptured"] == {"more tokens than the largest bucket (64)": 1}


def test_suggested_buckets_cut_padding_within_the_budget():
    observed = [60, 60, 60, 20, 20, 9]
    buckets = [16, 32, 64]
    # The last bucket always runtime.max_num_tokens (64): a longer step than any seen still runs the
    # segments; below it no more buckets than now (2), summing to no more (48)
    suggested, waste = piecewise.suggest(observed, buckets, 64)
    assert suggested == [9, 20, 64] and waste == 3 * 4
    suggested, waste = piecewise.suggest([60], [64], 64)  # one step seen: never [60] alone
    assert suggested == [64] and waste == 4
    suggested, waste = piecewise.suggest(observed, [16, 32, 64, 128], 128)
    assert suggested == [9, 20, 60, 128] and waste == 0
    assert piecewise.suggest([100], [64], 64) == ([64], 0)  # nothing fit: nothing to suggest


def test_the_installed_runner_buckets_are_the_ones_the_memory_check_reads():
    """backend.piecewise_tokens when set, else 1, 2, 4, ... runtime.max_num_tokens (the last bucket
    the budget itself), for the runner install.apply builds as for the memory check."""
    runtime = compose_cfg(["runtime.max_num_tokens=48"]).runtime
    assert cudagraph.token_buckets(BackendConfig("torch-compile"), runtime) == [1, 2, 4, 8, 16, 32, 48]
    chosen = BackendConfig("torch-compile", piecewise=True, piecewise_tokens=[8, 48])
    assert cudagraph.token_buckets(chosen, runtime) == [8, 48]
    _, _, runner, _ = _piecewise_engine("tiny_llama3_1_8b", "torch-compile", [8, 32])
    assert runner.buckets == [8, 32]


def _pipeline_overrides(name: str, extra: list[str]) -> list[str]:
    return [
        f"model={name}", "backend=torch-compile", "backend.piecewise=true", "prompt.batch_size=3",
        "prompt.prompt_len=20", "prompt.output_len=6", "runtime.attn_page_size=8", "profile.enabled=false",
        "report.enabled=false", "tracking.enabled=false", *extra,
    ]  # fmt: skip


PIPELINE_MODELS = [
    pytest.param(m, marks=[] if m == "tiny_qwen2_5_vl" else pytest.mark.slow) for m in COMPILED_SEEDS
]


@pytest.mark.parametrize("name", PIPELINE_MODELS)
def test_torch_compile_piecewise_generates_hf_tokens(name, tmp_path):
    """The stages as `python -m pipeline backend=torch-compile backend.piecewise=true` runs them:
    the split in the transform history, the bucket table, nothing compiled during generation, and
    tokens equal to Hugging Face's generate on the same requests."""
    with staged(_pipeline_overrides(name, []), "generate", run_dir=tmp_path) as state:
        history = state.transform_history
        assert history.matches("split_piecewise") == 2  # two layers, one cached attention each
        generate = next(r for r in state.stages if r.name == "generate")
        assert generate.metrics["capture/recompiles"] == 0
        assert generate.metrics["piecewise/steps"] >= 1
        assert not any(k.startswith("memory/cuda_graph") for k in generate.metrics)  # no CUDA graph here
        report = json.loads((tmp_path / "generation" / "piecewise.json").read_text())
        assert report["segments_run"] == "compiled by Inductor" and report["rows"]
        requests = state.workload()
        tokens = generated_tokens(tmp_path)
    expected = _hf_generate(name, requests, 6)
    assert tokens == {r.seq_id: expected[r.seq_id] for r in requests}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["backend=torch-simple", "backend.piecewise=true"], "backend=torch-simple"),
        (["capture=none", "backend.piecewise=true"], "capture=none"),
        (
            ["backend.piecewise=true", "transforms.insert_cached_attention.enabled=false"],
            "insert_cached_attention",
        ),
        (["backend.piecewise=true", "backend.piecewise_tokens=[0,64]"], "backend.piecewise_tokens"),
        (["backend.piecewise_tokens=[64]"], "backend.piecewise=true"),
    ],
)
def test_piecewise_config_mistakes_are_refused(overrides, key):
    from pipeline.config import validate

    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        validate(compose_cfg(overrides), cuda_available=False)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_piecewise_capture_on_a_gpu(backend):
    """On a GPU: prefills replay their bucket's segment graphs (one shared pool, measured), decode
    replays the full graph; tokens equal the uncaptured graph's, for mixed prompt lengths with images
    and a second workload that reuses the captured buckets."""
    name = "tiny_mistral3"
    engine, hf_config = _engine(name, device="cuda")
    requests = _requests(hf_config, [5, 9, 13], images=True)
    for r in requests:
        r.images = {k: v.cuda() for k, v in r.images.items()}
    expected = engine.generate(requests, 6, SamplingParams(), seed=0).tokens
    history = registry.TransformHistory()
    ctx = transform_context("cuda", page_size=PAGE, hf_config=hf_config)
    registry.run_transforms(engine.executor.model, [SplitPiecewise()], ctx, history)
    config = BackendConfig(backend, piecewise=True, piecewise_tokens=[16, 64])
    runners = install.apply(
        backend, [("lm", engine.executor.graph)], engine_runtime(name), config, on_cuda=True
    )
    runner = runners["lm (piecewise)"]
    for _ in range(2):
        assert engine.generate(requests, 6, SamplingParams(), seed=0).tokens == expected
    report = runner.report()
    assert report["rows"][0]["steps"] == 2 and runner.pool_bytes() > 0
    assert all(segment.graphs for segment in runner.segments.values())
    assert runners["lm"].replays > 0  # decode: the full graph's replays


def test_the_profile_sees_inside_the_pieces(tmp_path):
    """With piecewise on, each segment's kernels go to the layers it holds: the layer view stays
    whole in prefill (the segments) and decode (the full graph)."""
    overrides = _pipeline_overrides("tiny_llama3_1_8b", ["profile.enabled=true", "profile.decode_steps=2"])
    with staged(overrides, "profile", run_dir=tmp_path) as state:
        profile = next(r for r in state.stages if r.name == "profile").metrics
    assert profile["profile/prefill_layer_coverage_pct"] >= 95
    assert profile["profile/decode_layer_coverage_pct"] >= 95
    assert profile["profile/attributed_inductor_provenance_pct"] > 0
    assert profile["profile/attributed_module_range_pct"] > 0  # the layout segments, eager


def test_a_pool_that_would_not_fit_is_refused_with_its_estimate():
    """The pool grows with the sum of the buckets (each keeps its segment outputs); a device with
    room for the model but not the pool is refused before any work, naming the key to change."""
    from pipeline.models.memory import check_piecewise_fits, needed_bytes, piecewise_pool_bytes

    cfg = compose_cfg(["model=mistral3"])
    hf_config = zoo.build_hf_config(cfg.model)
    text = hf_config.text_config
    one = piecewise_pool_bytes(hf_config, [1024], torch.bfloat16, capture_head=False)
    two = piecewise_pool_bytes(hf_config, [512, 1024], torch.bfloat16, capture_head=False)
    per_token = text.num_hidden_layers * (
        2 * (text.num_attention_heads + text.num_key_value_heads) * 128 + 2 * 5120
    )
    assert two - one == 512 * per_token * 2  # the largest bucket's temporaries are shared
    head = piecewise_pool_bytes(hf_config, [1024], torch.bfloat16, capture_head=True)
    assert head - one == 1024 * text.vocab_size * 2
    params = 24_000_000_000
    model = needed_bytes(params, hf_config, cfg.runtime, torch.bfloat16)
    buckets = cudagraph.default_buckets(cfg.runtime.max_num_tokens)
    with pytest.raises(ConfigError, match=r"backend.piecewise_tokens=\[1,2,4,8,16,32,64\]"):
        check_piecewise_fits(
            params, hf_config, cfg.runtime, buckets, False, torch.bfloat16, int(model) + 2**30
        )
    check_piecewise_fits(params, hf_config, cfg.runtime, [64], False, torch.bfloat16, int(model) + 2**30)


@pytest.mark.parametrize("capture_head", [False, True])
def test_a_whole_model_graph_keeps_its_logits_in_a_head_segment(capture_head, tmp_path):
    """capture=full: the lm_head after the last layout op is a segment of its own, captured only
    with backend.piecewise_capture_lm_head=true; tokens equal Hugging Face's either way."""
    name = "tiny_llama3_1_8b"
    extra = ["capture=full", f"backend.piecewise_capture_lm_head={str(capture_head).lower()}"]
    with staged(_pipeline_overrides(name, extra), "generate", run_dir=tmp_path) as state:
        runner = piecewise.runners(state.model)[0]
        graph = next(m for m in state.model.modules() if getattr(m, "piecewise_runner", None) is runner)
        segments = record_of(graph).segments
        assert [s.kind for s in segments[-3:]] == ["layout", "static", "head"]
        assert (f"segment_{segments[-1].index}" in runner.segments) == capture_head
        requests = state.workload()
        tokens = generated_tokens(tmp_path)
    expected = _hf_generate(name, requests, 6)
    assert tokens == {r.seq_id: expected[r.seq_id] for r in requests}


def test_a_segment_input_that_does_not_follow_the_tokens_is_refused_before_capture():
    """Mllama's cross-attention mask [B, 1, T, N] has the vision states' count N, which changes from
    step to step within one token bucket: a replay would meet another shape mid-run. Installing the
    segments for CUDA graphs refuses it at once, naming the input, before any capture (here on CPU:
    the refusal comes before anything asks for a GPU); uncaptured segments are left to run."""
    engine, hf_config = _engine("tiny_mllama")
    ctx = transform_context(page_size=PAGE, hf_config=hf_config)
    registry.run_transforms(engine.executor.model, [SplitPiecewise()], ctx, registry.TransformHistory())
    graph = engine.executor.graph
    options = dict(scratch_page=0, page_size=PAGE, capture_head=False, compile_segment=None, max_tokens=64)
    with pytest.raises(ValueError, match=r"segment_\d's input cross_attention_mask \[.*\] is copied"):
        piecewise.install(graph, [16, 64], use_graphs=True, **options)
    assert "piecewise_runner" not in graph._modules
    # A graph whose copied inputs all follow the tokens has nothing to refuse
    engine, hf_config = _engine("tiny_mistral3")
    ctx = transform_context(page_size=PAGE, hf_config=hf_config)
    registry.run_transforms(engine.executor.model, [SplitPiecewise()], ctx, registry.TransformHistory())
    graph = engine.executor.graph
    record = record_of(graph)
    kinds = {f"segment_{s.index}": s.kind for s in record.segments}
    caches = frozenset(spec.input_name for spec in record.cache_specs)
    assert piecewise.not_per_token(graph, piecewise.split(graph), kinds, caches) == []
