"""Cached attention backends against each other and against plain attention over the full history."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.attention import cached_attention_op
from pipeline.attention.torch_backend import allowed

PAGE, H, HKV, D = 8, 4, 2, 16


def _case(device="cpu", dtype=torch.float32):
    """Two sequences: one with 10 cached tokens and 3 new, one with 12 new; scattered pages."""
    generator = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 16, PAGE, HKV, D, dtype=dtype)
    table = torch.tensor([[5, 2, -1], [7, 0, 9]], dtype=torch.int32)
    history = torch.randn(2, 10, HKV, D, generator=generator).to(dtype)
    for p in range(10):
        cache[:, table[0, p // PAGE], p % PAGE] = history[:, p]
    q = torch.randn(1, H, 15, D, generator=generator).to(dtype)
    k = torch.randn(1, HKV, 15, D, generator=generator).to(dtype)
    v = torch.randn(1, HKV, 15, D, generator=generator).to(dtype)
    meta = (torch.tensor([0, 3, 15], dtype=torch.int32), torch.tensor([10, 0], dtype=torch.int32), table)
    return [t.to(device) for t in (q, k, v, cache, *meta)], history


def _cached_attention(backend, q, k, v, cache, indptr, lens, table, window, chunk, block=None, softcap=0.0):
    """The op as the graph calls it: the step's plan, then the layer's attention."""
    tokens = torch.ops.pipeline.attention_plan(q, cache, indptr, lens, table)
    op = cached_attention_op(backend)
    return op(q, k, v, cache, indptr, lens, table, *tokens, block, 0.25, softcap, window, chunk)


# Sequence 1's new tokens 2..6 (positions 2..6) attend each other both ways; every other token is
# causal: [T, 2] in packed order (sequence 0's 3 tokens, then sequence 1's 12).
BLOCK = torch.tensor([(0, 0)] * 3 + [(0, 0)] * 2 + [(2, 7)] * 5 + [(0, 0)] * 5)


def test_plan_places_every_new_token():
    (q, _, _, cache, indptr, lens, table), _ = _case()
    seq, offset, pos, slot = torch.ops.pipeline.attention_plan(q, cache, indptr, lens, table)
    assert seq.tolist() == [0] * 3 + [1] * 12
    assert offset.tolist() == [0, 1, 2, *range(12)]
    assert pos.tolist() == [10, 11, 12, *range(12)]
    # sequence 0's positions 10..12 are in its second page (2); sequence 1's 8..11 in page 0
    assert slot.tolist() == [
        2 * PAGE + 2,
        2 * PAGE + 3,
        2 * PAGE + 4,
        *(7 * PAGE + p for p in range(8)),
        0,
        1,
        2,
        3,
    ]


def _expected(q, k, v, history, window, chunk, block=None, softcap=0.0):
    """Plain attention over each sequence's whole key list with the same mask rules (written out,
    with Hugging Face's cap, where there is one)."""
    outs = []
    for start, end, cached in [(0, 3, 10), (3, 15, 0)]:
        keys = (
            torch.cat([history[0][:cached], k[0, :, start:end].transpose(0, 1)])
            if cached
            else k[0, :, start:end].transpose(0, 1)
        )
        values = (
            torch.cat([history[1][:cached], v[0, :, start:end].transpose(0, 1)])
            if cached
            else v[0, :, start:end].transpose(0, 1)
        )
        q_pos = torch.arange(cached, cached + end - start)[None]
        blocks = None if block is None else block[start:end][None]
        mask = allowed(
            q_pos, torch.arange(keys.shape[0]), torch.tensor([keys.shape[0]]), window, chunk, blocks
        )
        if softcap:
            out = torch.ops.pipeline.attention(
                q[0, :, start:end][None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                mask[:, None], 0.25, False, softcap,
            )  # fmt: skip
        else:
            out = F.scaled_dot_product_attention(
                q[0, :, start:end][None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=mask,
                scale=0.25,
                enable_gqa=True,
            )
        outs.append(out[0])
    return torch.cat(outs, dim=1)[None]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("window", "chunk", "block", "softcap"),
    [
        (0, 0, None, 0.0),
        (5, 0, None, 0.0),
        (0, 8, None, 0.0),
        (0, 0, BLOCK, 0.0),
        (3, 0, BLOCK, 0.0),
        (0, 0, None, 1.5),
    ],
    ids=["causal", "window5", "chunk8", "block", "block-window3", "softcap"],
)
def test_backend_matches_plain_attention(backend, window, chunk, block, softcap):
    (q, k, v, cache, indptr, lens, table), history = _case()
    out = _cached_attention(backend, q, k, v, cache, indptr, lens, table, window, chunk, block, softcap)
    expected = _expected(q, k, v, history, window, chunk, block, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if block is not None or softcap:  # the option changes the result
        plain = _expected(q, k, v, history, window, chunk)
        assert not torch.allclose(out, plain, atol=1e-3)
    # the new keys landed in their pages: sequence 1's token 9 is in its second page, slot 1
    torch.testing.assert_close(cache[0, 0, 1], k[0, :, 3 + 9])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_step_matches_plain_attention(backend):
    """One new token per sequence (the torch backend's decode path), histories of 10 and 5 tokens."""
    generator = torch.Generator().manual_seed(1)
    cache = torch.zeros(2, 16, PAGE, HKV, D)
    table = torch.tensor([[5, 2], [7, -1]], dtype=torch.int32)
    history = [torch.randn(2, n, HKV, D, generator=generator) for n in (10, 5)]
    for row, h in enumerate(history):
        for p in range(h.shape[1]):
            cache[:, table[row, p // PAGE], p % PAGE] = h[:, p]
    q = torch.randn(1, H, 2, D, generator=generator)
    k, v = (torch.randn(1, HKV, 2, D, generator=generator) for _ in range(2))
    indptr, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([10, 5], dtype=torch.int32)
    out = _cached_attention(backend, q, k, v, cache, indptr, lens, table, 0, 0)
    for row, h in enumerate(history):
        keys = torch.cat([h[0], k[0, :, row][None]]).transpose(0, 1)  # [Hkv, n + 1, D]
        values = torch.cat([h[1], v[0, :, row][None]]).transpose(0, 1)
        expected = F.scaled_dot_product_attention(
            q[0, :, row : row + 1][None], keys[None], values[None], scale=0.25, enable_gqa=True
        )
        torch.testing.assert_close(out[:, :, row : row + 1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_llama4_scout", "tiny_gemma2", "tiny_gemma3"])
def test_triton_backend_generates_the_torch_backends_tokens(name):
    from test_runtime import _engine, _requests

    from pipeline.runtime.sampling import SamplingParams

    torch_engine, hf_config = _engine(name)
    triton_engine, _ = _engine(name, backend="triton")
    requests = _requests(hf_config, [5, 40], images=True)
    assert (
        triton_engine.generate(requests, 5, SamplingParams(), seed=0).tokens
        == torch_engine.generate(requests, 5, SamplingParams(), seed=0).tokens
    )


def test_flashinfer_page_layout():
    """Our padded page table as flashinfer's CSR pages (runs without flashinfer: pure torch)."""
    from pipeline.attention.flashinfer_backend import csr_pages

    table = torch.tensor([[5, 2, -1], [7, 0, 9]], dtype=torch.int32)
    indptr, indices, last = csr_pages(table, torch.tensor([13, 17]), PAGE)
    assert indptr.tolist() == [0, 2, 5] and indices.tolist() == [5, 2, 7, 0, 9] and last.tolist() == [5, 1]


@pytest.mark.cuda
@pytest.mark.parametrize("options", ["plain", "block", "softcap"])
@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_backends_on_gpu_in_bfloat16(backend, options):
    from pipeline.attention import SUPPORTS

    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    needs = {"plain": None, "block": "bidirectional", "softcap": "softcap"}[options]
    if needs and needs not in SUPPORTS[backend]:
        pytest.skip(f"{backend} has no {needs} (refused up front)")
    block = BLOCK.cuda() if options == "block" else None
    softcap = 1.5 if options == "softcap" else 0.0
    (q, k, v, cache, indptr, lens, table), history = _case("cuda", torch.bfloat16)
    out = _cached_attention(backend, q, k, v, cache, indptr, lens, table, 0, 0, block, softcap)
    expected = _expected(
        *(t.float().cpu() for t in (q, k, v)),
        history.float(),
        0,
        0,
        BLOCK if block is not None else None,
        softcap,
    )
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)


def test_auto_picks_a_kernel_on_cuda(monkeypatch):
    """auto: torch on CPU; on CUDA a paged kernel (flashinfer where installed, else triton), since
    a captured torch-backend step attends over every page of the table."""
    import importlib.util

    from pipeline.config import resolve_attention as resolve

    assert resolve("auto", on_cuda=False) == "torch" and resolve("torch", on_cuda=True) == "torch"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve("auto", on_cuda=True) == "triton"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert resolve("auto", on_cuda=True) == "flashinfer"
