// hf_tfm::int_linear: a decode step's product of a few tokens by int8 or int4 weights, at the memory's streaming
// rate on an x86 CPU with AVX-512 VNNI or AVX2 (built on first use by hf_tfm/inference/kernels.py).
//
// y[t, n] = sum_g ws[n, g] * sum_{k in g} q[n, k] * x[t, k]: integer weights q with a float scale per group of
// inputs (a multiple of 64 inputs, at most 4096). Each token's inputs are rounded to integers with a scale per group,
// and integer multiply-adds take the products, so a weight costs a fraction of an instruction:
// - input_bits 16: inputs rounded to int16 (a relative error of 2^-16: the weights' rounding is all the quantization
//   there is, as "W4A16" and "W8A16" promise), weights widened to int16, AVX-512 VNNI's `vpdpwssd` (32 products an
//   instruction) or AVX2's `vpmaddwd` and an add (16);
// - input_bits 8, int4 weights on AVX-512 VNNI (hf_tfm's q4): inputs rounded to int8 (2^-8, as llama.cpp's Q8_0
//   inputs are for its Q4_0 weights),
//   the weights' unsigned nibbles as they are stored, `vpdpbusd` (64 products an instruction, with nothing to widen):
//   a prompt or a verify step of several tokens, bound by the products where one token waits on memory, runs 1.4x
//   the products a second of the 16-bit ones (200 against 140 GMAC/s on 2 Zen 4 cores, TinyLlama's 2048 x 5632;
//   unpacking the nibbles and scaling each group's sums take the rest of the instructions).
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
#define INT4_BY_INT8 1
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

// How a product reads its operands: weights of BITS bits by inputs rounded to `Input` (at most LARGEST in magnitude),
// as VECTORS vectors a run of 64 inputs. Int16Inputs: weights widened to int16 by int16 inputs.
template <int B>
struct Int16Inputs {
  static constexpr int BITS = B, VECTORS = 2;
  static constexpr float LARGEST = 32767.0f;
  static constexpr bool BIASED = false;  // the weights are signed: nothing to take out of the sums
  using Input = int16_t;
  using Vector = I16x32;
  static void weights(const uint8_t* row, int64_t k, Vector* w) { weights64<B>(row, k, w[0], w[1]); }
  static void inputs(const int16_t* x, Vector* v) {
    v[0] = load_int16(x);
    v[1] = load_int16(x + 32);
  }
  static I32x16 add(I32x16 sums, Vector w, Vector x) { return multiply_add(sums, w, x); }
};

#ifdef INT4_BY_INT8
// int4 weights as stored, unsigned nibbles (the value + 8), by int8 inputs: one `vpdpbusd` a run of 64. Each group's
// sums then hold 8 times the sum of its rounded inputs too, which `unbias` takes out (exact, in integers).
struct Int4ByInt8 {
  static constexpr int BITS = 4, VECTORS = 1;
  static constexpr float LARGEST = 127.0f;
  static constexpr bool BIASED = true;
  using Input = int8_t;
  using Vector = __m512i;
  static void weights(const uint8_t* row, int64_t k, Vector* w) {
    // byte j of the 32 holds input j's weight in its low nibble and input j + 32's in its high one
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1);
    w[0] = _mm512_and_si512(both, _mm512_set1_epi8(0x0F));  // inputs k..k+63 in order
  }
  static void inputs(const int8_t* x, Vector* v) { v[0] = _mm512_loadu_si512(x); }
  static I32x16 add(I32x16 sums, Vector w, Vector x) { return _mm512_dpbusd_epi32(sums, w, x); }
  static I32x16 unbias(I32x16 sums, int32_t input_sum) {
    return _mm512_sub_epi32(sums, _mm512_zextsi128_si512(_mm_cvtsi32_si128(8 * input_sum)));  // from one lane
  }
};

#endif

// y[t, r] for R rows by TB tokens (x rows K apart, y rows N apart): each group's integer sums, scaled into floats.
// `xsum` holds each token's sum of rounded inputs per group, for the kinds whose weights are biased.
template <typename P, int R, int TB>
inline void block(const typename P::Input* xq, const float* xs, const int32_t* xsum, int64_t K, const uint8_t* w,
                  int64_t row_bytes, const float* ws, int64_t groups, float* y, int64_t N, bool prefetch) {
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
      typename P::Vector weights[R][P::VECTORS], inputs[P::VECTORS];
      for (int r = 0; r < R; ++r) P::weights(w + r * row_bytes, k, weights[r]);
      if (prefetch) {
        constexpr int lines = R * P::BITS / 8;  // cache lines of weights this step reads
        for (int i = 0; i < lines; ++i) _mm_prefetch(ahead + i * 64, _MM_HINT_T0);
        ahead += lines * 64;
      }
      for (int t = 0; t < TB; ++t) {
        P::inputs(xq + t * K + k, inputs);
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < P::VECTORS; ++v) dot[r][t] = P::add(dot[r][t], weights[r][v], inputs[v]);
      }
    }
    if constexpr (P::BIASED)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < TB; ++t) dot[r][t] = P::unbias(dot[r][t], xsum[t * groups + g]);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t) acc[r][t] = scaled_add(acc[r][t], dot[r][t], ws[r * groups + g] * xs[t * groups + g]);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[t * N + r] = total(acc[r][t]);
}

