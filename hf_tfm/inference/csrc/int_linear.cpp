// hf_tfm::int_linear: a decode step's product of a few tokens by int8 or int4 weights, at the memory's streaming
// rate on an x86 CPU with AVX-512 VNNI or AVX2 (built on first use by hf_tfm/inference/kernels.py).
//
// y[t, n] = sum_g ws[n, g] * sum_{k in g} q[n, k] * x[t, k]: integer weights q with a float scale per group of
// inputs (a multiple of 64 inputs, at most 4096). Each token's inputs are rounded to int16 with a scale
// per group (a relative error of 2^-16, where llama.cpp's int8 inputs lose 2^-8: the weights' rounding is all the
// quantization there is, as "W4A16" promises), and a multiply-add of pairs of int16 (AVX-512 VNNI's `vpdpwssd`: 32
// weights widened to int16 by 32 inputs into 16 int32 sums; AVX2's `vpmaddwd` and an add: 16 into 8) takes them,
// so a weight costs a fraction of an instruction and the step waits on memory only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// The instruction set's vectors of 64 inputs' products: I16x32 holds 32 int16, I32x16 16 int32 sums, F32x16 16 floats
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
using I16x32 = __m512i;
using I32x16 = __m512i;
using F32x16 = __m512;
constexpr int ROWS = 4;  // rows a block multiplies at once: 4 x 2 tokens of sums and 4 rows of weights in 32 registers
inline I16x32 widen(__m256i bytes) { return _mm512_cvtepi8_epi16(bytes); }
inline I16x32 load_int16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline I32x16 zero_sums() { return _mm512_setzero_si512(); }
inline I32x16 multiply_add(I32x16 sums, I16x32 a, I16x32 b) { return _mm512_dpwssd_epi32(sums, a, b); }
inline F32x16 zero_floats() { return _mm512_setzero_ps(); }
inline F32x16 scaled_add(F32x16 acc, I32x16 sums, float scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(scale), acc);
}
inline float total(F32x16 v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
struct I16x32 {
  __m256i low, high;
};
struct I32x16 {
  __m256i low, high;
};
struct F32x16 {
  __m256 low, high;
};
constexpr int ROWS = 2;  // 16 registers of 256 bits: half AVX-512's rows
inline I16x32 widen(__m256i bytes) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1))};
}
inline I16x32 load_int16(const int16_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
inline I32x16 zero_sums() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32x16 multiply_add(I32x16 sums, I16x32 a, I16x32 b) {
  return {_mm256_add_epi32(sums.low, _mm256_madd_epi16(a.low, b.low)),
          _mm256_add_epi32(sums.high, _mm256_madd_epi16(a.high, b.high))};
}
inline F32x16 zero_floats() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32x16 scaled_add(F32x16 acc, I32x16 sums, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(sums.low), s, acc.low),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums.high), s, acc.high)};
}
inline float total(F32x16 v) {
  const __m256 eight = _mm256_add_ps(v.low, v.high);
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
#else
#error "hf_tfm::int_linear needs AVX-512 with VNNI, or AVX2 with FMA"
#endif

// How far ahead of its reads a thread asks for weights: the hardware prefetcher alone lost half the rate on rows of
// 768 bytes (7 vs 18-29 GB/s measured for 2048-4096 bytes ahead).
constexpr int64_t PREFETCH_BYTES = 4096;

// 64 weights of one row as two vectors of 32 int16 (inputs k..k+31, k+32..k+63)
template <int BITS>
inline void weights64(const uint8_t* row, int64_t k, I16x32& first, I16x32& second) {
  if constexpr (BITS == 8) {
    const auto* bytes = reinterpret_cast<const __m256i*>(row + k);
    first = widen(_mm256_loadu_si256(bytes));
    second = widen(_mm256_loadu_si256(bytes + 1));
  } else {
    // 64 weights in 32 bytes: byte j holds weight j + 8 in its low nibble and weight j + 32 + 8 in its high one
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2));
    const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    first = widen(_mm256_sub_epi8(_mm256_and_si256(packed, nibble), eight));
    second = widen(_mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), eight));
  }
}

// y[t, r] for R rows by TB tokens (x rows K apart, y rows N apart): each group's integer sums, scaled into floats
template <int BITS, int R, int TB>
inline void block(const int16_t* xq, const float* xs, int64_t K, const uint8_t* w, int64_t row_bytes,
                  const float* ws, int64_t groups, float* y, int64_t N, bool prefetch) {
  const int64_t group = K / groups;
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;  // the R rows lie one after the other
  F32x16 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = zero_floats();
  for (int64_t g = 0; g < groups; ++g) {
    I32x16 dot[R][TB];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t) dot[r][t] = zero_sums();
    for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
      I16x32 first[R], second[R];
      for (int r = 0; r < R; ++r) weights64<BITS>(w + r * row_bytes, k, first[r], second[r]);
      if (prefetch) {
        constexpr int lines = R * BITS / 8;  // cache lines of weights this step reads
        for (int i = 0; i < lines; ++i) _mm_prefetch(ahead + i * 64, _MM_HINT_T0);
        ahead += lines * 64;
      }
      for (int t = 0; t < TB; ++t) {
        const I16x32 x0 = load_int16(xq + t * K + k), x1 = load_int16(xq + t * K + k + 32);
        for (int r = 0; r < R; ++r) dot[r][t] = multiply_add(multiply_add(dot[r][t], first[r], x0), second[r], x1);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t) acc[r][t] = scaled_add(acc[r][t], dot[r][t], ws[r * groups + g] * xs[t * groups + g]);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[t * N + r] = total(acc[r][t]);
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
  constexpr int R = ROWS;
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
  // Each token's inputs rounded to int16 with a scale per group (the loops vectorize for the build's instruction set)
  std::vector<int16_t> xq(T * K);
  std::vector<float> xs(T * groups);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = xf + t * K + g * group;
      float amax = 0.0f;
      for (int64_t k = 0; k < group; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float inverse = amax > 0 ? 32767.0f / amax : 0.0f;
      int16_t* q = xq.data() + t * K + g * group;
      for (int64_t k = 0; k < group; ++k)  // nearest, ties even (the default rounding mode)
        q[k] = static_cast<int16_t>(std::clamp(std::nearbyint(v[k] * inverse), -32767.0f, 32767.0f));
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
