// bfloat16 GEMV on CPU: y[B, N] = x[B, K] . W for a few rows of x (a decode step), W either [N, K]
// (nn.Linear's layout) or [K, N] (Llama-4's experts), float32 accumulation, y rounded to bfloat16
// once at the end, as F.linear does.
//
// The product does 2 FLOPs per 2-byte weight, so it is bound by how fast W streams from memory:
// the kernels keep several weight streams in flight and all accumulators in registers, and read W
// once for up to kMaxRows rows of x.
//
// Two instruction sets, chosen when kernels/cpu_gemv.py builds this file for the CPU it runs on:
// - AVX-512 BF16 (__AVX512BF16__), [N, K], rows of x 4 at a time: vdpbf16ps, 32 bf16 products
//   summed pairwise into 16 float32 lanes; faster than oneDNN's bf16 matmul (F.linear) at 1-4
//   rows on the hosts it was measured on (BENCHMARKS.md, decode in bfloat16).
// - AVX2 + FMA, everything else: a bf16 is the high half of a float32 (split16 below), then FMA.
//   On an AVX2-only host PyTorch's bf16 matmul falls back to ATen's own loops (no oneDNN bf16),
//   several times slower than the memory reads (kernels/cpu_gemv.py).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kMaxRows = 4;  // rows of x per pass over W; more rows are taken 4 at a time

// 16 bf16 -> 2 x 8 float32. A bf16 is the high half of a float32: of each 32-bit lane holding the
// pair (w[2j], w[2j+1]), a left shift by 16 is w[2j] and masking the low half is w[2j+1]. Two
// single-uop ops per 16 weights (widening 8 at a time took four): this host's 256-bit ops are two
// 128-bit uops each (Zen 1), and the widening had made the kernel compute-bound.
struct Pairs {
  __m256 even, odd;  // w[2j] and w[2j+1] for j in 0..7
};

inline Pairs split16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

// Where element i of a length-L vector lies in the kernels' float32 buffers: within each block of
// 16, the 8 even-indexed elements first, then the 8 odd ones (split16's order); the tail past the
// last full block in place.
inline int64_t paired(int64_t i, int64_t full) {
  return i < full ? (i & ~int64_t{15}) + (i & 1) * 8 + (i & 15) / 2 : i;
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- [N, K] weight: each output is a dot product of a weight row with a row of x ----

// R weight rows streamed side by side against B rows of x (xf [B, K] float32 in paired order);
// R * B accumulators stay in registers. One row of x: each weight row's pairs meet x read from L1
// by the FMAs. More rows: the R rows' pairs are split first and each row of x is loaded once for
// all R of them (x's loads, two per row of x and weight row, had bound the 4-row kernel).
template <int R, int B>
inline void nk_rows(const float* xf, const bf16* w, float* y, int64_t K, int64_t N, int64_t n0) {
  __m256 acc[R][B];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
  const bf16* first = w + n0 * K;
  const int64_t full = K / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
    if constexpr (B == 1) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Pairs wv = split16(first + r * K + k);
        acc[r][0] = _mm256_fmadd_ps(wv.even, _mm256_loadu_ps(xf + k), acc[r][0]);
        acc[r][0] = _mm256_fmadd_ps(wv.odd, _mm256_loadu_ps(xf + k + 8), acc[r][0]);
      }
    } else {
      Pairs wv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) wv[r] = split16(first + r * K + k);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const __m256 even = _mm256_loadu_ps(xf + b * K + k), odd = _mm256_loadu_ps(xf + b * K + k + 8);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r][b] = _mm256_fmadd_ps(wv[r].even, even, acc[r][b]);
          acc[r][b] = _mm256_fmadd_ps(wv[r].odd, odd, acc[r][b]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float s = sum8(acc[r][b]);
      for (int64_t k = full; k < K; ++k) s += static_cast<float>(first[r * K + k]) * xf[b * K + k];
      y[b * N + n0 + r] = s;
    }
}

template <int B>
void nk_avx2(const float* xf, const bf16* w, float* y, int64_t K, int64_t N) {
  constexpr int R = B == 1 ? 8 : 2;  // registers: 8 + 3 at one row, 2R + 2B + 3 <= 15 at more
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n0 = begin;
    for (; n0 + R <= end; n0 += R) nk_rows<R, B>(xf, w, y, K, N, n0);
    for (; n0 < end; ++n0) nk_rows<1, B>(xf, w, y, K, N, n0);
  });
}

