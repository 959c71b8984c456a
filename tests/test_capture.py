"""Capture backends on tiny models: greedy tokens unchanged; CUDA-graph bucketing, padding and
slicing checked on CPU through the runner's uncaptured path; the CUDA paths where a GPU exists."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS
from test_runtime import _engine, _hf_generate, _requests

from pipeline.backends import cudagraph
from pipeline.backends.compile import compile_module
from pipeline.models import zoo
from pipeline.runtime.sampling import SamplingParams


def test_buckets():
    assert cudagraph.default_buckets(8) == [1, 2, 4, 8]
    assert cudagraph.default_buckets(6) == [1, 2, 4, 6]
    assert [cudagraph.pick_bucket(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_padding_and_slicing_of_a_decode_step():
    inputs = {
        "input_ids": torch.tensor([[5, 6, 7]]),
        "position_ids": torch.tensor([[9, 4, 12]]),
        "qo_indptr": torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        "cache_lens": torch.tensor([9, 4, 12], dtype=torch.int32),
        "page_table": torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32),
        "kv_cache_0": torch.zeros(2, 6, 8, 1, 4),
    }
    padded = cudagraph.pad_step(inputs, bucket=4, scratch_page=5, table_width=3)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert padded["qo_indptr"].tolist() == [0, 1, 2, 3, 4] and padded["cache_lens"].tolist() == [9, 4, 12, 0]
    assert padded["page_table"].tolist() == [[0, 1, 5], [2, 5, 5], [3, 4, 5], [5, 5, 5]]
    assert padded["kv_cache_0"] is inputs["kv_cache_0"]  # caches are static already
    out = cudagraph.slice_output({"last_hidden_state": torch.ones(1, 4, 16)}, n=3, bucket=4)
    assert out["last_hidden_state"].shape == (1, 3, 16)
    mrope = cudagraph.pad_step({**inputs, "position_ids": torch.ones(3, 1, 3, dtype=torch.long)}, 4, 5, 3)
    assert mrope["position_ids"].shape == (3, 1, 4)


@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_qwen2_5_vl"])
def test_cuda_graph_runner_path_keeps_tokens_on_cpu(name):
    """Buckets [2, 4]: 3 sequences decode padded to 4, then fewer; a batch of 5 runs uncaptured."""
    engine, hf_config = _engine(name)
    runner = cudagraph.install(engine.runner.graph, engine_runtime(name), [2, 4], use_graphs=False)
    engine.runner.cache = type(engine.runner.cache)(
        engine.runner.graph.cache_specs,
        runner.scratch_page + 1,
        engine.runner.cache.page_size,
        torch.device("cpu"),
    )
    requests = _requests(hf_config, [5, 9, 13], images=True)
    assert engine.generate(requests, 6, SamplingParams(), seed=0).tokens == _hf_generate(name, requests, 6)
    assert runner.fallbacks == 1  # the prefill
    five = _requests(hf_config, [4, 5, 6, 7, 8], images=False)
    assert engine.generate(five, 3, SamplingParams(), seed=0).tokens == _hf_generate(name, five, 3)


def engine_runtime(name):
    from conftest import compose_cfg
    from test_runtime import PAGE

    return compose_cfg([f"model={name}", f"runtime.attn_page_size={PAGE}"]).runtime


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_MODELS)
def test_torch_compile_keeps_tokens(name):
    """The runtime parity test with the captured graph compiled (Inductor, dynamic shapes)."""
    engine, hf_config = _engine(name)
    compile_module(engine.runner.graph)
    requests = _requests(hf_config, [5, 9, 13], images=zoo.is_vlm(hf_config))
    tokens = engine.generate(requests, 6, SamplingParams(), seed=0).tokens
    assert tokens == _hf_generate(name, requests, 6)


@pytest.mark.slow
def test_torch_compile_of_the_whole_eager_model_with_capture_none():
    engine, hf_config = _engine("tiny_llama3_1_8b", capture="none")
    compile_module(engine.runner.model)
    requests = _requests(hf_config, [7, 7], images=False)
    tokens = engine.generate(requests, 5, SamplingParams(), seed=0).tokens
    assert tokens == _hf_generate("tiny_llama3_1_8b", requests, 5)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_cuda_backends_keep_tokens(backend, tmp_path):
    """End to end on a GPU: greedy tokens equal to torch-simple's, with CUDA graph replays."""
    import json

    from conftest import mlflow_runs, run_pipeline

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [
        "model=tiny_llama3_1_8b",
        "prompt.batch_size=3",
        "prompt.prompt_len=20",
        "prompt.output_len=8",
        "dtype=float32",
        f"tracking.uri={uri}",
    ]
    for name, extra in (("simple", "backend=torch-simple"), ("graphs", f"backend={backend}")):
        proc = run_pipeline([*common, extra], tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = [
        json.loads((tmp_path / d / "run" / "generation" / "tokens.json").read_text())
        for d in ("simple", "graphs")
    ]
    assert tokens[0] == tokens[1]
    _, runs = mlflow_runs(uri)
    graphs = next(r for r in runs if r.data.tags["backend"] == backend)
    assert graphs.data.metrics["capture/cuda_graph_replays"] > 0
