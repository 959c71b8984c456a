// bfloat16 GEMV on CPU with AVX-512 BF16: y[N] = W[N, K] . x[K] for one row x (a decode step at
// batch 1), float32 accumulation, y rounded to bfloat16 once at the end, as F.linear does.
//
// The product does 2 FLOPs per 2-byte weight, so it is bound by how fast W streams from memory:
// each thread takes a range of output rows and streams R of them side by side, K in steps of 32
// (vdpbf16ps: 32 bf16 products summed pairwise into 16 float32 lanes), the R accumulators in
// registers. R is compile-time (a runtime row count kept the accumulators on the stack).
// Measured here (2026-12-01, [57344, 5120] and [131072, 5120]): 33-36 GB/s where oneDNN's bf16
// matmul (F.linear) reads 29-31. For 2-4 rows the same scheme (R * B accumulators) read 21-28 GB/s
// against oneDNN's 29-32, so more rows stay with F.linear (kernels/cpu_gemv.py).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

namespace {

using bf16 = at::BFloat16;
constexpr int kRows = 8;  // rows streamed side by side: 8 loads in flight per 64-byte step

template <int R>
inline void rows(const bf16* x, const bf16* w, bf16* y, int64_t K, int64_t n0, int64_t full, __mmask32 tail) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const bf16* first = w + n0 * K;
  for (int64_t k = 0; k < full; k += 32) {
    const __m512i xv = _mm512_loadu_si512((const void*)(x + k));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512((const void*)(first + r * K + k));
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv, (__m512bh)xv);
    }
  }
  if (tail) {
    const __m512i xv = _mm512_maskz_loadu_epi16(tail, (const void*)(x + full));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(tail, (const void*)(first + r * K + full));
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv, (__m512bh)xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y[n0 + r] = bf16(_mm512_reduce_add_ps(acc[r]));
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 1 && weight.dim() == 2, "x [K] and a weight [N, K]");
  TORCH_CHECK(weight.size(1) == x.size(0), "x [K] against a weight of another K");
  const int64_t K = x.size(0), N = weight.size(0);
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty({N}, x.options());
  const bf16* xp = xc.data_ptr<bf16>();
  const bf16* wp = wc.data_ptr<bf16>();
  bf16* yp = out.data_ptr<bf16>();
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = K == full ? 0 : ((__mmask32)1 << (K - full)) - 1;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n0 = begin;
    for (; n0 + kRows <= end; n0 += kRows) rows<kRows>(xp, wp, yp, K, n0, full, tail);
    for (; n0 < end; ++n0) rows<1>(xp, wp, yp, K, n0, full, tail);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv, "weight [N, K] . x [K] -> [N], bfloat16"); }