#if defined(__AVX512BF16__)
// How far ahead each weight row is prefetched, in 64-byte steps. The hardware prefetcher alone kept
// six rows' streams behind at four rows of x: at mistral3's shapes 16 steps (1 KiB) ahead read
// about a sixth faster than none at four rows, 8 steps a little faster at one row.
template <int B>
constexpr int64_t kPrefetch = B <= 2 ? 8 : 16;

// R weight rows against B rows of x: R * B accumulators, each row of x loaded once per 32 weights
// for all R weight rows, each weight row once for all B rows of x.
template <int R, int B>
inline void dpbf16_rows(const bf16* x, const bf16* w, bf16* y, int64_t K, int64_t N, int64_t n0,
                        int64_t full, __mmask32 tail) {
  __m512 acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const bf16* first = w + n0 * K;
  for (int64_t k = 0; k < full; k += 32) {
    __m512i xv[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) xv[b] = _mm512_loadu_si512((const void*)(x + b * K + k));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // a prefetch never faults: past a row's end it fetches the next row's start, read next anyway
      _mm_prefetch((const char*)(first + r * K + k + kPrefetch<B> * 32), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512((const void*)(first + r * K + k));
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)wv, (__m512bh)xv[b]);
    }
  }
  if (tail) {
    __m512i xv[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) xv[b] = _mm512_maskz_loadu_epi16(tail, (const void*)(x + b * K + full));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(tail, (const void*)(first + r * K + full));
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)wv, (__m512bh)xv[b]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) y[b * N + n0 + r] = bf16(_mm512_reduce_add_ps(acc[r][b]));
}

// B rows of x (1-4), bf16 products in hardware; y [B, N] written as bf16 directly
template <int B>
void nk_dpbf16(const bf16* x, const bf16* w, bf16* y, int64_t K, int64_t N) {
  // 8 weight loads in flight per 64-byte step at one or two rows; at three or four, 6 weight rows
  // keep R * B accumulators + B rows of x + a weight within the 32 zmm registers (4 read 4-10 %
  // slower at four rows)
  constexpr int R = B <= 2 ? 8 : 6;
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = K == full ? 0 : ((__mmask32)1 << (K - full)) - 1;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n0 = begin;
    for (; n0 + R <= end; n0 += R) dpbf16_rows<R, B>(x, w, y, K, N, n0, full, tail);
    for (; n0 < end; ++n0) dpbf16_rows<1, B>(x, w, y, K, N, n0, full, tail);
  });
}
#endif

// ---- [K, N] weight: y = sum over k of x[k] * W[k, :] ----

// Rows k0..k1 of W into acc [B, N] (float32 in paired order, += ). Four weight rows per sweep
// over N, so that acc is loaded and stored once per four rows; W streams row after row.
template <int B>
void kn_range(const float* xf, const bf16* w, float* acc, int64_t K, int64_t N, int64_t k0, int64_t k1) {
  const int64_t full = N / 16 * 16;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const bf16* w0 = w + k * N;
    for (int64_t n = 0; n < full; n += 16) {
      const Pairs v0 = split16(w0 + n), v1 = split16(w0 + N + n);
      const Pairs v2 = split16(w0 + 2 * N + n), v3 = split16(w0 + 3 * N + n);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const float* xs = xf + b * K + k;  // x[b, k..k+3], broadcast
        const __m256 x0 = _mm256_broadcast_ss(xs), x1 = _mm256_broadcast_ss(xs + 1);
        const __m256 x2 = _mm256_broadcast_ss(xs + 2), x3 = _mm256_broadcast_ss(xs + 3);
        float* out = acc + b * N + n;
        __m256 even = _mm256_loadu_ps(out), odd = _mm256_loadu_ps(out + 8);
        even = _mm256_fmadd_ps(v0.even, x0, even);
        odd = _mm256_fmadd_ps(v0.odd, x0, odd);
        even = _mm256_fmadd_ps(v1.even, x1, even);
        odd = _mm256_fmadd_ps(v1.odd, x1, odd);
        even = _mm256_fmadd_ps(v2.even, x2, even);
        odd = _mm256_fmadd_ps(v2.odd, x2, odd);
        even = _mm256_fmadd_ps(v3.even, x3, even);
        odd = _mm256_fmadd_ps(v3.odd, x3, odd);
        _mm256_storeu_ps(out, even);
        _mm256_storeu_ps(out + 8, odd);
      }
    }
    for (int64_t n = full; n < N; ++n)
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < 4; ++i) acc[b * N + n] += xf[b * K + k + i] * static_cast<float>(w0[i * N + n]);
  }
  for (; k < k1; ++k)
    for (int b = 0; b < B; ++b)
      for (int64_t n = 0; n < N; ++n)
        acc[b * N + paired(n, full)] += xf[b * K + k] * static_cast<float>(w[k * N + n]);
}

