"""bf16_gemv routes bfloat16 linears (graph and eager) to pipeline::bf16_linear on the same
weights; single rows then take the AVX512-BF16 kernel, more rows F.linear; other dtypes stay."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transform_helpers import apply

from pipeline.kernels import cpu_gemv
from pipeline.transforms.bf16_gemv import BF16GemvTransform, BF16Linear
from pipeline.transforms.registry import TransformConfig

pytestmark = pytest.mark.skipif(bool(cpu_gemv.unsupported()), reason=cpu_gemv.unsupported() or "-")


@pytest.mark.parametrize(("dtype", "matches"), [(torch.bfloat16, 1), (torch.float32, 0), (torch.float16, 0)])
def test_bf16_gemv_dtypes(dtype, matches):
    """bfloat16 goes to pipeline::bf16_linear and equals F.linear for a decode row and a prefill;
    float32 (onednn_linear's) and float16 stay F.linear."""
    linear = nn.Linear(96, 40).to(dtype)
    x = torch.randn(1, 3, 96, dtype=dtype)
    gm = torch.export.export(linear, (x,), dynamic_shapes=({1: torch.export.Dim.DYNAMIC},)).module()
    assert apply("bf16_gemv", gm) == matches
    assert any(n.target is torch.ops.pipeline.bf16_linear.default for n in gm.graph.nodes) == bool(matches)
    for tokens in (1, 7):  # the kernel's single row, then F.linear's
        x = torch.randn(1, tokens, 96, dtype=dtype)
        torch.testing.assert_close(gm(x), linear(x), rtol=2**-7, atol=2e-2)


def test_bf16_gemv_swaps_eager_linears_on_the_same_weights():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).bfloat16()
    weights = [model[0].weight, model[2].weight]
    x = torch.randn(1, 64).bfloat16()
    expected = model(x)
    transform = BF16GemvTransform(TransformConfig(scope="model"))
    assert transform.apply_model(model, None) == 2
    assert isinstance(model[0], BF16Linear) and [model[0].weight, model[2].weight] == weights
    torch.testing.assert_close(model(x), expected, rtol=2**-7, atol=2e-2)