// All T tokens against R rows, two tokens at a time (more would not fit the 32 vector registers)
template <typename P, int R>
inline void rows(const typename P::Input* xq, const float* xs, const int32_t* xsum, int64_t T, int64_t K,
                 const uint8_t* w, int64_t row_bytes, const float* ws, int64_t groups, float* y, int64_t N) {
  int64_t t = 0;
  for (; t + 2 <= T; t += 2)
    block<P, R, 2>(xq + t * K, xs + t * groups, xsum + t * groups, K, w, row_bytes, ws, groups, y + t * N, N, t == 0);
  if (t < T)
    block<P, R, 1>(xq + t * K, xs + t * groups, xsum + t * groups, K, w, row_bytes, ws, groups, y + t * N, N, t == 0);
}

template <typename P>
void product(const typename P::Input* xq, const float* xs, const int32_t* xsum, int64_t T, int64_t K,
             const uint8_t* w, const float* ws, int64_t groups, float* y, int64_t N) {
  const int64_t row_bytes = K * P::BITS / 8;
  constexpr int R = ROWS;
  at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * R, last = std::min(n + R, N);
      if (last - n == R) {
        rows<P, R>(xq, xs, xsum, T, K, w + n * row_bytes, row_bytes, ws + n * groups, groups, y + n, N);
      } else {
        for (int64_t m = n; m < last; ++m)
          rows<P, 1>(xq, xs, xsum, T, K, w + m * row_bytes, row_bytes, ws + m * groups, groups, y + m, N);
      }
    }
  });
}

// Each token's inputs rounded with a scale per group (the loops vectorize for the build's instruction set), and the
// rounded inputs' sum per group
template <typename P>
void round_inputs(const float* xf, int64_t T, int64_t K, int64_t groups, typename P::Input* xq, float* xs,
                  int32_t* xsum) {
  const int64_t group = K / groups;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = xf + t * K + g * group;
      float amax = 0.0f;
      for (int64_t k = 0; k < group; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float inverse = amax > 0 ? P::LARGEST / amax : 0.0f;
      typename P::Input* q = xq + t * K + g * group;
      int32_t sum = 0;
      for (int64_t k = 0; k < group; ++k) {  // nearest, ties even (the default rounding mode)
        q[k] = static_cast<typename P::Input>(std::clamp(std::nearbyint(v[k] * inverse), -P::LARGEST, P::LARGEST));
        sum += q[k];
      }
      xs[t * groups + g] = amax / P::LARGEST;
      xsum[t * groups + g] = sum;
    }
}

template <typename P>
void multiply(const float* xf, int64_t T, int64_t K, const uint8_t* w, const float* ws, int64_t groups, float* y,
              int64_t N) {
  std::vector<typename P::Input> xq(T * K);
  std::vector<float> xs(T * groups);
  std::vector<int32_t> xsum(T * groups);
  round_inputs<P>(xf, T, K, groups, xq.data(), xs.data(), xsum.data());
  product<P>(xq.data(), xs.data(), xsum.data(), T, K, w, ws, groups, y, N);
}

at::Tensor int_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t bits,
                      int64_t input_bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "hf_tfm::int_linear: bits must be 4 or 8, got ", bits);
#ifdef INT4_BY_INT8
  TORCH_CHECK(input_bits == 16 || (input_bits == 8 && bits == 4),
              "hf_tfm::int_linear: input_bits must be 16, or 8 with int4 weights; got ", input_bits);
#else
  TORCH_CHECK(input_bits == 16, "hf_tfm::int_linear: input_bits must be 16 (8 needs AVX-512 VNNI); got ", input_bits);
#endif
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
  const int64_t T = x.numel() / K;
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const auto sc = scale.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  auto run = bits == 8 ? &multiply<Int16Inputs<8>> : &multiply<Int16Inputs<4>>;
#ifdef INT4_BY_INT8
  if (input_bits == 8) run = &multiply<Int4ByInt8>;
#endif
  run(xc.data_ptr<float>(), T, K, static_cast<const uint8_t*>(wc.data_ptr()), sc.data_ptr<float>(), groups,
      y.data_ptr<float>(), N);
  return y;
}

}  // namespace

TORCH_LIBRARY(hf_tfm, m) {
  m.def("int_linear(Tensor x, Tensor weight, Tensor scale, int bits, int input_bits=16) -> Tensor");
}
TORCH_LIBRARY_IMPL(hf_tfm, CPU, m) { m.impl("int_linear", &int_linear); }