// Each thread takes a contiguous range of K (its own rows of W, one stream) into its own float32
// partial sums [B, N]; the partials are added at the end ([threads, B, N], a few hundred KB) and
// put back in column order.
template <int B>
void kn_avx2(const float* xf, const bf16* w, float* y, int64_t K, int64_t N) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), K / 64));
  const int64_t full = N / 16 * 16;
  std::vector<float> partial(threads * B * N, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t k0 = K * t / threads, k1 = K * (t + 1) / threads;
      kn_range<B>(xf, w, partial.data() + t * B * N, K, N, k0, k1);
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0.0f;
      for (int64_t t = 0; t < threads; ++t) s += partial[(t * B + b) * N + paired(n, full)];
      y[b * N + n] = s;
    }
}

// ---- entry points ----

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x [B, K] and a 2-D weight");
  TORCH_CHECK(weight.is_contiguous(), "a contiguous weight");
}

// x [B, K] -> float32 [B, K] (in paired order for the [N, K] kernel, which pairs x with the
// weight's pairs); y [B, N] float32 -> bf16, taking B rows kMaxRows at a time
template <typename Kernel>
at::Tensor in_groups(const at::Tensor& x, int64_t N, bool pair_x, Kernel kernel) {
  const int64_t rows = x.size(0), K = x.size(1);
  auto xf = at::empty({rows, K}, x.options().dtype(at::kFloat));  // [B, K]
  {
    const auto xc = x.contiguous();
    const bf16* src = xc.data_ptr<bf16>();
    float* dst = xf.data_ptr<float>();
    const int64_t full = pair_x ? K / 16 * 16 : 0;
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t k = 0; k < K; ++k) dst[b * K + paired(k, full)] = static_cast<float>(src[b * K + k]);
  }
  auto yf = at::empty({rows, N}, xf.options());  // [B, N]
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t group = std::min(kMaxRows, rows - r0);
    kernel(xf.data_ptr<float>() + r0 * K, yf.data_ptr<float>() + r0 * N, group);
  }
  return yf.to(at::kBFloat16);
}

// weight [N, K] (nn.Linear): x [B, K] -> [B, N]
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight) {
  check(x, weight);
  TORCH_CHECK(weight.size(1) == x.size(1), "x [B, K] against a weight [N, K] of another K");
  const int64_t K = x.size(1), N = weight.size(0);
  const bf16* wp = weight.data_ptr<bf16>();
#if defined(__AVX512BF16__)
  {
    const auto xc = x.contiguous();
    const int64_t rows = xc.size(0);
    auto out = at::empty({rows, N}, x.options());  // [B, N]
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const bf16* xr = xc.data_ptr<bf16>() + r0 * K;
      bf16* yr = out.data_ptr<bf16>() + r0 * N;
      switch (std::min(kMaxRows, rows - r0)) {
        case 1: nk_dpbf16<1>(xr, wp, yr, K, N); break;
        case 2: nk_dpbf16<2>(xr, wp, yr, K, N); break;
        case 3: nk_dpbf16<3>(xr, wp, yr, K, N); break;
        default: nk_dpbf16<4>(xr, wp, yr, K, N);
      }
    }
    return out;
  }
#else
  return in_groups(x, N, true, [&](const float* xf, float* y, int64_t group) {
    switch (group) {
      case 1: return nk_avx2<1>(xf, wp, y, K, N);
      case 2: return nk_avx2<2>(xf, wp, y, K, N);
      case 3: return nk_avx2<3>(xf, wp, y, K, N);
      default: return nk_avx2<4>(xf, wp, y, K, N);
    }
  });
#endif
}

// weight [K, N] (x @ W, Llama-4's experts): x [B, K] -> [B, N]
at::Tensor gemv_kn(const at::Tensor& x, const at::Tensor& weight) {
  check(x, weight);
  TORCH_CHECK(weight.size(0) == x.size(1), "x [B, K] against a weight [K, N] of another K");
  const int64_t K = x.size(1), N = weight.size(1);
  const bf16* wp = weight.data_ptr<bf16>();
  return in_groups(x, N, false, [&](const float* xf, float* y, int64_t group) {
    switch (group) {
      case 1: return kn_avx2<1>(xf, wp, y, K, N);
      case 2: return kn_avx2<2>(xf, wp, y, K, N);
      case 3: return kn_avx2<3>(xf, wp, y, K, N);
      default: return kn_avx2<4>(xf, wp, y, K, N);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "x [B, K] . weight [N, K]^T -> [B, N], bfloat16");
  m.def("gemv_kn", &gemv_kn, "x [B, K] . weight [K, N] -> [B, N], bfloat16");
}
