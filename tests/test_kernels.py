"""Triton kernels of the canonical ops equal their reference implementations.

Without a GPU they run in Triton's interpreter (conftest.py), which rounds float32 to bfloat16
towards zero where a GPU rounds to nearest: there float16 is the exact check of the kernels'
rounding, and bfloat16 is checked on a GPU.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import TINY_MOE

import pipeline.attention.common  # noqa: F401  (registers attention_plan)
from pipeline import kernels
from pipeline.models import zoo
from pipeline.ops import (
    add_rms_norm_reference,
    moe_reference,
    rms_norm_reference,
    rope_reference,
    silu_and_mul_reference,
)

ops = torch.ops.pipeline


def _assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.is_contiguous()
    if out.dtype == torch.float32:  # summation order and rsqrt may move the last bit
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weight", ["same", "float32", "none"])
def test_rms_norm_kernel(dtype, weight):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=g).mul(3).to(dtype)
    w = {
        "same": torch.randn(96, generator=g).to(dtype),
        "float32": torch.randn(96, generator=g),
        "none": None,
    }[weight]
    _assert_matches(kernels.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    rows_strided = x.transpose(0, 1)  # [5, 3, 96]: rows not evenly strided, copied first
    _assert_matches(kernels.rms_norm(rows_strided, w, 1e-5), rms_norm_reference(rows_strided, w, 1e-5))
    assert kernels.rms_norm(x[:0], w, 1e-5).shape == (0, 5, 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weight", ["same", "none"])
def test_add_rms_norm_kernel(dtype, weight):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(3, 5, 96, generator=g).mul(3).to(dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype) if weight == "same" else None
    for out, expected in zip(
        kernels.add_rms_norm(x, residual, w, 1e-5), add_rms_norm_reference(x, residual, w, 1e-5), strict=True
    ):
        _assert_matches(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_kernel(dtype):
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 5, 2 * 1500, generator=g).mul(3).to(dtype)  # two column blocks per half
    wider = torch.randn(3, 5, 4 + 2 * 64, generator=g).to(dtype)[..., 4:]  # rows strided, as a slice
    for x in (gate_up, wider):
        out, expected = kernels.silu_and_mul(x), silu_and_mul_reference(x)
        assert out.dtype == expected.dtype and out.shape == expected.shape and out.is_contiguous()
        # exp may differ in float32's last bit, which can move a float16 rounding by one ulp
        torch.testing.assert_close(out, expected, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kernel(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 16, generator=g).to(dtype).transpose(1, 2)  # [B, H, S, D], HF's view
    cos, sin = (torch.randn(2, 1, 7, 16, generator=g).to(dtype) for _ in range(2))  # [B, 1, S, D]
    _assert_matches(kernels.rope(q, cos, sin), rope_reference(q, cos, sin))
    _assert_matches(kernels.rope(q[0], cos[0], sin[0]), rope_reference(q[0], cos[0], sin[0]))  # [H, S, D]
    with pytest.raises(ValueError, match="at most 4 dims"):
        kernels.rope(q[None], cos, sin)


def test_attention_plan_kernel():
    """Prefill and decode sequences in one step, positions across page boundaries (page 64)."""
    qo_indptr = torch.tensor([0, 3, 4, 9, 10], dtype=torch.int32)  # new tokens 3, 1, 5, 1
    cache_lens = torch.tensor([0, 70, 5, 127], dtype=torch.int32)
    page_table = torch.tensor([[4, -1, -1], [1, 7, -1], [2, -1, -1], [3, 5, 6]], dtype=torch.int32)
    q, kv_cache = torch.empty(1, 2, 10, 8), torch.empty(2, 8, 64, 1, 8)  # q: [N, H, T, D]
    args = (q, kv_cache, qo_indptr, cache_lens, page_table)
    for out, expected in zip(kernels.attention_plan(*args), ops.attention_plan(*args), strict=True):
        assert out.dtype == torch.long and out.tolist() == expected.tolist()
    assert (
        kernels.attention_plan(q[:, :, :0], kv_cache, qo_indptr[:1], cache_lens[:0], page_table[:0])[
            0
        ].numel()
        == 0
    )


@pytest.mark.cuda
def test_ops_run_one_kernel_each_on_cuda():
    """On CUDA the ops are the Triton kernels (one launch each) and match the reference in
    bfloat16 too, rounding to nearest as aten does."""
    x = torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5120, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = (torch.randn(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv_cache = torch.empty(2, 4, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    qo_indptr, cache_lens = (torch.tensor(v, device="cuda", dtype=torch.int32) for v in ([0, 1], [70]))
    page_table = torch.tensor([[2, 3]], device="cuda", dtype=torch.int32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        normed = ops.rms_norm(x, w, 1e-5)
        added = ops.add_rms_norm(x, x, w, 1e-5)
        activated = ops.silu_and_mul(x)
        rotated = ops.rope(q, cos, sin)
        plan = ops.attention_plan(q, kv_cache, qo_indptr, cache_lens, page_table)
        torch.cuda.synchronize()
    kernel_names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sorted(kernel_names) == [
        "_attention_plan_kernel", "_rms_norm_kernel", "_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel"
    ], kernel_names  # fmt: skip
    torch.testing.assert_close(normed, rms_norm_reference(x, w, 1e-5))  # bfloat16: within 2 ulp (sum order)
    _assert_matches(rotated, rope_reference(q, cos, sin))
    _assert_matches(added[1], x + x)
    torch.testing.assert_close(activated, silu_and_mul_reference(x))
    torch.testing.assert_close(added[0], rms_norm_reference(x + x, w, 1e-5))
    assert [t.tolist() for t in plan] == [[0], [0], [70], [3 * 64 + 6]]
    for op, args in (
        (ops.rms_norm.default, (x, w, 1e-5)),
        (ops.add_rms_norm.default, (x, x, w, 1e-5)),
        (ops.silu_and_mul.default, (x,)),
        (ops.rope.default, (q, cos, sin)),
        (ops.attention_plan.default, (q, kv_cache, qo_indptr, cache_lens, page_table)),
    ):  # the kernels' outputs are what the fake kernels promise tracing
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
# a VLM with break rows, multimodal RoPE, chunked attention with MoE, a text MoE (suite budget: the
# dense text seeds' kernels run inside these)
@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_qwen2_5_vl", "tiny_llama4_scout", TINY_MOE[0]])
def test_kernels_keep_tokens(name):
    """A tiny model's engine as it runs on CUDA (triton attention), with the kernels registered for
    CPU tensors as well, so Triton's interpreter runs them at the models' own shapes and strides
    (q/k views of the fused qkv, HF's cos/sin, multimodal RoPE, weightless QK-norm, the vision
    towers' norms): greedy tokens equal the reference implementations'."""
    from test_runtime import _engine, _requests

    from pipeline.runtime.sampling import SamplingParams

    engine, hf_config = _engine(name, backend="triton")
    requests = _requests(hf_config, [5, 40], images=zoo.is_vlm(hf_config))
    expected = engine.generate(requests, 5, SamplingParams(), seed=0).tokens
    calls = Counter()

    def counted(op: str):
        def run(*args):
            calls[op] += 1
            return getattr(kernels, op)(*args)

        return run

    with torch.library._scoped_library("pipeline", "IMPL") as library:
        for op in ("rms_norm", "add_rms_norm", "rope", "silu_and_mul", "attention_plan", "moe"):
            library.impl(op, counted(op), "CPU")
        assert engine.generate(requests, 5, SamplingParams(), seed=0).tokens == expected
    uses_rope = hf_config.model_type != "llama4"  # Llama-4 rotates complex pairs (rope_complex)
    assert calls["rms_norm"] and calls["add_rms_norm"] and calls["attention_plan"], calls
    assert bool(calls["rope"]) == uses_rope, calls
    # Mixtral's experts are all routed (no dense MLP: no gated activation outside the moe kernel)
    assert bool(calls["silu_and_mul"]) == (hf_config.model_type != "mixtral"), calls
    assert bool(calls["moe"]) == (hf_config.model_type in ("llama4_text", "llama4", "mixtral")), calls


def _moe_args(layout: str, tokens: int, dtype: torch.dtype, generator: torch.Generator) -> tuple:
    """Random experts (8 of them, H 48, I 40: neither a power of two) in the layout of Llama-4
    ([E, H, 2I], routing weight on the input, top 1) or Mixtral ([E, 2I, H], on the output, top 2)."""
    experts, hidden, inter = 8, 48, 40
    top_k, transposed = (1, True) if layout == "llama4" else (2, False)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    selected = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=generator)
    gate_up_shape = (experts, hidden, 2 * inter) if transposed else (experts, 2 * inter, hidden)
    down_shape = (experts, inter, hidden) if transposed else (experts, hidden, inter)
    gate_up = torch.randn(gate_up_shape, generator=generator).mul(0.2).to(dtype)
    down = torch.randn(down_shape, generator=generator).mul(0.2).to(dtype)
    return x, selected, weights, gate_up, down, transposed, layout == "llama4"


@pytest.mark.parametrize("tokens", [1, 4, 3, 40])  # decode (one pair a block), prefill (blocks of 64)
@pytest.mark.parametrize("layout", ["llama4", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_kernel(dtype, layout, tokens):
    """The Triton moe (grouped GEMMs over pairs sorted by expert, each expert's run padded to a
    block) equals Hugging Face's all-experts form up to summation order: float32 to 1e-5, float16
    where an intermediate's rounding may differ by a unit in the last place."""
    args = _moe_args(layout, tokens, dtype, torch.Generator().manual_seed(tokens))
    out, expected = kernels.moe(*args), moe_reference(*args)
    assert out.dtype == dtype and out.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


def test_moe_kernel_strided_experts():
    """Experts as views with other strides (Llama-4's checkpoint layout transposed back) and an
    input with a row stride: the kernel reads through the strides."""
    x, selected, weights, gate_up, down, _, _ = _moe_args(
        "llama4", 5, torch.float32, torch.Generator().manual_seed(1)
    )
    wide = torch.randn(5, 96)
    wide[:, :48] = x
    args = (wide[:, :48], selected, weights, gate_up.transpose(1, 2), down.transpose(1, 2), False, True)
    torch.testing.assert_close(kernels.moe(*args), moe_reference(*args), rtol=1e-5, atol=1e-5)


def _cuda_kernel_source(op: str) -> str:
    """Where the op's active CUDA kernel was registered, from the dispatcher's table."""
    return next(
        line for line in torch._C._dispatch_dump(f"pipeline::{op}").splitlines() if line.startswith("CUDA:")
    )


def test_references_on_cuda_swaps_the_kernels_and_back():
    """The bench's A/B: inside, every op with a CUDA kernel takes its reference implementation on CUDA."""
    from pipeline.library import REFERENCES, references_on_cuda

    assert sorted(REFERENCES) == ["add_rms_norm", "attention_plan", "moe", "rms_norm", "rope", "silu_and_mul"]
    registered = {op: _cuda_kernel_source(op) for op in REFERENCES}
    assert all("pipeline/library.py" in source for source in registered.values()), registered
    with references_on_cuda():
        assert all(_cuda_kernel_source(op) != registered[op] for op in REFERENCES)
    assert {op: _cuda_kernel_source(op) for op in REFERENCES} == registered


@pytest.mark.cuda
def test_references_on_cuda_launch_no_triton_kernel():
    from pipeline.library import references_on_cuda

    x, w = torch.randn(4, 512, device="cuda"), torch.randn(512, device="cuda")
    with (
        references_on_cuda(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof,
    ):
        normed = ops.rms_norm(x, w, 1e-5)
        torch.cuda.synchronize()
    kernel_names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert "_rms_norm_kernel" not in kernel_names and len(kernel_names) > 1, kernel_names
    torch.testing.assert_close(normed, rms_norm_reference(x, w, 1e-5), rtol=0, atol=0)
