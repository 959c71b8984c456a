"""linear_choice: a decode-size linear on CPU runs whichever of its kernels was timed faster for the
shape on this host, timed once per shape and host (kept on disk for later processes); prefill-size
calls keep the transform's kernel."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

import pipeline.ops  # noqa: F401  (registers pipeline::onednn_linear and bf16_linear)
from pipeline.kernels import cpu_gemv, linear_choice


@pytest.fixture(autouse=True)
def no_choices_yet(monkeypatch, tmp_path):
    monkeypatch.setenv(linear_choice.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(linear_choice, "_chosen", None)


@pytest.fixture
def clock(monkeypatch):
    """linear_choice's clock, advanced only by the candidates: which is slower is given, not timed."""
    now = types.SimpleNamespace(s=0.0)
    monkeypatch.setattr(linear_choice, "time", types.SimpleNamespace(perf_counter=lambda: now.s))
    return now


def test_the_faster_candidate_is_chosen_once_per_shape(clock):
    calls = {"slow": 0, "fast": 0}

    def slow():
        calls["slow"] += 1
        clock.s += 1.0

    def fast():
        calls["fast"] += 1
        clock.s += 0.1

    assert linear_choice.fastest(("k", 1), (slow, fast)) == 1
    assert calls == {"slow": 1 + linear_choice.REPEATS, "fast": 1 + linear_choice.REPEATS}
    assert linear_choice.fastest(("k", 1), (slow, fast)) == 1  # kept: nothing timed again
    assert calls["slow"] == 1 + linear_choice.REPEATS
    assert linear_choice.fastest(("k", 2), (fast, slow)) == 0  # another shape is timed anew


def test_a_later_process_on_the_host_reads_the_choices(clock):
    """Another process (its choices not yet read) takes the file's choice without timing, even
    where it would time otherwise: every process on a host sums in the same order."""

    def slow():
        clock.s += 1.0

    assert linear_choice.fastest(("k", 1), (slow, lambda: None)) == 1
    linear_choice._chosen = None  # as a new process starts

    def not_timed():
        raise AssertionError("timed again")

    assert linear_choice.fastest(("k", 1), (not_timed, not_timed)) == 1
    assert json.loads(linear_choice.cache_path().read_text()) == {"k|1": 1}


def test_an_unreadable_file_is_timed_over(clock):
    path = linear_choice.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[not a dict")

    def slow():
        clock.s += 1.0

    assert linear_choice.fastest(("k", 1), (lambda: None, slow)) == 0
    assert json.loads(path.read_text()) == {"k|1": 0}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_onednn_linear_times_decode_sizes_only():
    weight, bias = torch.randn(48, 32), torch.randn(48)
    for tokens in (1, 4, linear_choice.DECODE_ROWS + 1):
        x = torch.randn(1, tokens, 32)
        out = torch.ops.pipeline.onednn_linear(x, weight, bias)
        torch.testing.assert_close(out, F.linear(x, weight, bias))
    assert set(linear_choice._chosen) == {
        "onednn_linear|torch.float32|1|48|32",
        "onednn_linear|torch.float32|4|48|32",
    }


@pytest.mark.skipif(bool(cpu_gemv.unsupported()), reason=cpu_gemv.unsupported() or "-")
def test_bf16_linear_times_the_kernel_against_f_linear_where_the_kernel_takes_x():
    weight, bias = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    for tokens in (1, 3, linear_choice.DECODE_ROWS + 1):
        x = torch.randn(1, tokens, 64).bfloat16()
        out = torch.ops.pipeline.bf16_linear(x, weight, bias)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=2**-7, atol=0.1)
    assert set(linear_choice._chosen) == {
        "bf16_linear|torch.bfloat16|1|40|64",
        "bf16_linear|torch.bfloat16|3|40|64",
    }


@pytest.mark.skipif(
    bool(cpu_gemv.unsupported()) or not cpu_gemv.onednn_bf16(),
    reason=cpu_gemv.unsupported() or "no oneDNN bf16 matmul: the [K, N] GEMV runs untimed",
)
def test_llama4s_k_n_experts_time_the_gemv_against_the_matmul():
    """A routed Llama-4 expert ([K, N] weights) at decode size is timed, a prefill's group not;
    either way the result is x @ W (test_ops compares the whole op with Hugging Face's block)."""
    gate_up, down = torch.randn(2, 64, 96).bfloat16(), torch.randn(2, 48, 64).bfloat16()
    for tokens in (1, linear_choice.DECODE_ROWS + 1):
        x = torch.randn(tokens, 64).bfloat16()
        selected = torch.zeros(tokens, 1, dtype=torch.long)  # every token to expert 0
        weights = torch.ones(tokens, 1)
        out = torch.ops.pipeline.moe(x, selected, weights, gate_up, down, True, True)
        expected = pipeline.ops.moe_reference(x, selected, weights, gate_up, down, True, True)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    assert set(linear_choice._chosen) == {"moe_kn|torch.bfloat16|1|64|96", "moe_kn|torch.bfloat16|1|48|64"}
