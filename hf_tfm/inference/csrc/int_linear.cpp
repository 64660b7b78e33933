// hf_tfm's integer kernels: a decode step's, a verify step's or a prompt's product of tokens by int8 or int4 weights,
// at the memory's streaming rate for one token, on an x86 CPU with AVX-512 VNNI or AVX2 (built on first use by
// hf_tfm/inference/kernels.py).
//
// y[t, n] = sum_g ws[n, g] * sum_{k in g} q[n, k] * x[t, k]: integer weights q with a float scale per group of
// inputs (a multiple of 64 inputs, at most 4096). Each token's inputs are rounded to integers with a scale per group,
// and integer multiply-adds take the products, so a weight costs a fraction of an instruction:
// - `tile_linear`, AVX-512 VNNI only: weights in tiles of 16 rows, one instruction multiplies a few inputs of a token,
//   broadcast, by the weights of each of the tile's 16 rows, so a tile's sums lie in the lanes of one vector: a
//   group's scaling is a few vector instructions for 16 rows (row by row it was a chain per row and token, more
//   instructions than the products), a block of 2 tiles by 4 tokens reuses each loaded weight and input, and one
//   token reads a single stream of weights. int4 weights (hf_tfm's q4) by inputs rounded to int8 (2^-8, as llama.cpp's
//   Q8_0 inputs are for its Q4_0 weights), `vpdpbusd` (64 products an instruction): TinyLlama's layer matrices on 2
//   Zen 4 cores, 128 tokens in 8.1 ms where row by row took 21.2 (700 GMAC/s), one token streams the weights at
//   50-55 GB/s where row by row read 40. int8 weights (q8, q4's lm_head, int8 checkpoints) by inputs rounded to int16,
//   `vpdpwssd` (32 products an instruction), as W8A16 promises;
// - `int_linear`: weights row by row, inputs rounded to int16 (a relative error of 2^-16: the weights' rounding is all
//   the quantization there is, as "W4A16" and "W8A16" promise), weights widened to int16, AVX-512 VNNI's `vpdpwssd`
//   (32 products an instruction) or AVX2's `vpmaddwd` and an add (16): GPTQ / AWQ int4 checkpoints, and every layer
//   on AVX2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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
#define INT_TILES 1  // tile_linear
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
  using Input = int16_t;
  using Vector = I16x32;
  static void weights(const uint8_t* row, int64_t k, Vector* w) { weights64<B>(row, k, w[0], w[1]); }
  static void inputs(const int16_t* x, Vector* v) {
    v[0] = load_int16(x);
    v[1] = load_int16(x + 32);
  }
  static I32x16 add(I32x16 sums, Vector w, Vector x) { return multiply_add(sums, w, x); }
};

// y[t, r] for R rows by TB tokens (x rows K apart, y rows N apart): each group's integer sums, scaled into floats.
template <typename P, int R, int TB>
inline void block(const typename P::Input* xq, const float* xs, int64_t K, const uint8_t* w, int64_t row_bytes,
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
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t) acc[r][t] = scaled_add(acc[r][t], dot[r][t], ws[r * groups + g] * xs[t * groups + g]);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[t * N + r] = total(acc[r][t]);
}

// All T tokens against R rows, two tokens at a time (more would not fit the 32 vector registers)
template <typename P, int R>
inline void rows(const typename P::Input* xq, const float* xs, int64_t T, int64_t K, const uint8_t* w,
                 int64_t row_bytes, const float* ws, int64_t groups, float* y, int64_t N) {
  int64_t t = 0;
  for (; t + 2 <= T; t += 2)
    block<P, R, 2>(xq + t * K, xs + t * groups, K, w, row_bytes, ws, groups, y + t * N, N, t == 0);
  if (t < T) block<P, R, 1>(xq + t * K, xs + t * groups, K, w, row_bytes, ws, groups, y + t * N, N, t == 0);
}

template <typename P>
void product(const typename P::Input* xq, const float* xs, int64_t T, int64_t K, const uint8_t* w, const float* ws,
             int64_t groups, float* y, int64_t N) {
  const int64_t row_bytes = K * P::BITS / 8;
  constexpr int R = ROWS;
  at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * R, last = std::min(n + R, N);
      if (last - n == R) {
        rows<P, R>(xq, xs, T, K, w + n * row_bytes, row_bytes, ws + n * groups, groups, y + n, N);
      } else {
        for (int64_t m = n; m < last; ++m)
          rows<P, 1>(xq, xs, T, K, w + m * row_bytes, row_bytes, ws + m * groups, groups, y + m, N);
      }
    }
  });
}

