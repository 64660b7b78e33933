// hf_tfm::float_linear: the product of a few tokens (a batch decoding together, a short prompt) by float32 weights,
// reading each weight from memory once for all of them (built with int_linear.cpp by hf_tfm/inference/kernels.py).
//
// y[t, n] = sum_k w[n, k] * x[t, k]. MKL's GEMM, made for many tokens, read the bench's base-shape matrices at half
// this rate on an AMD EPYC: 8 tokens took 41 ms through MKL and 22 here, 32 tokens 67 and 52. A single token of a
// compiled step stays with `(x * W).sum(-1)`, which Inductor fuses into the step.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#if !defined(__AVX512F__)
#error "hf_tfm::float_linear needs AVX-512"
#endif

namespace {

// How far ahead of its reads a thread asks for weights, as in int_linear.cpp (measured: 8 KB for float rows)
constexpr int64_t PREFETCH_BYTES = 8192;

// y[t, r] for R rows by TB tokens (x rows K apart, y rows N apart); 16 inputs a vector, so 4 x 4 accumulators plus
// the R weight vectors fit the 32 vector registers
template <int R, int TB>
inline void block(const float* x, int64_t K, const float* w, float* y, int64_t N, bool prefetch) {
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;  // the R rows lie one after the other
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 weights[R];
    for (int r = 0; r < R; ++r) weights[r] = _mm512_loadu_ps(w + r * K + k);
    if (prefetch) {  // R cache lines of weights per 16 inputs
      for (int i = 0; i < R; ++i) _mm_prefetch(ahead + i * 64, _MM_HINT_T0);
      ahead += R * 64;
    }
    for (int t = 0; t < TB; ++t) {
      const __m512 inputs = _mm512_loadu_ps(x + t * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(weights[r], inputs, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[t * N + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// All T tokens against R rows, four at a time: the first block reads the rows from memory, the next ones from the
// cache (4 rows of 2048 inputs are 32 KB)
template <int R>
inline void rows(const float* x, int64_t T, int64_t K, const float* w, float* y, int64_t N) {
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) block<R, 4>(x + t * K, K, w, y + t * N, N, t == 0);
  for (; t + 2 <= T; t += 2) block<R, 2>(x + t * K, K, w, y + t * N, N, t == 0);
  if (t < T) block<R, 1>(x + t * K, K, w, y + t * N, N, t == 0);
}

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "hf_tfm::float_linear: float32 inputs and weights");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1), "hf_tfm::float_linear: weight (out, in) for ",
              x.size(-1), " inputs, got ", weight.sizes());
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(K % 16 == 0, "hf_tfm::float_linear: a multiple of 16 inputs, got ", K);
  const int64_t T = x.numel() / K;
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  const float* xf = xc.data_ptr<float>();
  const float* w = wc.data_ptr<float>();
  float* yf = y.data_ptr<float>();
  constexpr int R = 4;
  at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * R, last = std::min(n + R, N);
      if (last - n == R) {
        rows<R>(xf, T, K, w + n * K, yf + n, N);
      } else {
        for (int64_t m = n; m < last; ++m) rows<1>(xf, T, K, w + m * K, yf + m, N);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_tfm, m) { m.def("float_linear(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(hf_tfm, CPU, m) { m.impl("float_linear", &float_linear); }
