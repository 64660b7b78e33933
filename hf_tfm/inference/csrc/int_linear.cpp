// hf_tfm::int_linear: a decode step's product of a few tokens by int8 or int4 weights, at the memory's streaming
// rate on an AVX-512 VNNI CPU (built on first use by hf_tfm/inference/kernels.py).
//
// y[t, n] = sum_g ws[n, g] * sum_{k in g} q[n, k] * x[t, k]: integer weights q with a float scale per group of
// inputs (a multiple of 64 inputs, at most 4096). Each token's inputs are rounded to int16 with a scale
// per group (a relative error of 2^-16, where llama.cpp's int8 inputs lose 2^-8: the weights' rounding is all the
// quantization there is, as "W4A16" promises), and one `vpdpwssd` multiplies 32 weights widened to int16 by 32
// inputs into 16 int32 sums, so a weight costs a fraction of an instruction and the step waits on memory only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "hf_tfm::int_linear needs AVX-512 with VNNI"
#endif

namespace {

// How far ahead of its reads a thread asks for weights: the hardware prefetcher alone lost half the rate on rows of
// 768 bytes (7 vs 18-29 GB/s measured for 2048-4096 bytes ahead).
constexpr int64_t PREFETCH_BYTES = 4096;

// 64 weights of one row as two vectors of 32 int16 (inputs k..k+31, k+32..k+63)
template <int BITS>
inline void weights64(const uint8_t* row, int64_t k, __m512i& first, __m512i& second) {
  if constexpr (BITS == 8) {
    const auto* bytes = reinterpret_cast<const __m256i*>(row + k);
    first = _mm512_cvtepi8_epi16(_mm256_loadu_si256(bytes));
    second = _mm512_cvtepi8_epi16(_mm256_loadu_si256(bytes + 1));
  } else {
    // 64 weights in 32 bytes: byte j holds weight j + 8 in its low nibble and weight j + 32 + 8 in its high one
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2));
    const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    first = _mm512_cvtepi8_epi16(_mm256_sub_epi8(_mm256_and_si256(packed, nibble), eight));
    second = _mm512_cvtepi8_epi16(_mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), eight));
  }
}

// y[t, r] for R rows by TB tokens (x rows K apart, y rows N apart): each group's integer sums, scaled into floats
template <int BITS, int R, int TB>
inline void block(const int16_t* xq, const float* xs, int64_t K, const uint8_t* w, int64_t row_bytes,
                  const float* ws, int64_t groups, float* y, int64_t N, bool prefetch) {
  const int64_t group = K / groups;
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;  // the R rows lie one after the other
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R][TB];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t) dot[r][t] = _mm512_setzero_si512();
    for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
      __m512i first[R], second[R];
      for (int r = 0; r < R; ++r) weights64<BITS>(w + r * row_bytes, k, first[r], second[r]);
      if (prefetch) {
        constexpr int lines = R * BITS / 8;  // cache lines of weights this step reads
        for (int i = 0; i < lines; ++i) _mm_prefetch(ahead + i * 64, _MM_HINT_T0);
        ahead += lines * 64;
      }
      for (int t = 0; t < TB; ++t) {
        const __m512i x0 = _mm512_loadu_si512(xq + t * K + k), x1 = _mm512_loadu_si512(xq + t * K + k + 32);
        for (int r = 0; r < R; ++r)
          dot[r][t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(dot[r][t], first[r], x0), second[r], x1);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t) {
        const __m512 scale = _mm512_set1_ps(ws[r * groups + g] * xs[t * groups + g]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), scale, acc[r][t]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[t * N + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// All T tokens against R rows, two tokens at a time (more would not fit the 32 vector registers)
template <int BITS, int R>
inline void rows(const int16_t* xq, const float* xs, int64_t T, int64_t K, const uint8_t* w, int64_t row_bytes,
                 const float* ws, int64_t groups, float* y, int64_t N) {
  int64_t t = 0;
  for (; t + 2 <= T; t += 2)
    block<BITS, R, 2>(xq + t * K, xs + t * groups, K, w, row_bytes, ws, groups, y + t * N, N, t == 0);
  if (t < T) block<BITS, R, 1>(xq + t * K, xs + t * groups, K, w, row_bytes, ws, groups, y + t * N, N, t == 0);
}

template <int BITS>
void product(const int16_t* xq, const float* xs, int64_t T, int64_t K, const uint8_t* w, const float* ws,
             int64_t groups, float* y, int64_t N) {
  const int64_t row_bytes = K * BITS / 8;
  constexpr int R = 4;
  at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * R, last = std::min(n + R, N);
      if (last - n == R) {
        rows<BITS, R>(xq, xs, T, K, w + n * row_bytes, row_bytes, ws + n * groups, groups, y + n, N);
      } else {
        for (int64_t m = n; m < last; ++m)
          rows<BITS, 1>(xq, xs, T, K, w + m * row_bytes, row_bytes, ws + m * groups, groups, y + m, N);
      }
    }
  });
}

at::Tensor int_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "hf_tfm::int_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat,
              "hf_tfm::int_linear: float32 inputs and scales");
  TORCH_CHECK(weight.dim() == 2 && scale.dim() == 2 && scale.size(0) == weight.size(0),
              "hf_tfm::int_linear: weight (out, in * bits / 8) and scale (out, groups)");
  const int64_t K = x.size(-1), N = weight.size(0), groups = scale.size(1);
  TORCH_CHECK(weight.size(1) * 8 == K * bits, "hf_tfm::int_linear: ", K, " inputs need weight rows of ",
              K * bits / 8, " bytes, got ", weight.size(1));
  TORCH_CHECK(K % groups == 0 && (K / groups) % 64 == 0, "hf_tfm::int_linear: groups of a multiple of 64 inputs");
  // A group's int32 sums must not overflow: a sum takes one product (at most 127 * 32767) of every 16 inputs
  TORCH_CHECK(K / groups <= 4096, "hf_tfm::int_linear: groups of at most 4096 inputs");
  const int64_t T = x.numel() / K, group = K / groups;
  const auto xc = x.contiguous();
  const float* xf = xc.data_ptr<float>();
  // Each token's inputs rounded to int16 with a scale per group
  std::vector<int16_t> xq(T * K);
  std::vector<float> xs(T * groups);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = xf + t * K + g * group;
      __m512 largest = _mm512_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(v + k)));
      const float amax = _mm512_reduce_max_ps(largest);
      const __m512 inverse = _mm512_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
      for (int64_t k = 0; k < group; k += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + k), inverse));  // nearest, ties even
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq.data() + t * K + g * group + k), _mm512_cvtsepi32_epi16(q));
      }
      xs[t * groups + g] = amax / 32767.0f;
    }
  const auto wc = weight.contiguous();
  const auto sc = scale.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  const auto* w = static_cast<const uint8_t*>(wc.data_ptr());
  auto run = bits == 8 ? &product<8> : &product<4>;
  run(xq.data(), xs.data(), T, K, w, sc.data_ptr<float>(), groups, y.data_ptr<float>(), N);
  return y;
}

}  // namespace

TORCH_LIBRARY(hf_tfm, m) { m.def("int_linear(Tensor x, Tensor weight, Tensor scale, int bits) -> Tensor"); }
TORCH_LIBRARY_IMPL(hf_tfm, CPU, m) { m.impl("int_linear", &int_linear); }
