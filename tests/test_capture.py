"""Capture backends on tiny models: greedy tokens unchanged; CUDA-graph bucketing, padding and
slicing checked on CPU through the runner's uncaptured path; the CUDA paths where a GPU exists."""

from __future__ import annotations

import pytest
import torch
from conftest import COMPILED_SEEDS, TINY_MOE, generated_tokens, staged
from test_runtime import _engine, _hf_generate, _requests
from torch import fx, nn

from pipeline.backends import cudagraph
from pipeline.backends.compile import compile_module, compiled_frames
from pipeline.backends.compile_log import LOG, facts
from pipeline.graphs import record_of
from pipeline.models import zoo
from pipeline.runtime.sampling import SamplingParams


def test_buckets():
    assert cudagraph.default_buckets(8) == [1, 2, 4, 8]
    assert cudagraph.default_buckets(6) == [1, 2, 4, 6]
    assert [cudagraph.pick_bucket(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def _decode_step(cache_lens: list[int], table: list[list[int]], mrope: bool = False) -> dict:
    n = len(cache_lens)
    positions = torch.tensor([cache_lens])
    return {
        "input_ids": torch.arange(5, 5 + n)[None],
        "position_ids": positions[None].expand(3, 1, n) if mrope else positions,
        "qo_indptr": torch.arange(n + 1, dtype=torch.int32),
        "cache_lens": torch.tensor(cache_lens, dtype=torch.int32),
        "page_table": torch.tensor(table, dtype=torch.int32),
        "kv_cache_0": KV_CACHE,
    }


KV_CACHE = torch.zeros(2, 6, 8, 1, 4)


def test_static_step_padding_and_slicing():
    """A bucket's buffers take a step of 3 sequences, then of 2: the row the larger step left
    behind becomes a padded row again (nothing cached, page table at the scratch page)."""
    three = _decode_step([9, 4, 12], [[0, 1], [2, -1], [3, 4]])
    step = cudagraph.StaticStep(
        three, bucket=4, scratch_page=5, table_width=3, caches=frozenset({"kv_cache_0"})
    )
    step.fill(three)
    buffers = step.buffers
    assert buffers["input_ids"].tolist() == [[5, 6, 7, 0]] and buffers["position_ids"].tolist() == [
        [9, 4, 12, 0]
    ]
    assert buffers["qo_indptr"].tolist() == [0, 1, 2, 3, 4] and buffers["cache_lens"].tolist() == [
        9,
        4,
        12,
        0,
    ]
    assert buffers["page_table"].tolist() == [[0, 1, 5], [2, -1, 5], [3, 4, 5], [5, 5, 5]]
    assert buffers["kv_cache_0"] is KV_CACHE  # caches are static already
    addresses = {name: t.data_ptr() for name, t in buffers.items()}
    step.fill(_decode_step([10, 5], [[0, 1], [2, 3]]))
    assert {name: t.data_ptr() for name, t in buffers.items()} == addresses
    assert buffers["cache_lens"].tolist() == [10, 5, 0, 0]
    assert buffers["page_table"][:, 0].tolist() == [0, 2, 5, 5] and buffers["page_table"][1, 1] == 3
    out = cudagraph.slice_output({"last_hidden_state": torch.ones(1, 4, 16)}, n=3, bucket=4)
    assert out["last_hidden_state"].shape == (1, 3, 16)
    mrope = _decode_step([9, 4, 12], [[0], [1], [2]], mrope=True)
    step = cudagraph.StaticStep(mrope, 4, 5, 3, frozenset({"kv_cache_0"}))
    step.fill(mrope)
    assert step.buffers["position_ids"].shape == (3, 1, 4) and step.buffers["position_ids"][
        2, 0
    ].tolist() == [9, 4, 12, 0]


def test_decode_is_told_from_shapes():
    assert cudagraph.step_shape(_decode_step([9, 4], [[0], [1]])) == (2, 2)
    prefill = {**_decode_step([0, 0], [[0], [1]]), "position_ids": torch.arange(7)[None]}
    assert cudagraph.step_shape(prefill) == (2, 7)


@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_qwen2_5_vl"])
def test_cuda_graph_runner_path_keeps_tokens_on_cpu(name):
    """Buckets [2, 4]: 3 sequences decode padded to 4, then fewer; a batch of 5 runs uncaptured."""
    engine, hf_config = _engine(name)
    runner = _install_runner(engine, name, use_graphs=False)
    requests = _requests(hf_config, [5, 9, 13], images=True)
    assert engine.generate(requests, 6, SamplingParams(), seed=0).tokens == _hf_generate(name, requests, 6)
    assert runner.fallbacks == 1  # the prefill
    five = _requests(hf_config, [4, 5, 6, 7, 8], images=False)
    assert engine.generate(five, 3, SamplingParams(), seed=0).tokens == _hf_generate(name, five, 3)


def test_decode_step_host_work():
    """Outside the captured graph a decode step builds three host tensors (its sequence metadata,
    copied to the device) and never reads a device value, with or without the CUDA-graph runner;
    the runner adds only its input copies (embeddings, positions, cache lengths, page table)."""
    from pipeline.bench.engine_work import bench_engine_work

    rows = bench_engine_work("tiny_mistral3", [1, 3], ["torch-simple", "torch-cudagraph"], steps=4)["rows"]
    assert all(r["host_tensors"] == 3 and r["device_reads"] == 0 for r in rows), rows
    simple, graphs = (
        {r["batch"]: r["ops"] for r in rows if r["backend"] == b} for b in ("torch-simple", "torch-cudagraph")
    )
    assert graphs[1] == simple[1] + 4 and graphs[3] == simple[3] + 6  # batch 3 pads to 4: two resets


def _install_runner(engine, name: str, use_graphs: bool) -> cudagraph.CUDAGraphRunner:
    """A CUDA-graph runner with buckets [2, 4] behind the engine's graph, and a cache whose last
    page is the runner's scratch page."""
    runner = cudagraph.install(engine.executor.graph, engine_runtime(name), [2, 4], use_graphs=use_graphs)
    cache = engine.executor.cache
    engine.executor.cache = type(cache)(
        record_of(engine.executor.graph).cache_specs, runner.scratch_page + 1, cache.page_size, engine.device
    )
    return runner


def engine_runtime(name):
    from conftest import compose_cfg
    from test_runtime import PAGE

    return compose_cfg([f"model={name}", f"runtime.attn_page_size={PAGE}"]).runtime


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED_SEEDS + TINY_MOE)
def test_torch_compile_keeps_tokens(name):
    """The runtime parity test with the captured graph compiled (Inductor, dynamic shapes)."""
    engine, hf_config = _engine(name)
    compile_module(engine.executor.graph)
    requests = _requests(hf_config, [5, 9, 13], images=zoo.is_vlm(hf_config))
    tokens = engine.generate(requests, 6, SamplingParams(), seed=0).tokens
    assert tokens == _hf_generate(name, requests, 6)


@pytest.mark.slow
def test_torch_compile_of_the_whole_eager_model_with_capture_none():
    engine, hf_config = _engine("tiny_llama3_1_8b", capture="none")
    compile_module(engine.executor.model)
    requests = _requests(hf_config, [7, 7], images=False)
    tokens = engine.generate(requests, 5, SamplingParams(), seed=0).tokens
    assert tokens == _hf_generate("tiny_llama3_1_8b", requests, 5)


@pytest.mark.cuda
def test_cuda_graph_replays_keep_tokens_as_batches_shrink():
    """On a GPU, buckets [2, 4]: three sequences replay in bucket 4 (one padded row), then one ends
    at EOS and two replay in bucket 2, the host running a step ahead throughout; tokens equal the
    uncaptured graph's, cut at the EOS."""
    name = "tiny_llama3_1_8b"
    engine, hf_config = _engine(name, device="cuda")
    requests = _requests(hf_config, [5, 9, 13], images=False)
    full = engine.generate(requests, 8, SamplingParams(), seed=0).tokens
    # An EOS only the second sequence generates, early: the other two then decode alone.
    eos = next(t for t in full[1][1:4] if t not in full[0] + full[2])
    expected = {**full, 1: full[1][: full[1].index(eos) + 1]}
    runner = _install_runner(engine, name, use_graphs=True)
    engine.eos_ids = {eos}
    assert engine.generate(requests, 8, SamplingParams(), seed=0).tokens == expected
    assert runner.replays > 0 and sorted(runner.graphs) == [2, 4]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_cuda_backends_keep_tokens(backend, tmp_path):
    """End to end on a GPU: greedy tokens equal to torch-simple's, with CUDA graph replays."""

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
    tokens = [generated_tokens(tmp_path / d / "run") for d in ("simple", "graphs")]
    assert tokens[0] == tokens[1]
    _, runs = mlflow_runs(uri)
    graphs = next(r for r in runs if r.data.tags["backend"] == backend)
    assert graphs.data.metrics["capture/cuda_graph_replays"] > 0
    assert graphs.data.metrics["memory/cuda_graph_pool_mb"] > 0  # a capture's activations have their own pool


RECOMPILE_CASES = [
    pytest.param("tiny_mistral3", "partial", 1, id="tiny_mistral3-partial-1"),
    *[pytest.param(m, "partial", 3, id=f"{m}-partial-3", marks=pytest.mark.slow) for m in COMPILED_SEEDS],
    pytest.param("tiny_llama3_1_8b", "full", 2, id="tiny_llama3_1_8b-full-2", marks=pytest.mark.slow),
    pytest.param("tiny_llama3_1_8b", "none", 2, id="tiny_llama3_1_8b-none-2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("name", "capture", "batch"), RECOMPILE_CASES)
def test_generation_compiles_nothing(name, capture, batch):
    """Dynamo's own frame counter: everything generation runs was compiled by the capture stage,
    over prompts that fill pages and decode steps that open new ones (the page table widens)."""
    overrides = [
        f"model={name}", f"capture={capture}", "backend=torch-compile", f"prompt.batch_size={batch}",
        "prompt.prompt_len=21", "prompt.output_len=12", "runtime.attn_page_size=8",
        "profile.enabled=false", "report.enabled=false", "tracking.enabled=false",
    ]  # fmt: skip
    eager_whole = capture == "none"
    with staged(overrides, "generate") as state:
        capture, generate = (next(r for r in state.stages if r.name == n) for n in ("capture", "generate"))
        assert capture.metrics["capture/compiled_frames"] >= 1
        assert generate.metrics["capture/recompiles"] == 0
        assert compiled_frames() == state.compiled_frames
        assert LOG.since(state.compile_log_mark) == []
        # Hugging Face's eager model compiled whole (capture=none) breaks where its code does
        assert capture.metrics["capture/graph_breaks"] == 0 or eager_whole
        assert capture.metrics["capture/guards"] > 0 and capture.metrics["capture/inductor_kernels"] > 0


class _Printing(nn.Module):
    def forward(self, x):
        x = torch.sin(x)
        print("a graph break")
        return torch.cos(x)


def test_each_compiled_frame_is_logged_with_its_graph_break_and_recompile_reason(capsys):
    """compile_log.LOG: a graph module's frames under its name, the kernels Inductor made for
    each, the guard that failed when a call of another dtype recompiled it, and the reason a
    frame broke."""
    graph = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    mark = LOG.mark()
    compile_module(graph, "the_graph")
    graph(torch.randn(2, 4))
    graph.double()
    graph(torch.randn(2, 4, dtype=torch.float64))
    first, again = LOG.since(mark)
    assert (first.graph, again.graph) == ("the_graph", "the_graph")
    assert first.kernels >= 1 and first.guards > 0 and first.recompile_reason == ""
    assert "dtype" in again.recompile_reason or "mismatch" in again.recompile_reason, again
    broken = _Printing()
    mark = LOG.mark()
    compile_module(broken)
    broken(torch.randn(3))
    frames = LOG.since(mark)
    assert frames[0].graph_break and "print" in frames[0].graph_break, frames
    assert facts(frames)["graph_breaks"] == 1