// Each token's inputs rounded to integers of at most `largest` with a scale per group (the loops vectorize for the
// build's instruction set), and the rounded inputs' sum per group where `xsum` is given
template <typename Input>
void round_inputs(const float* xf, int64_t T, int64_t K, int64_t groups, float largest, Input* xq, float* xs,
                  int32_t* xsum) {
  const int64_t group = K / groups;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = xf + t * K + g * group;
      float amax = 0.0f;
      for (int64_t k = 0; k < group; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float inverse = amax > 0 ? largest / amax : 0.0f;
      Input* q = xq + t * K + g * group;
      int32_t sum = 0;
      for (int64_t k = 0; k < group; ++k) {  // nearest, ties even (the default rounding mode)
        q[k] = static_cast<Input>(std::clamp(std::nearbyint(v[k] * inverse), -largest, largest));
        sum += q[k];
      }
      xs[t * groups + g] = amax / largest;
      if (xsum != nullptr) xsum[t * groups + g] = sum;
    }
}

template <typename P>
void multiply(const float* xf, int64_t T, int64_t K, const uint8_t* w, const float* ws, int64_t groups, float* y,
              int64_t N) {
  std::vector<typename P::Input> xq(T * K);
  std::vector<float> xs(T * groups);
  round_inputs(xf, T, K, groups, P::LARGEST, xq.data(), xs.data(), static_cast<int32_t*>(nullptr));  // signed weights
  product<P>(xq.data(), xs.data(), T, K, w, ws, groups, y, N);
}

// Checks shared by both operators: float32 inputs and scales, groups the kernels take; the number of inputs K
void check_inputs(const at::Tensor& x, const at::Tensor& scale, int64_t groups, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat, "hf_tfm::", op,
              ": float32 inputs and scales");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % groups == 0 && (K / groups) % 64 == 0, "hf_tfm::", op, ": groups of a multiple of 64 inputs");
  // A group's int32 sums must not overflow: a sum takes one product (at most 127 * 32767) of every 16 inputs
  TORCH_CHECK(K / groups <= 4096, "hf_tfm::", op, ": groups of at most 4096 inputs");
}

at::Tensor int_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "hf_tfm::int_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(weight.dim() == 2 && scale.dim() == 2 && scale.size(0) == weight.size(0),
              "hf_tfm::int_linear: weight (out, in * bits / 8) and scale (out, groups)");
  const int64_t K = x.size(-1), N = weight.size(0), groups = scale.size(1);
  check_inputs(x, scale, groups, "int_linear");
  TORCH_CHECK(weight.size(1) * 8 == K * bits, "hf_tfm::int_linear: ", K, " inputs need weight rows of ",
              K * bits / 8, " bytes, got ", weight.size(1));
  const int64_t T = x.numel() / K;
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const auto sc = scale.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  const auto run = bits == 8 ? &multiply<Int16Inputs<8>> : &multiply<Int16Inputs<4>>;
  run(xc.data_ptr<float>(), T, K, static_cast<const uint8_t*>(wc.data_ptr()), sc.data_ptr<float>(), groups,
      y.data_ptr<float>(), N);
  return y;
}

#ifdef INT_TILES
// tile_linear's layouts (kernels.pack_tiles): rows in tiles of TILE, the last one padded with zero weights, each step
// of a tile 64 bytes, a cache line, for the next INPUTS inputs k.. of its 16 rows in two halves:
// - int4: 8 inputs; byte 4r + j holds row r's weight of input k + j, plus 8, in its low nibble and that of input
//   k + 4 + j in its high one;
// - int8: 4 inputs; byte 2r + j holds row r's weight of input k + j, byte 32 + 2r + j that of input k + 2 + j.
// Scales: (tiles, groups, TILE).
constexpr int TILE = 16;
// A row's sum of a group lies in one lane: 16-bit inputs by int8 weights (at most 32767 x 128 a product) overflow
// it past this many inputs
constexpr int64_t TILE_INT8_GROUP_LIMIT = 512;

// How a tile's step is multiplied: its two halves of weights as two vectors, by a token's inputs of each half
// broadcast (4 bytes: 4 int8 or 2 int16 inputs a row), each a multiply-add into the 16 rows' int32 sums.
// int4 weights by int8 inputs, `vpdpbusd` (the weights unsigned: stored plus 8, which is taken out per group)
struct Int4Tiles {
  using Input = int8_t;
  static constexpr int BITS = 4, INPUTS = 8, BIAS = 8;
  static constexpr float LARGEST = 127.0f;
  static void weights(const uint8_t* step, __m512i* w) {
    const __m512i packed = _mm512_loadu_si512(step), nibble = _mm512_set1_epi8(0x0F);
    w[0] = _mm512_and_si512(packed, nibble);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  }
  static __m512i add(__m512i sums, __m512i w, __m512i x) { return _mm512_dpbusd_epi32(sums, w, x); }
};
// int8 weights, widened to int16, by int16 inputs: `vpdpwssd`
struct Int8Tiles {
  using Input = int16_t;
  static constexpr int BITS = 8, INPUTS = 4, BIAS = 0;
  static constexpr float LARGEST = 32767.0f;
  static void weights(const uint8_t* step, __m512i* w) {
    w[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step)));
    w[1] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32)));
  }
  static __m512i add(__m512i sums, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(sums, w, x); }
};

