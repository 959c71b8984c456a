"""The AVX512-BF16 GEMV kernel (kernels/cpu_gemv.cpp) equals F.linear (a float32-accumulated
product rounded to bfloat16 once) at K and N with and without tails of the kernel's blocks;
pipeline::bf16_linear takes it for single rows only. Builds the kernel (about 40 s the first time,
then cached); skipped on a CPU without AVX512-BF16 or a compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipeline.ops  # noqa: F401  (registers pipeline::bf16_linear)
from pipeline.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(bool(cpu_gemv.unsupported()), reason=cpu_gemv.unsupported() or "-")


@pytest.mark.parametrize(("n", "k"), [(301, 256), (301, 77), (8, 31), (5, 5120)])  # rows % 8, K % 32
def test_gemv_is_f_linear(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=g).bfloat16()
    weight = torch.randn(n, k, generator=g).bfloat16()
    out = cpu_gemv.gemv(x, weight)
    exact = (x.float() @ weight.float().T).bfloat16()  # [1, N]
    assert out.dtype == torch.bfloat16 and out.shape == (1, n)
    # another float32 summation order: within one bfloat16 rounding step of the exact product
    scale = exact.float().abs().amax().item()
    torch.testing.assert_close(out.float(), exact.float(), rtol=2**-7, atol=2**-7 * scale)
    torch.testing.assert_close(out.float(), F.linear(x, weight).float(), rtol=2**-7, atol=2**-7 * scale)


def test_bf16_linear_takes_the_kernel_for_single_rows_only():
    """[1, 1, K] goes to the kernel, [2, 1, K] and float32 to F.linear; a bias adds."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    for shape in ((1, 1, 64), (2, 1, 64)):
        x = torch.randn(*shape, generator=g).bfloat16()
        assert cpu_gemv.applies(x, weight) == (shape[0] == 1)
        out = torch.ops.pipeline.bf16_linear(x, weight, bias)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=2**-7, atol=0.1)
    assert not cpu_gemv.applies(torch.randn(1, 64), weight.float())
    assert not cpu_gemv.applies(torch.randn(1, 40).bfloat16(), weight.T)  # not [N, K] contiguous


def test_bad_inputs_are_refused():
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        cpu_gemv.gemv(torch.randn(1, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="another K"):
        cpu_gemv.gemv(torch.randn(1, 8).bfloat16(), torch.randn(4, 9).bfloat16())
