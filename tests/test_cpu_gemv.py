"""The bfloat16 GEMV kernel (kernels/cpu_gemv.cpp, built for this CPU's instruction set) equals a
float32-accumulated product rounded to bfloat16 once (F.linear's numerics) in both weight layouts,
at row counts, K and N with and without tails of the kernel's blocks; it takes decode-size calls
only. Builds the kernel (about 40 s the first
time, then cached); skipped on a CPU without AVX2 and FMA or without a compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipeline.ops  # noqa: F401  (registers pipeline::bf16_linear)
from pipeline.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(bool(cpu_gemv.unsupported()), reason=cpu_gemv.unsupported() or "-")


def _close(out: torch.Tensor, exact: torch.Tensor) -> None:
    """Another float32 summation order: within one bfloat16 rounding step of the exact product."""
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    scale = exact.float().abs().amax().item()
    torch.testing.assert_close(out.float(), exact.float(), rtol=2**-7, atol=2**-7 * scale)


# rows: 1-4 in one pass, 5 and 9 in groups of 4 plus a rest; n, k: multiples of the blocks and not
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("n", "k"), [(301, 256), (301, 77), (8, 31), (5, 5120)])
def test_gemv_is_f_linear(rows, n, k):
    """weight [N, K] (nn.Linear's layout): x @ weight^T."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    weight = torch.randn(n, k, generator=g).bfloat16()
    exact = (x.float() @ weight.float().T).bfloat16()  # [B, N]
    _close(cpu_gemv.gemv(x, weight), exact)
    _close(cpu_gemv.gemv(x, weight), F.linear(x, weight))


@pytest.fixture(params=[1, 3])
def threads(request):
    """One thread, and three splitting K unevenly (the suite's workers run with one each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("k", "n"), [(256, 64), (301, 77), (7, 40), (130, 5)])  # K % 4 (per thread), N % 16
def test_gemv_kn_is_matmul(rows, k, n, threads):
    """weight [K, N] (Llama-4's experts): x @ weight, each thread's rows of K summed apart."""
    g = torch.Generator().manual_seed(k * 1000 + n + rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    weight = torch.randn(k, n, generator=g).bfloat16()
    _close(cpu_gemv.gemv_kn(x, weight), (x.float() @ weight.float()).bfloat16())


def test_the_kernel_takes_decode_size_bfloat16_calls():
    """Up to DECODE_ROWS rows of x, bfloat16, a contiguous weight: the kernel can take it (whether
    it does is timed: test_linear_choice.py); a prefill, float32 and a non-contiguous weight not."""
    weight = torch.randn(40, 64).bfloat16()
    for shape, takes in (((1, 1, 64), True), ((2, 4, 64), True), ((1, 9, 64), False)):
        assert cpu_gemv.applies(torch.randn(*shape).bfloat16(), weight) == takes
    assert not cpu_gemv.applies(torch.randn(1, 64), weight.float())
    assert not cpu_gemv.applies(torch.randn(1, 40).bfloat16(), weight.T)  # not contiguous


def test_bad_inputs_are_refused():
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        cpu_gemv.gemv(torch.randn(1, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="another K"):
        cpu_gemv.gemv(torch.randn(1, 8).bfloat16(), torch.randn(4, 9).bfloat16())
    with pytest.raises(RuntimeError, match="another K"):
        cpu_gemv.gemv_kn(torch.randn(1, 8).bfloat16(), torch.randn(9, 4).bfloat16())