// y[t, n0 .. n0 + 16 RT) for TB tokens: RT tiles' sums by TB tokens' broadcast inputs, RT * TB vectors of 16 rows.
// Stored weights biased by P::BIAS make a group's sums hold BIAS times the sum of its rounded inputs too, which is
// taken out before scaling (exact, in integers).
template <typename P, int RT, int TB>
inline void tile_block(const typename P::Input* xq, const float* xs, const int32_t* xsum, int64_t K,
                       const uint8_t* w, int64_t tile_bytes, const float* ws, int64_t groups, float* y, int64_t N,
                       int64_t n0, bool prefetch) {
  const int64_t group = K / groups;
  __m512 acc[RT][TB];
  for (int r = 0; r < RT; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[RT][TB];
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < TB; ++t) dot[r][t] = _mm512_setzero_si512();
    for (int64_t k = g * group; k < (g + 1) * group; k += P::INPUTS) {
      __m512i weights[RT][2];  // the tile's weights of the step's two halves of inputs
      for (int r = 0; r < RT; ++r) {
        const uint8_t* step = w + r * tile_bytes + k * TILE * P::BITS / 8;
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(step) + PREFETCH_BYTES, _MM_HINT_T0);
        P::weights(step, weights[r]);
      }
      for (int t = 0; t < TB; ++t) {
        int32_t first, second;  // the token's inputs of each half, 4 bytes
        std::memcpy(&first, xq + t * K + k, 4);
        std::memcpy(&second, xq + t * K + k + P::INPUTS / 2, 4);
        const __m512i a = _mm512_set1_epi32(first), b = _mm512_set1_epi32(second);
        for (int r = 0; r < RT; ++r) dot[r][t] = P::add(P::add(dot[r][t], weights[r][0], a), weights[r][1], b);
      }
    }
    for (int t = 0; t < TB; ++t) {
      const __m512 input_scale = _mm512_set1_ps(xs[t * groups + g]);
      for (int r = 0; r < RT; ++r) {
        __m512i sums = dot[r][t];
        if constexpr (P::BIAS != 0) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(P::BIAS * xsum[t * groups + g]));
        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(ws + (r * groups + g) * TILE), input_scale);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    const int64_t rows = std::min<int64_t>(TILE, N - n0 - r * TILE);  // the last tile's padding is not written
    const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1);
    for (int t = 0; t < TB; ++t) _mm512_mask_storeu_ps(y + t * N + n0 + r * TILE, valid, acc[r][t]);
  }
}

// All T tokens against RT tiles, TB tokens at a time (RT = 2, TB = 4: 8 vectors of sums, 8 of floats, 4 of weights
// and 2 of inputs in the 32 registers), the last T % TB together
template <typename P, int RT, int TB>
void tiles(const typename P::Input* xq, const float* xs, const int32_t* xsum, int64_t T, int64_t K, const uint8_t* w,
           const float* ws, int64_t groups, float* y, int64_t N, int64_t tile) {
  const int64_t tile_bytes = TILE * K * P::BITS / 8;
  w += tile * tile_bytes;
  ws += tile * groups * TILE;
  int64_t t = 0;
  const auto at = [&](auto kernel) {
    kernel(xq + t * K, xs + t * groups, xsum + t * groups, K, w, tile_bytes, ws, groups, y + t * N, N, tile * TILE,
           t == 0);
  };
  for (; t + TB <= T; t += TB) at(tile_block<P, RT, TB>);
  static_assert(TB <= 4, "the last tokens are taken 1, 2 or 3 at once");
  switch (T - t) {
    case 1: at(tile_block<P, RT, 1>); break;
    case 2: at(tile_block<P, RT, 2>); break;
    case 3: at(tile_block<P, RT, 3>); break;
    default: break;
  }
}

// Up to this many tokens (a decode step, a batch, a speculative verify step) a tile takes all of them in one block,
// so the memory streams the next weights while every token's products run. In blocks of 4 tokens, the blocks after
// the first multiplied weights already read while the memory idled: TinyLlama's 22 layers of int4 took 1.9 one-token
// passes for 9 tokens (38.6-44.4 ms), and take 1.45 in one block (30.6-32.0 ms; 2 Zen 4 cores)
constexpr int64_t FEW_TOKENS = 9;

// All T <= FEW_TOKENS tokens against one tile in one block
template <typename P>
void few_tokens(const typename P::Input* xq, const float* xs, const int32_t* xsum, int64_t T, int64_t K,
                const uint8_t* w, const float* ws, int64_t groups, float* y, int64_t N, int64_t tile) {
  const int64_t tile_bytes = TILE * K * P::BITS / 8;
  const auto at = [&](auto kernel) {
    kernel(xq, xs, xsum, K, w + tile * tile_bytes, tile_bytes, ws + tile * groups * TILE, groups, y, N, tile * TILE,
           true);
  };
  static_assert(FEW_TOKENS == 9, "a case per token count");
  switch (T) {
    case 1: at(tile_block<P, 1, 1>); break;
    case 2: at(tile_block<P, 1, 2>); break;
    case 3: at(tile_block<P, 1, 3>); break;
    case 4: at(tile_block<P, 1, 4>); break;
    case 5: at(tile_block<P, 1, 5>); break;
    case 6: at(tile_block<P, 1, 6>); break;
    case 7: at(tile_block<P, 1, 7>); break;
    case 8: at(tile_block<P, 1, 8>); break;
    case 9: at(tile_block<P, 1, 9>); break;
    default: break;
  }
}

template <typename P>
void multiply_tiles(const float* xf, int64_t T, int64_t K, const uint8_t* w, const float* ws, int64_t groups,
                    int64_t count, float* y, int64_t N) {
  std::vector<typename P::Input> xq(T * K);
  std::vector<float> xs(T * groups);
  std::vector<int32_t> xsum(T * groups);
  round_inputs(xf, T, K, groups, P::LARGEST, xq.data(), xs.data(), P::BIAS != 0 ? xsum.data() : nullptr);
  // A few tokens stream the weights, a tile at a time (2 at a time read 10-20% slower); more take 2 tiles at once
  const int64_t step = T <= FEW_TOKENS ? 1 : 2;
  at::parallel_for(0, (count + step - 1) / step, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t tile = b * step;
      if (step == 1)
        few_tokens<P>(xq.data(), xs.data(), xsum.data(), T, K, w, ws, groups, y, N, tile);
      else if (tile + 2 <= count)
        tiles<P, 2, 4>(xq.data(), xs.data(), xsum.data(), T, K, w, ws, groups, y, N, tile);
      else
        for (int64_t u = tile; u < std::min(tile + step, count); ++u)
          tiles<P, 1, 4>(xq.data(), xs.data(), xsum.data(), T, K, w, ws, groups, y, N, u);
    }
  });
}

at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t out_features,
                       int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "hf_tfm::tile_linear: bits must be 4 or 8, got ", bits);
  const int64_t K = x.size(-1), N = out_features, inputs = bits == 4 ? 8 : 4;  // a step's
  TORCH_CHECK(weight.scalar_type() == (bits == 4 ? at::kByte : at::kChar) && weight.dim() == 3 &&
                  weight.size(1) * inputs == K && weight.size(2) == 64,
              "hf_tfm::tile_linear: ", K, " inputs need int", bits, " weight tiles (tiles, ", K / inputs, ", 64) of ",
              bits == 4 ? "uint8" : "int8", ", got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t count = weight.size(0), groups = scale.size(1);
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == count && scale.size(2) == TILE,
              "hf_tfm::tile_linear: scale (tiles, groups, 16)");
  TORCH_CHECK(N > (count - 1) * TILE && N <= count * TILE, "hf_tfm::tile_linear: ", count, " tiles hold ",
              (count - 1) * TILE + 1, " to ", count * TILE, " outputs, not ", N);
  check_inputs(x, scale, groups, "tile_linear");
  TORCH_CHECK(bits == 4 || K / groups <= TILE_INT8_GROUP_LIMIT,
              "hf_tfm::tile_linear: int8 weights take groups of at most ", TILE_INT8_GROUP_LIMIT, " inputs");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const auto sc = scale.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  const auto run = bits == 4 ? &multiply_tiles<Int4Tiles> : &multiply_tiles<Int8Tiles>;
  run(xc.data_ptr<float>(), x.numel() / K, K, static_cast<const uint8_t*>(wc.data_ptr()), sc.data_ptr<float>(), groups,
      count, y.data_ptr<float>(), N);
  return y;
}
#endif

}  // namespace

TORCH_LIBRARY(hf_tfm, m) {
  m.def("int_linear(Tensor x, Tensor weight, Tensor scale, int bits) -> Tensor");
#ifdef INT_TILES
  m.def("tile_linear(Tensor x, Tensor weight, Tensor scale, int out_features, int bits) -> Tensor");
#endif
}
TORCH_LIBRARY_IMPL(hf_tfm, CPU, m) {
  m.impl("int_linear", &int_linear);
#ifdef INT_TILES
  m.impl("tile_linear", &tile_linear);
#endif
}
