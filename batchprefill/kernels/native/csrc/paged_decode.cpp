// Decode attention read where the KV lies in the paged pool, a whole step's decodes in one call per layer.
//
// A step's decodes come in sets: the members of a set share a prefix of blocks (a set of one shares none).
// Each set's rows (its members' query heads) first walk the shared blocks together, one set per work item, so
// each shared key and value is read once for every member; then each decode, one per work item, goes on over
// its own blocks. Every row keeps one online softmax (running max, running sum, weighted values) across both
// walks, carried between them in the output rows and a small buffer, so nothing is merged afterwards: the
// Python merge of a shared and an own attention (index copies, log-sum-exp and rescaling, some 25 small torch
// ops per layer) took 12.4 ms of a 183 ms decode step at 80 decodes (benchmarks/step_ops.py). A walk reads whole
// blocks, every KV head of a token together: a trial reading one head's slice of each token was slower on long
// answers (the hardware prefetcher fetches the other heads' bytes anyway). Items run in parallel on the OpenMP runtime torch has already loaded (the
// library links libgomp.so.1, which resolves to torch's copy), so the kernel and torch's ops share one pool.
//
// Layouts (all contiguous):
//   query, out     [tokens, kv_heads * per_kv, dim] float32: the step's flat batch (query heads of one KV
//                  head adjacent); only decode rows are read and written
//   k, v           [num_blocks, block, kv_heads, dim] float32, bfloat16 (raw uint16 bits) or FP8 (bytes)
//   sets           [num_sets, 3] int64: first member (index into rows), member count, shared tokens
//   shared_blocks  [num_sets, shared_width] int64 block ids of each set's shared prefix
//   rows           [decodes] int64 flat-batch row of each member, sets' members adjacent
//   own_blocks     [decodes, own_width] int64 block ids after the shared ones; own_lens [decodes] their tokens

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "exp_nonpositive.h"

namespace {

// Whether a set's shared walk may take its scores as bfloat16 pair products (score_tiles_paired).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

inline void widen(const float* source, float* target, int64_t count) { std::memcpy(target, source, count * 4); }

inline void widen(const uint16_t* source, float* target, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits = static_cast<uint32_t>(source[i]) << 16;
    std::memcpy(&target[i], &bits, 4);
  }
}

// FP8 pools (kernels/fp8_kv.py), one byte an element. Per block of SmolLM2 (16 tokens x 3 heads x 64) that is 3,072
// bytes of K and of V to read where bfloat16 reads 6,144. Where AVX-512 VBMI is built, blocks convert by byte tables
// (fp8_to_bfloat16 below), and bfloat16 queries walk a decode's own blocks and small sets' shared ones by pair
// products (walk_few_paired), large sets' shared ones too (score_tiles_paired, accumulate_many_paired), as over a
// bfloat16 pool. Elsewhere a block is widened to float32 as a bfloat16 pool's is: e5m2 is a float16's upper byte;
// e4m3fn's seven low bits shifted into a float16's exponent and mantissa give its value / 256 exactly, subnormals too
// (the exponent biases differ by 8), so either widens as float16 bits by F16C's conversion, e4m3 then times 256.
struct E4M3 {
  uint8_t bits;
};
struct E5M2 {
  uint8_t bits;
};

inline uint16_t half_bits(E5M2 x) { return static_cast<uint16_t>(x.bits << 8); }
inline uint16_t half_bits(E4M3 x) { return static_cast<uint16_t>(((x.bits & 0x80) << 8) | ((x.bits & 0x7F) << 7)); }

inline float half_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16, exponent = (half >> 10) & 0x1Fu,
                 mantissa = half & 0x3FFu;
  uint32_t bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&bits, &magnitude, 4);
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
// FP8 to bfloat16 in registers, 64 codes at a time, by byte tables (AVX-512 VBMI: AMD Zen 4, Intel since Ice Lake):
// every e4m3 and e5m2 value is a bfloat16 exactly (3 and 2 mantissa bits, exponents within bfloat16's), so a code's
// seven magnitude bits look up its bfloat16's high and low bytes in two 128-entry tables (VPERMI2B over two
// registers each), the sign bit is copied into the high byte, and the bytes interleave into words: five
// instructions for 64 codes, where the F16C widening below takes 28 and a float32 buffer. The interleave
// (VPUNPCK*BW) works within 128-bit lanes, so the codes are first permuted into the order that leaves the words in
// place (kBfloat16Order), or straight from two tokens into pairs of adjacent tokens' values (kPairOrder).
constexpr bool kByteTables = true;

struct Fp8Tables {
  __m512i high[2], low[2];
};

template <typename Fp8>
inline Fp8Tables make_fp8_tables() {
  constexpr float kFactor = std::is_same_v<Fp8, E4M3> ? 256.0f : 1.0f;
  alignas(64) uint8_t high[128], low[128];
  for (int code = 0; code < 128; ++code) {
    const float value = half_to_float(half_bits(Fp8{static_cast<uint8_t>(code)})) * kFactor;
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    // e4m3fn has no infinity: its code 0x7F is its NaN (half_bits reads it as 480)
    const uint16_t bfloat16 = std::is_same_v<Fp8, E4M3> && code == 0x7F ? 0x7FC0 : static_cast<uint16_t>(bits >> 16);
    high[code] = static_cast<uint8_t>(bfloat16 >> 8);
    low[code] = static_cast<uint8_t>(bfloat16 & 0xFF);
  }
  return {{_mm512_load_si512(high), _mm512_load_si512(high + 64)}, {_mm512_load_si512(low), _mm512_load_si512(low + 64)}};
}

template <typename Fp8>
inline const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = make_fp8_tables<Fp8>();
  return tables;
}

// Byte permutations (indices for VPERMB / VPERMI2B), each built from where a byte lands: the interleave puts the
// code at byte 16 L + 8 h + k (lane L, half h) at word 8 L + k of output h.
struct CodeOrders {
  __m512i bfloat16, float32, pair_low, pair_high;
};

inline CodeOrders make_code_orders() {
  alignas(64) uint8_t bfloat16[64], float32[64], pair_low[64], pair_high[64];
  for (int p = 0; p < 64; ++p) {
    const int lane = p / 16, half = (p / 8) % 2, k = p % 8;
    const int word = 32 * half + 8 * lane + k;  // the word of the two outputs this byte becomes
    bfloat16[p] = static_cast<uint8_t>(word);
    // widened further to float32 by interleaving each word output with zeros (words 4 m + j of a lane: output m)
    float32[p] = static_cast<uint8_t>(16 * ((p / 4) % 4) + 4 * lane + p % 4);
    // pairs: word 2 d + i is dimension d of token i (bit 6 picks the second token's register)
    pair_low[p] = static_cast<uint8_t>(64 * (word % 2) + word / 2);
    pair_high[p] = static_cast<uint8_t>(64 * (word % 2) + 32 + word / 2);
  }
  return {_mm512_load_si512(bfloat16), _mm512_load_si512(float32), _mm512_load_si512(pair_low),
          _mm512_load_si512(pair_high)};
}

inline const CodeOrders& code_orders() {
  static const CodeOrders orders = make_code_orders();
  return orders;
}

// 64 codes, already permuted, as 64 bfloat16 values in two registers.
struct Bfloat16s {
  __m512i low, high;
};

inline Bfloat16s fp8_to_bfloat16(__m512i codes, const Fp8Tables& tables) {
  const __m512i looked_up = _mm512_permutex2var_epi8(tables.high[0], codes, tables.high[1]);
  const __m512i high = _mm512_ternarylogic_epi32(looked_up, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  const __m512i low = _mm512_permutex2var_epi8(tables.low[0], codes, tables.low[1]);
  return {_mm512_unpacklo_epi8(low, high), _mm512_unpackhi_epi8(low, high)};
}
#else
constexpr bool kByteTables = false;
#endif

template <typename Fp8>
inline void widen_fp8(const Fp8* source, float* target, int64_t count) {
  constexpr bool kE4M3 = std::is_same_v<Fp8, E4M3>;
  constexpr float kFactor = kE4M3 ? 256.0f : 1.0f;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(source);
  int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  {  // by the byte tables, then each bfloat16 word as a float32's high half: 10 instructions for 64 codes
    const Fp8Tables& tables = fp8_tables<Fp8>();
    const __m512i order = code_orders().float32, zero = _mm512_setzero_si512();
    for (; i + 64 <= count; i += 64) {
      const auto [low, high] = fp8_to_bfloat16(_mm512_permutexvar_epi8(order, _mm512_loadu_si512(bytes + i)), tables);
      _mm512_storeu_si512(target + i, _mm512_unpacklo_epi16(zero, low));
      _mm512_storeu_si512(target + i + 16, _mm512_unpackhi_epi16(zero, low));
      _mm512_storeu_si512(target + i + 32, _mm512_unpacklo_epi16(zero, high));
      _mm512_storeu_si512(target + i + 48, _mm512_unpackhi_epi16(zero, high));
    }
  }
#endif
#if defined(__AVX512F__)
  const __m512 factor = _mm512_set1_ps(kFactor);
  for (; i + 16 <= count; i += 16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i));
    __m256i half;
    if constexpr (kE4M3) {  // sign-extended, shifted by 7: the sign lands in bit 15; its copy in bit 14 is cleared
      half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7),
                              _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    } else {
      half = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
    }
    _mm512_storeu_ps(target + i, _mm512_mul_ps(_mm512_cvtph_ps(half), factor));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 factor = _mm256_set1_ps(kFactor);
  for (; i + 8 <= count; i += 8) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i));
    __m128i half;
    if constexpr (kE4M3) {  // as above
      half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
    } else {
      half = _mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8);
    }
    _mm256_storeu_ps(target + i, _mm256_mul_ps(_mm256_cvtph_ps(half), factor));
  }
#endif
  for (; i < count; ++i) target[i] = half_to_float(half_bits(source[i])) * kFactor;
}

inline void widen(const E4M3* source, float* target, int64_t count) { widen_fp8(source, target, count); }
inline void widen(const E5M2* source, float* target, int64_t count) { widen_fp8(source, target, count); }

template <typename Cache>
constexpr bool kFp8 = std::is_same_v<Cache, E4M3> || std::is_same_v<Cache, E5M2>;
// Pools whose elements are bfloat16 or widen to it exactly (FP8): the pair products can read them.
template <typename Cache>
constexpr bool kPairable = kFp8<Cache> || std::is_same_v<Cache, uint16_t>;
// Head sizes the paired weights-times-values loops take (64 dimensions a step).
constexpr bool pairs_head(int64_t dim) { return dim == 64 || dim == 128 || dim == 256; }

// An FP8 block as bfloat16 bits, for the pair products (score_tiles_paired): every e4m3 and e5m2 value is a bfloat16
// exactly (3 and 2 mantissa bits, exponents within bfloat16's), so the upper half of its float32 is the value.
template <typename Fp8>
inline void narrow_to_bfloat16(const Fp8* source, uint16_t* target, float* widened, int64_t count) {
  int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  const Fp8Tables& tables = fp8_tables<Fp8>();
  const __m512i order = code_orders().bfloat16;
  for (; i + 64 <= count; i += 64) {
    const auto [low, high] = fp8_to_bfloat16(_mm512_permutexvar_epi8(order, _mm512_loadu_si512(source + i)), tables);
    _mm512_storeu_si512(target + i, low);
    _mm512_storeu_si512(target + i + 32, high);
  }
#endif
  widen_fp8(source + i, widened, count - i);
  for (int64_t j = 0; j < count - i; ++j) {
    uint32_t bits;
    std::memcpy(&bits, widened + j, 4);
    target[i + j] = static_cast<uint16_t>(bits >> 16);
  }
}

// A block's keys and values as float32: the pool itself for a float32 pool, else widened into the buffers.
template <typename Cache>
inline std::pair<const float*, const float*> as_float(const Cache* k_cache, const Cache* v_cache, int64_t offset,
                                                      int64_t count, float* keys, float* values) {
  if constexpr (std::is_same_v<Cache, float>) {
    return {k_cache + offset, v_cache + offset};
  } else {
    widen(k_cache + offset, keys, count);
    widen(v_cache + offset, values, count);
    return {keys, values};
  }
}

template <typename Cache>
struct Pool {
  const Cache* k_cache;
  const Cache* v_cache;
  int64_t block, heads, dim, token_stride, block_stride;
};

// Per-thread buffers: a block widened (bfloat16 pools), scores, and the query rows' copies.
struct Scratch {
  std::vector<float> keys, values, scores, rescales, rows, transposed;
  std::vector<uint32_t> pairs;  // a set's queries as bfloat16 pairs, [heads][dim / 2][padded rows] (walk_many)
  std::vector<uint16_t> narrow_keys;  // an FP8 block's keys as bfloat16, for the pair products
  // walk_few_paired: a block's values as bfloat16 pairs of tokens, the weights as bfloat16, the query rows as bfloat16
  std::vector<uint16_t> value_pairs, weight_pairs, query_pairs;
  // walk_many over an FP8 or a bfloat16 pool: a block's weights as bfloat16 pairs of tokens [token pair][padded]
  std::vector<uint32_t> many_weights;
};

inline float dot_plain(const float* a, const float* b, int64_t dim) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

inline void accumulate_plain(const float* weights, const float* values, int64_t count, int64_t stride,
                             float rescale, float* acc, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) acc[d] *= rescale;
  for (int64_t t = 0; t < count; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += weights[t] * values[t * stride + d];
  }
}

// The next block's keys and values, requested while this block computes: blocks lie anywhere in the pool, so
// each is a fresh 12 KB stream (SmolLM2: 16 tokens x 3 KV heads x 64) that the hardware prefetcher would only
// pick up halfway; the loads then stalled the kernel most of its time. Into L2 (prefetcht1), not L1: a block's
// 12-24 KB beside the walk's own tiles overflowed Zen 4's 32 KB L1, and the bfloat16 walks ran 6-8% faster so
// (shared 41.0 -> 37.8 ms, own 16.8 -> 15.5, one thread), FP8's unchanged.
template <typename Cache>
inline void prefetch(const Cache* k_cache, const Cache* v_cache, int64_t offset, int64_t count) {
  const char* k = reinterpret_cast<const char*>(k_cache + offset);
  const char* v = reinterpret_cast<const char*>(v_cache + offset);
  for (int64_t byte = 0; byte < count * static_cast<int64_t>(sizeof(Cache)); byte += 64) {
    __builtin_prefetch(k + byte, 0, 2);
    __builtin_prefetch(v + byte, 0, 2);
  }
}

// The two inner products. With AVX-512 and a head size that is a multiple of 16 (64, 128...): a dot product
// reduced once by a shuffle tree (the compiler's reduction of a plain loop ends in 16 dependent scalar adds,
// most of the kernel's time), and each row's output kept in registers across a block's tokens.
#if defined(__AVX512F__)
constexpr bool kWide = true;

// Up to four rows' dot products with one key, reduced together (three horizontal adds for all four instead
// of a shuffle tree each): scores[r * stride] = scale * q_r . key for r < n. A missing row repeats the last.
inline void dot_rows(const float* query, int64_t n, const float* key, int64_t dim, float scale, float* scores,
                     int64_t stride) {
  const float* q1 = query + std::min<int64_t>(1, n - 1) * dim;
  const float* q2 = query + std::min<int64_t>(2, n - 1) * dim;
  const float* q3 = query + std::min<int64_t>(3, n - 1) * dim;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 k = _mm512_loadu_ps(key + d);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(query + d), k, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + d), k, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q2 + d), k, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q3 + d), k, a3);
  }
  auto halve = [](__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  };
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(halve(a0), halve(a1)), _mm256_hadd_ps(halve(a2), halve(a3)));
  alignas(16) float sums[4];
  _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
  for (int64_t r = 0; r < n; ++r) scores[r * stride] = scale * sums[r];
}

// scores[0:count] = exp(scores - running); returns their sum (count lanes at a time, masked at the end).
inline float exponentiate(float* scores, int64_t count, float running) {
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(running);
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 lanes = count - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - t)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + t), shift));
    _mm512_mask_storeu_ps(scores + t, lanes, e);
    total = _mm512_mask_add_ps(total, lanes, total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// acc[0:dim] = acc * rescale + sum over t of weights[t] * values[t * stride : t * stride + dim], the row held in
// registers, even and odd tokens in separate sums: one chain of dependent FMAs per 16 lanes was the kernel's
// bound (16 tokens x 4 cycles per block), more than its loads.
template <int Chunks>
inline void accumulate_fixed(const float* weights, int64_t weight_stride, const float* values, int64_t count,
                             int64_t stride, float rescale, float* acc) {
  __m512 even[Chunks], odd[Chunks];
  const __m512 factor = _mm512_set1_ps(rescale);
  for (int c = 0; c < Chunks; ++c) {
    even[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), factor);
    odd[c] = _mm512_setzero_ps();
  }
  int64_t t = 0;
  for (; t + 1 < count; t += 2) {
    const __m512 w0 = _mm512_set1_ps(weights[t * weight_stride]);
    const __m512 w1 = _mm512_set1_ps(weights[(t + 1) * weight_stride]);
    const float* v0 = values + t * stride;
    const float* v1 = v0 + stride;
    for (int c = 0; c < Chunks; ++c) {
      even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
      odd[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * c), odd[c]);
    }
  }
  if (t < count) {
    const __m512 w0 = _mm512_set1_ps(weights[t * weight_stride]);
    for (int c = 0; c < Chunks; ++c)
      even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(values + t * stride + 16 * c), even[c]);
  }
  for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(even[c], odd[c]));
}

inline void accumulate(const float* weights, int64_t weight_stride, const float* values, int64_t count,
                       int64_t stride, float rescale, float* acc, int64_t dim) {
  switch (dim / 16) {
    case 4: return accumulate_fixed<4>(weights, weight_stride, values, count, stride, rescale, acc);
    case 8: return accumulate_fixed<8>(weights, weight_stride, values, count, stride, rescale, acc);
    default:
      for (int64_t d = 0; d < dim; d += 16)
        accumulate_fixed<1>(weights, weight_stride, values + d, count, stride, rescale, acc + d);
  }
}

// Scores of up to 3 tiles of 16 rows against 8 tokens at a time (query transposed [dim][padded rows], scores
// [token][padded rows]): each key element is broadcast once for all the tiles, so one 48-row pass does 24 FMAs
// per 11 loads where one tile did 8 per 9 (the loads were the bound). A tail pass repeats its last token and
// stores only the real ones.
template <int Tiles>
inline void score_tiles(const float* query, int64_t padded, int64_t tile, const float* k, int64_t stride,
                        int64_t count, int64_t dim, float* scores) {
  for (int64_t first = 0; first < count; first += 8) {
    const float* key[8];
    for (int i = 0; i < 8; ++i) key[i] = k + std::min(first + i, count - 1) * stride;
    __m512 sum[Tiles][8];
    for (int j = 0; j < Tiles; ++j)
      for (int i = 0; i < 8; ++i) sum[j][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      __m512 column[Tiles];
      for (int j = 0; j < Tiles; ++j) column[j] = _mm512_loadu_ps(query + d * padded + tile + 16 * j);
      for (int i = 0; i < 8; ++i) {
        const __m512 element = _mm512_set1_ps(key[i][d]);
        for (int j = 0; j < Tiles; ++j) sum[j][i] = _mm512_fmadd_ps(element, column[j], sum[j][i]);
      }
    }
    for (int i = 0; i < 8 && first + i < count; ++i)
      for (int j = 0; j < Tiles; ++j) _mm512_storeu_ps(scores + (first + i) * padded + tile + 16 * j, sum[j][i]);
  }
}

// acc[i] = acc[i] * rescales[i] + sum over t of weights[t * weight_stride + i] * values[t * stride :][0:dim] for
// Rows rows at once: each value vector loaded once for all of them, the rows' sums in registers (a row at a
// time loaded the values again for every row: 5 loads per 4 FMAs).
template <int Rows, int Chunks>
inline void accumulate_rows(const float* weights, int64_t weight_stride, const float* values, int64_t count,
                            int64_t stride, const float* rescales, float* acc, int64_t dim) {
  __m512 sum[Rows][Chunks];
  for (int i = 0; i < Rows; ++i) {
    const __m512 factor = _mm512_set1_ps(rescales[i]);
    for (int c = 0; c < Chunks; ++c) sum[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * dim + 16 * c), factor);
  }
  for (int64_t t = 0; t < count; ++t) {
    __m512 value[Chunks];
    for (int c = 0; c < Chunks; ++c) value[c] = _mm512_loadu_ps(values + t * stride + 16 * c);
    for (int i = 0; i < Rows; ++i) {
      const __m512 weight = _mm512_set1_ps(weights[t * weight_stride + i]);
      for (int c = 0; c < Chunks; ++c) sum[i][c] = _mm512_fmadd_ps(weight, value[c], sum[i][c]);
    }
  }
  for (int i = 0; i < Rows; ++i)
    for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(acc + i * dim + 16 * c, sum[i][c]);
}

// n rows' values (weights [token][padded rows]), four rows at a time where the head is 64 wide, two at 128.
inline void accumulate_many(const float* weights, int64_t padded, const float* values, int64_t count, int64_t stride,
                            const float* rescales, int64_t n, float* acc, int64_t dim) {
  int64_t r = 0;
  if (dim == 64) {
    for (; r + 4 <= n; r += 4)
      accumulate_rows<4, 4>(weights + r, padded, values, count, stride, rescales + r, acc + r * dim, dim);
  } else if (dim == 128) {
    for (; r + 2 <= n; r += 2)
      accumulate_rows<2, 8>(weights + r, padded, values, count, stride, rescales + r, acc + r * dim, dim);
  }
  for (; r < n; ++r) accumulate(weights + r, padded, values, count, stride, rescales[r], acc + r * dim, dim);
}

// Many rows per head (a set's members over its shared prefix) vectorized across rows instead of across the
// head: each head's query transposed to [dim][padded rows], each key element broadcast against 16 rows at
// once, so no dot product needs a horizontal reduction and the softmax state of 16 rows moves in one register.
// State: maxes and sums [heads][padded], acc [heads][n][dim]; scores are kept [token][padded rows].
#if defined(__AVX512BF16__)
// score_tiles with the products taken as bfloat16 pairs (AVX512_BF16's VDPBF16PS, AMD Zen 4 and Intel since
// Cooper Lake): the query [dim / 2][padded rows] of 2 x bfloat16, each key pair broadcast straight from a bfloat16
// pool, so half the instructions of the float32 FMAs and no widened copy of the keys. The pairs' products are exact
// in float32 and summed in float32, so the scores differ from score_tiles' only in the order of the sums (the
// caller passes pairs only for queries bfloat16 holds exactly); they are scaled here, not in the query. 9 sets of 9
// decodes over 448 shared tokens, one thread, 30 layers: 44.8 -> 36.9 ms in cache, 54.5 -> 48.0 from memory
// (benchmarks/walk_builds.py --dtype bfloat16, AMD EPYC Zen 4). The values are taken as pairs too where the
// byte tables are built (accumulate_many_paired), the weights rounded to one bfloat16 each.
template <int Tiles>
inline void score_tiles_paired(const uint32_t* query, int64_t padded, int64_t tile, const uint16_t* k, int64_t stride,
                               int64_t count, int64_t dim, float scale, float* scores) {
  const __m512 scaling = _mm512_set1_ps(scale);
  for (int64_t first = 0; first < count; first += 8) {
    const uint32_t* key[8];
    for (int i = 0; i < 8; ++i) key[i] = reinterpret_cast<const uint32_t*>(k + std::min(first + i, count - 1) * stride);
    __m512 sum[Tiles][8];
    for (int j = 0; j < Tiles; ++j)
      for (int i = 0; i < 8; ++i) sum[j][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim / 2; ++p) {
      __m512bh column[Tiles];
      for (int j = 0; j < Tiles; ++j) column[j] = (__m512bh)_mm512_loadu_si512(query + p * padded + tile + 16 * j);
      for (int i = 0; i < 8; ++i) {
        const __m512bh element = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(key[i][p]));
        for (int j = 0; j < Tiles; ++j) sum[j][i] = _mm512_dpbf16_ps(sum[j][i], column[j], element);
      }
    }
    for (int i = 0; i < 8 && first + i < count; ++i)
      for (int j = 0; j < Tiles; ++j)
        _mm512_storeu_ps(scores + (first + i) * padded + tile + 16 * j, _mm512_mul_ps(sum[j][i], scaling));
  }
}
#endif

// A set's scores against a block's keys, 48, 32 or 16 rows at a time: from float32 queries (`transposed`, scaled)
// or, where `paired` is given, from bfloat16 query pairs over the block's keys as bfloat16 (`pair_keys`: a bfloat16
// pool itself, or an FP8 block narrowed; unscaled, see score_tiles_paired).
template <int Tiles>
inline void score_head(const float* transposed, const uint32_t* paired, int64_t padded, int64_t tile, const float* k,
                       const uint16_t* pair_keys, int64_t stride, int64_t count, int64_t dim, float scale,
                       float* scores) {
#if defined(__AVX512BF16__)
  if (paired) return score_tiles_paired<Tiles>(paired, padded, tile, pair_keys, stride, count, dim, scale, scores);
#endif
  score_tiles<Tiles>(transposed, padded, tile, k, stride, count, dim, scores);
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
// Defined with walk_few_paired below.
template <int Quads, int Rows = 1>
inline void accumulate_paired(const uint32_t* weights, const uint16_t* pairs, int64_t stride, int64_t count,
                              const float* rescales, float* acc, int64_t weight_stride);
template <typename Cache>
inline void pair_values(const Cache* values, int64_t stride, int64_t count, uint16_t* pairs);

// walk_many's values over an FP8 or a bfloat16 pool as walk_few_paired takes them: the block's values as bfloat16
// pairs of tokens (`pairs`, this head's), each row's weights as bfloat16 (16 rows per conversion), so one VDPBF16PS
// takes 32 products where accumulate_many's FMA takes 16 of values widened to float32 (see walk_few_paired on the
// weights' rounding). 9 sets of 9 decodes over 448 shared tokens, one thread, 30 layers, CPU time, AMD EPYC Zen 4
// (benchmarks/cpu/fp8_kv.py --walks --baseline REV): e4m3 47.3 -> 41.7 ms with each weight as two bfloat16, 35.5 ->
// 30.1 with one; a bfloat16 pool, its values widened to float32 before, 52.5 -> 39.0 paired.
template <int Quads>
inline void accumulate_many_paired(const uint32_t* weights, int64_t padded, const uint16_t* pairs, int64_t count,
                                   int64_t stride, const float* rescales, int64_t n, float* acc) {
  int64_t r = 0;
  for (; r + 2 <= n; r += 2)
    accumulate_paired<Quads, 2>(weights + r, pairs, stride, count, rescales + r, acc + r * 64 * Quads, padded);
  for (; r < n; ++r)
    accumulate_paired<Quads>(weights + r, pairs, stride, count, rescales + r, acc + r * 64 * Quads, padded);
}

// walk_many's softmax for accumulate_many_paired, 16 rows (`scores` at their tile): exp(score - running) for each token,
// written straight as bfloat16 pairs of tokens (`weights` [token pair][padded] at the tile) rather than stored as
// float32 and read again to be rounded; returns the float32 weights' sums. Two tokens' weights take one two-source
// conversion (VCVTNE2PS2BF16) and one word interleave.
inline __m512 exponentiate_pairs(const float* scores, int64_t padded, int64_t count, __m512 running,
                                 uint32_t* weights) {
  // word 2i from the first source's lane i, word 2i + 1 from the second's: the tokens of a pair adjacent
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(order);
  __m512 added = _mm512_setzero_ps();
  for (int64_t p = 0; p < (count + 1) / 2; ++p) {
    const __m512 first = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + 2 * p * padded), running));
    const __m512 second = 2 * p + 1 < count
                              ? exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + (2 * p + 1) * padded), running))
                              : _mm512_setzero_ps();
    added = _mm512_add_ps(_mm512_add_ps(added, first), second);
    _mm512_storeu_si512(weights + p * padded,
                        _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(second, first)));
  }
  return added;
}
#endif

template <typename Cache>
void walk_many(const float* transposed, int64_t n, int64_t padded, const Pool<Cache>& pool, const int64_t* blocks,
               int64_t length, Scratch& s, float* maxes, float* sums, float* acc, const uint32_t* paired = nullptr,
               float scale = 1.0f) {
  const int64_t block = pool.block, stride = pool.token_stride, dim = pool.dim;
  float* scores = s.scores.data();
  float* rescales = s.rescales.data();
  for (int64_t b = 0; b * block < length; ++b) {
    const int64_t count = std::min(block, length - b * block);
    const int64_t ahead = (b + 1) * block < length ? std::min(block, length - (b + 1) * block) * stride : 0;
    const Cache* raw_keys = pool.k_cache + blocks[b] * pool.block_stride;
    const float* k = nullptr;
    const float* v = nullptr;
    const uint16_t* pair_keys = nullptr;
    bool values_paired = false;  // the block's values as bfloat16 pairs (accumulate_many_paired)
    if (paired) {  // the keys stay bfloat16 (an FP8 pool's are narrowed to it); the values paired or widened
      if constexpr (kFp8<Cache>) {
        narrow_to_bfloat16(raw_keys, s.narrow_keys.data(), s.keys.data(), count * stride);
        pair_keys = s.narrow_keys.data();
      } else if constexpr (std::is_same_v<Cache, uint16_t>) {
        pair_keys = raw_keys;
      }
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
      if constexpr (kPairable<Cache>) {
        values_paired = pairs_head(dim);
        if (values_paired)
          pair_values(pool.v_cache + blocks[b] * pool.block_stride, stride, count, s.value_pairs.data());
      }
#endif
      if (!values_paired) {
        widen(pool.v_cache + blocks[b] * pool.block_stride, s.values.data(), count * stride);
        v = s.values.data();
      }
    } else {
      std::tie(k, v) = as_float(pool.k_cache, pool.v_cache, blocks[b] * pool.block_stride, count * stride,
                                s.keys.data(), s.values.data());
    }
    for (int64_t h = 0; h < pool.heads; ++h) {
      // the next block requested a head's share at a time, as walk_few_paired does: all of it at once stalled on the
      // outstanding misses (9 sets of 9 decodes over 448 shared tokens, one thread, 30 layers: e4m3 33.1 -> 30.5 ms,
      // bfloat16 43.6 -> 41.1)
      if (ahead > 0)
        prefetch(pool.k_cache, pool.v_cache, blocks[b + 1] * pool.block_stride + h * ahead / pool.heads,
                 ahead / pool.heads);
      const float* query = transposed + h * dim * padded;
      const uint32_t* pairs = paired ? paired + h * (dim / 2) * padded : nullptr;
      const float* key = k ? k + h * dim : nullptr;
      float* head_max = maxes + h * padded;
      float* head_sum = sums + h * padded;
      for (int64_t tile = 0; tile < padded;) {
        const int64_t left = (padded - tile) / 16;
        if (left >= 3) {
          score_head<3>(query, pairs, padded, tile, key, pair_keys ? pair_keys + h * dim : nullptr, stride, count,
                        dim, scale, scores);
          tile += 48;
        } else if (left == 2) {
          score_head<2>(query, pairs, padded, tile, key, pair_keys ? pair_keys + h * dim : nullptr, stride, count,
                        dim, scale, scores);
          tile += 32;
        } else {
          score_head<1>(query, pairs, padded, tile, key, pair_keys ? pair_keys + h * dim : nullptr, stride, count,
                        dim, scale, scores);
          tile += 16;
        }
      }
      for (int64_t tile = 0; tile < padded; tile += 16) {
        const __m512 previous = _mm512_loadu_ps(head_max + tile);
        __m512 running = previous;
        for (int64_t t = 0; t < count; ++t) running = _mm512_max_ps(running, _mm512_loadu_ps(scores + t * padded + tile));
        __m512 added = _mm512_setzero_ps();
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
        if (values_paired)
          added = exponentiate_pairs(scores + tile, padded, count, running, s.many_weights.data() + tile);
        else
#endif
          for (int64_t t = 0; t < count; ++t) {
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + t * padded + tile), running));
            _mm512_storeu_ps(scores + t * padded + tile, e);
            added = _mm512_add_ps(added, e);
          }
        const __m512 rescale = exp_nonpositive(_mm512_sub_ps(previous, running));
        _mm512_storeu_ps(rescales + tile, rescale);
        _mm512_storeu_ps(head_max + tile, running);
        _mm512_storeu_ps(head_sum + tile, _mm512_fmadd_ps(_mm512_loadu_ps(head_sum + tile), rescale, added));
      }
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
      if (values_paired) {
        const uint16_t* pairs = s.value_pairs.data() + 2 * h * dim;
        float* head_acc = acc + h * n * dim;
        const uint32_t* weights = s.many_weights.data();
        if (dim == 64)
          accumulate_many_paired<1>(weights, padded, pairs, count, stride, rescales, n, head_acc);
        else if (dim == 128)
          accumulate_many_paired<2>(weights, padded, pairs, count, stride, rescales, n, head_acc);
        else
          accumulate_many_paired<4>(weights, padded, pairs, count, stride, rescales, n, head_acc);
        continue;
      }
#endif
      accumulate_many(scores, padded, v + h * dim, count, stride, rescales, n, acc + h * n * dim, dim);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same walks in AVX2's 8-lane registers (AMD Zen 2 and 3, Intel before AVX-512), where the plain loops left
// each dot product's 8 lanes to a scalar reduction and walk_many's row-vectorized shared walk did not exist. AVX2
// has 16 vector registers, not 32, so every product is blocked smaller: 2 sums per row in a dot product, 2 rows of
// 32 dimensions or 1 row of 64 in the weights-times-values sums, 16 rows by 4 tokens in the shared walk's scores.
// Against the plain loops, one thread, 30 layers (benchmarks/walk_builds.py --switch-off=-mno-avx512f, an AMD EPYC
// with AVX-512 switched off): 9 sets of 9 decodes over 448 shared tokens 176 -> 53 ms in cache, 179 -> 70 from
// memory; 81 lone decodes of 128 tokens 50 -> 23 and 61 -> 52.
constexpr bool kWide = true;

inline float sum_lanes(__m256 x) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// Up to four rows' dot products with one key (dim a multiple of 16), each row's even and odd 8-lane steps in two
// sums (one chain of dependent FMAs per row was the bound), the four reduced together by two horizontal adds: every
// row by the same tree wherever it sits among the four. A missing row repeats the last.
inline void dot_rows(const float* query, int64_t n, const float* key, int64_t dim, float scale, float* scores,
                     int64_t stride) {
  const float* q[4] = {query, query + std::min<int64_t>(1, n - 1) * dim, query + std::min<int64_t>(2, n - 1) * dim,
                       query + std::min<int64_t>(3, n - 1) * dim};
  __m256 even[4], odd[4];
  for (int r = 0; r < 4; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __m256 k0 = _mm256_loadu_ps(key + d), k1 = _mm256_loadu_ps(key + d + 8);
    for (int r = 0; r < 4; ++r) {
      even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), k0, even[r]);
      odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d + 8), k1, odd[r]);
    }
  }
  for (int r = 0; r < 4; ++r) even[r] = _mm256_add_ps(even[r], odd[r]);
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(even[0], even[1]), _mm256_hadd_ps(even[2], even[3]));
  alignas(16) float sums[4];
  _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
  for (int64_t r = 0; r < n; ++r) scores[r * stride] = scale * sums[r];
}

// scores[0:count] = exp(scores - running); returns their sum (8 lanes at a time, masked at the end).
inline float exponentiate(float* scores, int64_t count, float running) {
  __m256 total = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(running);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t t = 0; t < count; t += 8) {
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count - t)), lane);
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(scores + t, lanes), shift));
    _mm256_maskstore_ps(scores + t, lanes, e);
    total = _mm256_add_ps(total, _mm256_and_ps(e, _mm256_castsi256_ps(lanes)));
  }
  return sum_lanes(total);
}

// acc[0:8 Chunks] = acc * rescale + sum over t of weights[t * weight_stride] * values[t * stride :], the row in
// registers, two tokens a step: 8 chunks are 8 independent FMA chains, enough for both FMA units.
template <int Chunks>
inline void accumulate_fixed(const float* weights, int64_t weight_stride, const float* values, int64_t count,
                             int64_t stride, float rescale, float* acc) {
  __m256 sum[Chunks];
  const __m256 factor = _mm256_set1_ps(rescale);
  for (int c = 0; c < Chunks; ++c) sum[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), factor);
  for (int64_t t = 0; t < count; ++t) {
    const __m256 w = _mm256_set1_ps(weights[t * weight_stride]);
    const float* v = values + t * stride;
    for (int c = 0; c < Chunks; ++c) sum[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), sum[c]);
  }
  for (int c = 0; c < Chunks; ++c) _mm256_storeu_ps(acc + 8 * c, sum[c]);
}

inline void accumulate(const float* weights, int64_t weight_stride, const float* values, int64_t count,
                       int64_t stride, float rescale, float* acc, int64_t dim) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64)
    accumulate_fixed<8>(weights, weight_stride, values + d, count, stride, rescale, acc + d);
  for (; d < dim; d += 8) accumulate_fixed<1>(weights, weight_stride, values + d, count, stride, rescale, acc + d);
}

// Scores of 16 rows (two 8-row tiles) against 4 tokens at a time (query transposed [dim][padded rows], scores
// [token][padded rows]): each key element broadcast once for both tiles, 8 FMAs per 6 loads in 11 registers. A tail
// pass repeats its last token and stores only the real ones.
inline void score_tile_pair(const float* query, int64_t padded, int64_t tile, const float* k, int64_t stride,
                            int64_t count, int64_t dim, float* scores) {
  for (int64_t first = 0; first < count; first += 4) {
    const float* key[4];
    for (int i = 0; i < 4; ++i) key[i] = k + std::min(first + i, count - 1) * stride;
    __m256 sum[2][4];
    for (int j = 0; j < 2; ++j)
      for (int i = 0; i < 4; ++i) sum[j][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 low = _mm256_loadu_ps(query + d * padded + tile);
      const __m256 high = _mm256_loadu_ps(query + d * padded + tile + 8);
      for (int i = 0; i < 4; ++i) {
        const __m256 element = _mm256_broadcast_ss(key[i] + d);
        sum[0][i] = _mm256_fmadd_ps(element, low, sum[0][i]);
        sum[1][i] = _mm256_fmadd_ps(element, high, sum[1][i]);
      }
    }
    for (int i = 0; i < 4 && first + i < count; ++i)
      for (int j = 0; j < 2; ++j) _mm256_storeu_ps(scores + (first + i) * padded + tile + 8 * j, sum[j][i]);
  }
}

// Two rows' weights-times-values sums over 32 dimensions (weights [token][padded rows]): each value vector loaded
// once for both rows, 8 sums and 4 values in registers.
inline void accumulate_two_rows(const float* weights, int64_t weight_stride, const float* values, int64_t count,
                                int64_t stride, const float* rescales, float* acc, int64_t dim) {
  __m256 sum[2][4];
  for (int i = 0; i < 2; ++i) {
    const __m256 factor = _mm256_set1_ps(rescales[i]);
    for (int c = 0; c < 4; ++c) sum[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * dim + 8 * c), factor);
  }
  for (int64_t t = 0; t < count; ++t) {
    __m256 value[4];
    for (int c = 0; c < 4; ++c) value[c] = _mm256_loadu_ps(values + t * stride + 8 * c);
    for (int i = 0; i < 2; ++i) {
      const __m256 weight = _mm256_broadcast_ss(weights + t * weight_stride + i);
      for (int c = 0; c < 4; ++c) sum[i][c] = _mm256_fmadd_ps(weight, value[c], sum[i][c]);
    }
  }
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + i * dim + 8 * c, sum[i][c]);
}

inline void accumulate_many(const float* weights, int64_t padded, const float* values, int64_t count, int64_t stride,
                            const float* rescales, int64_t n, float* acc, int64_t dim) {
  int64_t r = 0;
  if (dim % 32 == 0) {
    for (; r + 2 <= n; r += 2)
      for (int64_t d = 0; d < dim; d += 32)
        accumulate_two_rows(weights + r, padded, values + d, count, stride, rescales + r, acc + r * dim + d, dim);
  }
  for (; r < n; ++r) accumulate(weights + r, padded, values, count, stride, rescales[r], acc + r * dim, dim);
}

// walk_many (see the AVX-512 one above) with 8-row lanes.
template <typename Cache>
void walk_many(const float* transposed, int64_t n, int64_t padded, const Pool<Cache>& pool, const int64_t* blocks,
               int64_t length, Scratch& s, float* maxes, float* sums, float* acc) {
  const int64_t block = pool.block, stride = pool.token_stride, dim = pool.dim;
  float* scores = s.scores.data();
  float* rescales = s.rescales.data();
  for (int64_t b = 0; b * block < length; ++b) {
    const int64_t count = std::min(block, length - b * block);
    if ((b + 1) * block < length)
      prefetch(pool.k_cache, pool.v_cache, blocks[b + 1] * pool.block_stride,
               std::min(block, length - (b + 1) * block) * stride);
    const auto [k, v] = as_float(pool.k_cache, pool.v_cache, blocks[b] * pool.block_stride, count * stride,
                                 s.keys.data(), s.values.data());
    for (int64_t h = 0; h < pool.heads; ++h) {
      const float* query = transposed + h * dim * padded;
      float* head_max = maxes + h * padded;
      float* head_sum = sums + h * padded;
      for (int64_t tile = 0; tile < padded; tile += 16)
        score_tile_pair(query, padded, tile, k + h * dim, stride, count, dim, scores);
      for (int64_t tile = 0; tile < padded; tile += 8) {
        const __m256 previous = _mm256_loadu_ps(head_max + tile);
        __m256 running = previous;
        for (int64_t t = 0; t < count; ++t)
          running = _mm256_max_ps(running, _mm256_loadu_ps(scores + t * padded + tile));
        __m256 added = _mm256_setzero_ps();
        for (int64_t t = 0; t < count; ++t) {
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t * padded + tile), running));
          _mm256_storeu_ps(scores + t * padded + tile, e);
          added = _mm256_add_ps(added, e);
        }
        const __m256 rescale = exp_nonpositive(_mm256_sub_ps(previous, running));
        _mm256_storeu_ps(rescales + tile, rescale);
        _mm256_storeu_ps(head_max + tile, running);
        _mm256_storeu_ps(head_sum + tile, _mm256_fmadd_ps(_mm256_loadu_ps(head_sum + tile), rescale, added));
      }
      accumulate_many(scores, padded, v + h * dim, count, stride, rescales, n, acc + h * n * dim, dim);
    }
  }
}
#else
constexpr bool kWide = false;
// Declared only, for the templates' `if constexpr (Wide)` branches, which are never instantiated here.
void dot_rows(const float* query, int64_t n, const float* key, int64_t dim, float scale, float* scores,
              int64_t stride);
float exponentiate(float* scores, int64_t count, float running);
void accumulate(const float* weights, int64_t weight_stride, const float* values, int64_t count, int64_t stride,
                float rescale, float* acc, int64_t dim);
#endif

// n rows per head (each `dim` floats, already scaled: query [heads][n][dim]) over `length` tokens of their
// blocks, continuing their online softmax (maxes and sums [heads][n], acc [heads][n][dim]). Scores token by
// token, so each block is read front to back while the next block's same token is requested; then each row's
// softmax update; then values token by token. The walk's first `skip` tokens are not seen (a sliding window's
// start inside its first block): that block's update covers the tokens after them.
template <bool Wide, typename Cache>
void walk_few(const float* query, int64_t n, const Pool<Cache>& pool, const int64_t* blocks, int64_t length,
              Scratch& s, float* maxes, float* sums, float* acc, int64_t skip = 0) {
  const int64_t block = pool.block, stride = pool.token_stride, dim = pool.dim, heads = pool.heads;
  float* scores = s.scores.data();
  for (int64_t b = 0; b * block < length; ++b) {
    const int64_t first = std::max(b * block, skip);
    const int64_t count = std::min((b + 1) * block, length) - first;
    if (count <= 0) continue;
    const int64_t next = (b + 1) * block < length ? blocks[b + 1] * pool.block_stride : -1;
    const auto [k, v] = as_float(pool.k_cache, pool.v_cache,
                                 blocks[b] * pool.block_stride + (first - b * block) * stride, count * stride,
                                 s.keys.data(), s.values.data());
    for (int64_t t = 0; t < count; ++t) {
      if (next >= 0) prefetch(pool.k_cache, pool.v_cache, next + t * stride, stride);
      for (int64_t h = 0; h < heads; ++h) {
        const float* key = k + t * stride + h * dim;
        for (int64_t r = 0; r < n; r += 4) {
          const float* rows = query + (h * n + r) * dim;
          float* score = scores + (h * n + r) * block + t;
          if constexpr (Wide) {
            dot_rows(rows, std::min<int64_t>(4, n - r), key, dim, 1.0f, score, block);
          } else {
            for (int64_t i = 0; i < std::min<int64_t>(4, n - r); ++i) score[i * block] = dot_plain(rows + i * dim, key, dim);
          }
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t state = h * n + r;
        float* score = scores + state * block;
        float running = maxes[state];
        for (int64_t t = 0; t < count; ++t) running = std::max(running, score[t]);
        const float rescale = exp_nonpositive(maxes[state] - running);
        maxes[state] = running;
        float added = 0.0f;
        if constexpr (Wide) {
          added = exponentiate(score, count, running);
          accumulate(score, 1, v + h * dim, count, stride, rescale, acc + state * dim, dim);
        } else {
          for (int64_t t = 0; t < count; ++t) {
            score[t] = exp_nonpositive(score[t] - running);
            added += score[t];
          }
          accumulate_plain(score, v + h * dim, count, stride, rescale, acc + state * dim, dim);
        }
        sums[state] = sums[state] * rescale + added;
      }
    }
  }
}

constexpr int64_t kFewRows = 4;  // walk_few_paired's rows side by side

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
// walk_few over an FP8 or a bfloat16 pool for bfloat16 queries, as bfloat16 pair products (VDPBF16PS): an FP8
// block's keys converted by the byte tables to bfloat16 (a block at a time, into an L1 buffer the rows share; a
// bfloat16 pool's read where they lie), its values to pairs of adjacent tokens' bfloat16 values, so one instruction
// takes 32 products where walk_few spends an FMA on 16 and first widens every element to float32 (by F16C for FP8,
// by a shift for bfloat16). Products of two bfloat16 are exact in float32 and summed in float32,
// as score_tiles_paired's. Scores: each row against 16 tokens in 16 registers, reduced together by a transposing tree
// (45 instructions for 16 dot products, where dot_rows spends about 20 on 4); values: each softmax weight rounded to
// one bfloat16, as the AMX tile walks and GPU flash attention take it, its sum kept in float32. A weight then moves by
// at most 2^-8 of itself, so an output by at most 2^-8 of the weighted mean of |value| (tests/test_fp8_kv.py: 0.57-0.91
// of that bound, 1e-2 on outputs up to 15), less than the rounding of the bfloat16 output that follows, and a
// fraction of FP8's own 2^-4 (e4m3) on each value. Each weight as two bfloat16 (16 bits of mantissa) was within 1e-4
// of float32 and cost a second product per value: the shared walks took 1.18x this time (9 sets of 9 decodes over
// 448 shared tokens, e4m3, 30.1 against 35.5 ms; the lone walks below are bound by memory and did not move). Head
// sizes 64, 128 and 256 (Quads = dim / 64); not under batch invariance (walk_few's order is that mode's contract).
// One thread, 30 layers, AMD EPYC Zen 4, CPU time (benchmarks/cpu/fp8_kv.py --walks --baseline REV): 80 lone decodes
// of 512 tokens over e4m3 114.8 -> 79.5 ms, 81 of 128 tokens 32.2 -> 24.4; over a bfloat16 pool (session 48) 110.4
// -> 99.3 and 33.1 -> 23.6, and a step's prefill chunks walked 0.76-0.98x the time (benchmarks/cpu/chunk_routes.py).
// Tried and dropped: two rows at a time sharing each value load (1.07x the time).
constexpr bool kPairedFew = true;

// 16 vectors' lane sums, lane i the sum of p[i]: sixteen become eight by adding 256-bit halves, then four by 128-bit
// lanes, two by pairs of floats, one by floats, each step interleaving two inputs (so the inputs go in transposed).
inline __m512 sum_sixteen(const __m512* p) {
  __m512 in[16], halves[8], quarters[4], pairs[2];
  for (int m = 0; m < 16; ++m) in[m] = p[4 * (m % 4) + m / 4];
  for (int i = 0; i < 8; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2 * i], quarters[2 * i + 1]),
                             _mm512_unpackhi_ps(quarters[2 * i], quarters[2 * i + 1]));
  const __m512d a = _mm512_castps_pd(pairs[0]), b = _mm512_castps_pd(pairs[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

// scale * (query . key t) in lane t for count <= 16 tokens of bfloat16 keys `stride` apart; lanes past count -inf.
template <int Quads>
inline __m512 score_sixteen_paired(const __m512bh* query, const uint16_t* keys, int64_t stride, int64_t count,
                                   float scale) {
  __m512 sums[16];
  for (int t = 0; t < 16; ++t) {  // past count, the last token again
    const uint16_t* key = keys + std::min<int64_t>(t, count - 1) * stride;
    sums[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[0], (__m512bh)_mm512_loadu_si512(key));
    for (int i = 1; i < 2 * Quads; ++i)
      sums[t] = _mm512_dpbf16_ps(sums[t], query[i], (__m512bh)_mm512_loadu_si512(key + 32 * i));
  }
  const __mmask16 lanes = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
  return _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), lanes, sum_sixteen(sums), _mm512_set1_ps(scale));
}

// acc[r][0:dim] = acc[r] * rescales[r] + sum over t of weight r,t * value t, for `Rows` rows side by side (weights 1
// apart, outputs dim apart) so that each value vector is loaded once for all of them; the weights as bfloat16 pairs of
// adjacent tokens (`weights` [count rounded up to even], `weight_stride` apart), the values as pairs
// [token pair][stride][2] (`pairs` at this head). Two rows at a time in walk_many (with exponentiate_pairs, 9 sets
// of 9 decodes over 448 shared tokens, e4m3, one thread, 30 layers: 30.7 -> 29.3 ms, the same bits; each alone took
// about half of that).
template <int Quads, int Rows>
inline void accumulate_paired(const uint32_t* weights, const uint16_t* pairs, int64_t stride, int64_t count,
                              const float* rescales, float* acc, int64_t weight_stride) {
  constexpr int64_t dim = 64 * Quads;
  for (int q = 0; q < Quads; ++q) {
    __m512 sum[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < 4; ++c)
        sum[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + 64 * q + 16 * c), _mm512_set1_ps(rescales[r]));
    for (int64_t p = 0; p < (count + 1) / 2; ++p) {
      __m512bh weight[Rows];
      for (int r = 0; r < Rows; ++r)
        weight[r] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(weights[p * weight_stride + r]));
      const uint16_t* values = pairs + 2 * (p * stride + 64 * q);
      for (int c = 0; c < 4; ++c) {
        const __m512bh value = (__m512bh)_mm512_loadu_si512(values + 32 * c);
        for (int r = 0; r < Rows; ++r) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], value, weight[r]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(acc + r * dim + 64 * q + 16 * c, sum[r][c]);
  }
}

// `count` tokens' values (`stride` elements each, contiguous, FP8 or bfloat16) as pairs of adjacent tokens,
// [count / 2][stride][2] bfloat16; an odd count pairs its last token with itself (its partner's weight is zero).
template <typename Cache>
inline void pair_values(const Cache* values, int64_t stride, int64_t count, uint16_t* pairs) {
  constexpr int64_t step = kFp8<Cache> ? 64 : 32;  // elements in one 512-bit load
  // FP8: the byte tables, looked up once here (a static's guard inside the loop cost the FP8 walks 3-6%)
  const Fp8Tables* tables = nullptr;
  if constexpr (kFp8<Cache>) tables = &fp8_tables<Cache>();
  const CodeOrders& orders = code_orders();
  // bfloat16: word 2i from the first token's word i, word 2i + 1 from the second's, for the low and high 16 of 32
  alignas(64) static const uint16_t low_words[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t high_words[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  for (int64_t p = 0; p < (count + 1) / 2; ++p) {
    const Cache* first = values + 2 * p * stride;
    const Cache* second = first + (2 * p + 1 < count ? stride : 0);
    for (int64_t i = 0; i < stride; i += step) {
      const __m512i a = _mm512_loadu_si512(first + i), b = _mm512_loadu_si512(second + i);
      uint16_t* target = pairs + 2 * (p * stride + i);
      if constexpr (kFp8<Cache>) {
        const auto [w0, w1] = fp8_to_bfloat16(_mm512_permutex2var_epi8(a, orders.pair_low, b), *tables);
        const auto [w2, w3] = fp8_to_bfloat16(_mm512_permutex2var_epi8(a, orders.pair_high, b), *tables);
        _mm512_storeu_si512(target, w0);
        _mm512_storeu_si512(target + 32, w1);
        _mm512_storeu_si512(target + 64, w2);
        _mm512_storeu_si512(target + 96, w3);
      } else {
        _mm512_storeu_si512(target, _mm512_permutex2var_epi16(a, _mm512_load_si512(low_words), b));
        _mm512_storeu_si512(target + 32, _mm512_permutex2var_epi16(a, _mm512_load_si512(high_words), b));
      }
    }
  }
}

// walk_few's walk (same state, from the first token: skips come with batch invariance only) with `query`
// [heads][n][dim] bfloat16, unscaled; `scale` is applied to the scores.
template <int Quads, typename Cache>
void walk_few_paired(const uint16_t* query, int64_t n, const Pool<Cache>& pool, const int64_t* blocks,
                     int64_t length, float scale, Scratch& s, float* maxes, float* sums, float* acc) {
  constexpr int64_t dim = 64 * Quads;
  const int64_t block = pool.block, stride = pool.token_stride, heads = pool.heads;
  uint16_t* pairs = s.value_pairs.data();
  uint16_t* weights = s.weight_pairs.data();  // [kFewRows][16]
  for (int64_t b = 0; b * block < length; ++b) {
    const int64_t count = std::min(block, length - b * block);
    const int64_t offset = blocks[b] * pool.block_stride;
    const uint16_t* keys = nullptr;  // the block's keys as bfloat16: a bfloat16 pool's own, an FP8 one's narrowed
    if constexpr (kFp8<Cache>) {
      narrow_to_bfloat16(pool.k_cache + offset, s.narrow_keys.data(), s.keys.data(), count * stride);
      keys = s.narrow_keys.data();
    } else {
      keys = pool.k_cache + offset;
    }
    pair_values(pool.v_cache + offset, stride, count, pairs);
    // the next block requested a head's share at a time: all of it at once stalled on the outstanding misses
    const int64_t ahead = (b + 1) * block < length ? std::min(block, length - (b + 1) * block) * stride : 0;
    for (int64_t h = 0; h < heads; ++h) {
      if (ahead > 0)
        prefetch(pool.k_cache, pool.v_cache, blocks[b + 1] * pool.block_stride + h * ahead / heads, ahead / heads);
      // up to kFewRows rows at a time, each step for all of them before the next: one row's scores, softmax and
      // values are a chain of dependent steps (reductions, a scalar exp), and side by side the rows' chains overlap
      // (81 decodes' own 48 tokens after their sets' shared walks, e4m3, one thread, 30 layers: 10.6 -> 9.7 ms)
      for (int64_t first = 0; first < n; first += kFewRows) {
        const int64_t rows = std::min(kFewRows, n - first);
        // 16 tokens at a time, their scores and weights in registers: stored and loaded again (masked stores, which
        // do not forward to loads) they stalled the walk
        for (int64_t t = 0; t < count; t += 16) {
          const int64_t tokens = std::min<int64_t>(16, count - t);
          const __mmask16 lanes = tokens >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << tokens) - 1);
          __m512 score[kFewRows];
          float rescale[kFewRows];
          for (int64_t r = 0; r < rows; ++r) {
            __m512bh row[2 * Quads];
            for (int i = 0; i < 2 * Quads; ++i)
              row[i] = (__m512bh)_mm512_loadu_si512(query + (h * n + first + r) * dim + 32 * i);
            score[r] = score_sixteen_paired<Quads>(row, keys + t * stride + h * dim, stride, tokens, scale);
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t state = h * n + first + r;
            const float running = std::max(maxes[state], _mm512_reduce_max_ps(score[r]));
            rescale[r] = exp_nonpositive(maxes[state] - running);
            maxes[state] = running;
            // exp(-inf - running) is exp_nonpositive's floor, 2^-126, not 0: the lanes past count are cleared
            const __m512 weight =
                _mm512_maskz_mov_ps(lanes, exp_nonpositive(_mm512_sub_ps(score[r], _mm512_set1_ps(running))));
            sums[state] = sums[state] * rescale[r] + _mm512_reduce_add_ps(weight);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + 16 * r), (__m256i)_mm512_cvtneps_pbh(weight));
          }
          for (int64_t r = 0; r < rows; ++r)
            accumulate_paired<Quads>(reinterpret_cast<const uint32_t*>(weights + 16 * r),
                                     pairs + t * stride + 2 * h * dim, stride, tokens, rescale + r,
                                     acc + (h * n + first + r) * dim, 1);
        }
      }
    }
  }
}

// `members` rows' query heads ([heads][members x per_kv][dim] from the flat batch's rows) as bfloat16 into `out`;
// false where a value is not a bfloat16 exactly (a float32 model's queries take walk_few).
inline bool bfloat16_rows(const float* query, const int64_t* member_rows, int64_t members, int64_t row_stride,
                          int64_t kv_heads, int64_t per_kv, int64_t dim, uint16_t* out) {
  const int64_t n = members * per_kv;
  uint32_t inexact = 0;
  for (int64_t m = 0; m < members; ++m)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0; i < per_kv * dim; ++i) {
        uint32_t bits;
        std::memcpy(&bits, query + member_rows[m] * row_stride + h * per_kv * dim + i, 4);
        inexact |= bits & 0xFFFFu;
        out[(h * n + m * per_kv) * dim + i] = static_cast<uint16_t>(bits >> 16);
      }
  return inexact == 0;
}

// Whether walk_few_paired walks this pool: FP8 or bfloat16, heads of 64, 128 or 256.
template <typename Cache>
constexpr bool takes_few_paired(int64_t dim) {
  return kPairable<Cache> && pairs_head(dim);
}

// walk_few_paired at this pool's head size; true (walked) where takes_few_paired holds.
template <typename Cache>
bool walk_few_paired(const uint16_t* query, int64_t n, const Pool<Cache>& pool, const int64_t* blocks, int64_t length,
                     float scale, Scratch& s, float* maxes, float* sums, float* acc) {
  if constexpr (kPairable<Cache>) {
    switch (pool.dim) {
      case 64: walk_few_paired<1>(query, n, pool, blocks, length, scale, s, maxes, sums, acc); return true;
      case 128: walk_few_paired<2>(query, n, pool, blocks, length, scale, s, maxes, sums, acc); return true;
      case 256: walk_few_paired<4>(query, n, pool, blocks, length, scale, s, maxes, sums, acc); return true;
    }
  }
  return false;
}
#else
constexpr bool kPairedFew = false;
template <typename Cache>
constexpr bool takes_few_paired(int64_t) {
  return false;
}
// Declared only, for decode_sets' `if constexpr (kPairedFew)` branches, which are never instantiated here.
bool bfloat16_rows(const float* query, const int64_t* member_rows, int64_t members, int64_t row_stride,
                   int64_t kv_heads, int64_t per_kv, int64_t dim, uint16_t* out);
template <typename Cache>
bool walk_few_paired(const uint16_t* query, int64_t n, const Pool<Cache>& pool, const int64_t* blocks, int64_t length,
                     float scale, Scratch& s, float* maxes, float* sums, float* acc);
#endif

// From this many rows a set walks its shared prefix vectorized across rows (walk_many).
constexpr int64_t kManyRows = 16;

// Tokens per chunk of a tile walk (below): one softmax update, and one store of the weights-times-values sums, per
// chunk and row tile. At 32 tokens (one tile's depth) those stores and updates cost more than the tile products.
constexpr int64_t kChunk = 128;

// A step's sets and decodes as the planner laid them out (see the layouts at the top).
struct Plan {
  const int64_t* sets;
  const int64_t* shared_blocks;
  const int64_t* rows;
  const int64_t* own_blocks;
  const int64_t* own_lens;
  int64_t num_sets, shared_width, own_width, per_kv;
  // Batch invariance: every row, in a set or alone, takes walk_few, whose arithmetic per row and block does not
  // depend on the other rows (dot_rows reduces each row by the same tree wherever it sits among its four), so a
  // row's result is the same whatever set it was planned in. walk_many's 16-row lanes sum in another order.
  // The tile walks are invariant as they are, given chunks at fixed positions (see decode_sets_tiles).
  bool fixed_order = false;
  // With the tile walks: [members] the tokens of its set's shared walk each member sees (a prefill row sees the
  // keys up to its own position; the walk goes on to the set's last row), or null: all of them.
  const int64_t* lane_lengths = nullptr;
  // [decodes] tokens at the start of each own walk its rows do not see (sliding windows), or null: none.
  const int64_t* own_skips = nullptr;
};

// A plan's decodes, and its largest set's rows rounded up to whole 16-row tiles.
inline std::pair<int64_t, int64_t> plan_sizes(const Plan& plan) {
  int64_t decodes = 0, most = plan.per_kv;
  for (int64_t set = 0; set < plan.num_sets; ++set) {
    decodes += plan.sets[3 * set + 1];
    most = std::max(most, plan.sets[3 * set + 1] * plan.per_kv);
  }
  return {decodes, (most + 15) / 16 * 16};
}

// A set's query rows (members x heads, unscaled) as bfloat16 pairs of adjacent dimensions, [kv heads][dim / 2]
// [width rows], the padding rows zero, for score_tiles_paired; false, leaving them unfinished, where a value is
// not a bfloat16 exactly (a float32 model over a bfloat16 pool keeps the float32 walk, which does not round its
// queries). A bfloat16 model's queries, widened for this kernel, always are.
inline bool pair_queries(const float* query, const int64_t* member_rows, int64_t members, int64_t row_stride,
                         int64_t kv_heads, int64_t per_kv, int64_t dim, int64_t width, uint32_t* pairs) {
  const int64_t n = members * per_kv;
  for (int64_t h = 0; h < kv_heads; ++h) {
    uint32_t* head = pairs + h * (dim / 2) * width;
    for (int64_t r = 0; r < n; ++r) {
      const float* row = query + member_rows[r / per_kv] * row_stride + (h * per_kv + r % per_kv) * dim;
      uint32_t inexact = 0;
      for (int64_t p = 0; p < dim / 2; ++p) {
        uint32_t even, odd;
        std::memcpy(&even, row + 2 * p, 4);
        std::memcpy(&odd, row + 2 * p + 1, 4);
        inexact |= (even | odd) & 0xFFFFu;
        head[p * width + r] = (even >> 16) | (odd & 0xFFFF0000u);
      }
      if (inexact) return false;
    }
    for (int64_t p = 0; p < dim / 2; ++p) std::fill(head + p * width + n, head + (p + 1) * width, 0u);
  }
  return true;
}

template <bool Wide, typename Cache>
void decode_sets(const float* query, const Pool<Cache>& pool, const Plan& plan, float scale, float* out,
                 int threads) {
  const int64_t* sets = plan.sets;
  const int64_t* rows = plan.rows;
  const int64_t num_sets = plan.num_sets, per_kv = plan.per_kv;
  const int64_t block = pool.block, kv_heads = pool.heads, dim = pool.dim;
  const int64_t q_heads = kv_heads * per_kv, row_stride = q_heads * dim;
  const auto [decodes, padded] = plan_sizes(plan);
  // Each decode's running max and sum per query head after its set's shared walk (its weighted values wait in
  // its output row), and whether it had one.
  std::vector<float> carried(2 * decodes * q_heads);
  std::vector<char> continues(decodes, 0);
  // whether walk_few's rows may take walk_few_paired (for bfloat16 queries: bfloat16_rows says)
  const bool paired_few = takes_few_paired<Cache>(dim) && !plan.fixed_order;
#pragma omp parallel num_threads(threads)
  {
    Scratch s;
    s.keys.resize(block * pool.token_stride);
    s.values.resize(block * pool.token_stride);
    s.scores.resize(kv_heads * padded * block);
    s.rescales.resize(padded);
    s.rows.resize(kv_heads * padded * dim);
    s.transposed.resize(kv_heads * dim * padded);
    if (kPairs && kPairable<Cache>) s.pairs.resize(kv_heads * (dim / 2) * padded);
    if (kPairs && kFp8<Cache>) s.narrow_keys.resize(block * pool.token_stride);
    if (kPairedFew && kPairable<Cache>) {
      s.many_weights.resize((block + 1) / 2 * padded);
      s.value_pairs.resize((block + 1) / 2 * 2 * pool.token_stride);
      s.weight_pairs.resize(16 * kFewRows);
      s.query_pairs.resize(kv_heads * padded * dim);
    }
    std::vector<float> state(kv_heads * padded * (2 + dim));
#pragma omp for schedule(dynamic, 1)
    for (int64_t set = 0; set < num_sets; ++set) {
      const int64_t first = sets[3 * set], members = sets[3 * set + 1], shared = sets[3 * set + 2];
      if (shared == 0) continue;
      const int64_t n = members * per_kv;
      bool many = false;
      if constexpr (Wide) many = n >= kManyRows && !plan.fixed_order;
      const int64_t width = many ? (n + 15) / 16 * 16 : n;  // rows per head in the state
      float* maxes = state.data();
      float* sums = maxes + kv_heads * width;
      float* acc = sums + kv_heads * width;
      std::fill(maxes, maxes + kv_heads * width, -FLT_MAX);
      std::fill(sums, sums + kv_heads * width, 0.0f);
      std::fill(acc, acc + kv_heads * n * dim, 0.0f);
      const uint32_t* paired = nullptr;  // the rows as bfloat16 pairs, read from `query` itself
      if constexpr (kPairs && kPairable<Cache>) {
        if (many &&
            pair_queries(query, rows + first, members, row_stride, kv_heads, per_kv, dim, width, s.pairs.data()))
          paired = s.pairs.data();
      }
      float* query_rows = s.rows.data();  // [heads][n][dim], scaled
      if (!paired)
        for (int64_t m = 0; m < members; ++m)
          for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t i = 0; i < per_kv * dim; ++i)
              query_rows[(h * n + m * per_kv) * dim + i] =
                  scale * query[rows[first + m] * row_stride + h * per_kv * dim + i];
      if (many) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        float* transposed = s.transposed.data();
        if (!paired) {
          std::fill(transposed, transposed + kv_heads * dim * width, 0.0f);
          for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t r = 0; r < n; ++r)
              for (int64_t d = 0; d < dim; ++d)
                transposed[(h * dim + d) * width + r] = query_rows[(h * n + r) * dim + d];
        }
#if defined(__AVX512F__)
        walk_many(transposed, n, width, pool, plan.shared_blocks + set * plan.shared_width, shared, s, maxes, sums, acc,
                  paired, scale);
#else
        walk_many(transposed, n, width, pool, plan.shared_blocks + set * plan.shared_width, shared, s, maxes, sums,
                  acc);
#endif
#endif
      } else {
        bool walked = false;
        if constexpr (kPairedFew)  // (discarded where the paired walk is not built, so never referenced)
          walked = paired_few &&
                   bfloat16_rows(query, rows + first, members, row_stride, kv_heads, per_kv, dim,
                                 s.query_pairs.data()) &&
                   walk_few_paired(s.query_pairs.data(), n, pool, plan.shared_blocks + set * plan.shared_width, shared,
                                   scale, s, maxes, sums, acc);
        if (!walked)
          walk_few<Wide>(query_rows, n, pool, plan.shared_blocks + set * plan.shared_width, shared, s, maxes, sums,
                         acc);
      }
      for (int64_t m = 0; m < members; ++m) {
        const int64_t decode = first + m;
        continues[decode] = 1;
        for (int64_t h = 0; h < kv_heads; ++h) {
          for (int64_t r = 0; r < per_kv; ++r) {
            const int64_t from = h * width + m * per_kv + r, to = decode * q_heads + h * per_kv + r;
            carried[2 * to] = maxes[from];
            carried[2 * to + 1] = sums[from];
            std::memcpy(out + rows[decode] * row_stride + (h * per_kv + r) * dim,
                        acc + (h * n + m * per_kv + r) * dim, dim * 4);
          }
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t decode = 0; decode < decodes; ++decode) {
      float* target = out + rows[decode] * row_stride;
      float* maxes = state.data();
      float* sums = maxes + q_heads;
      if (continues[decode]) {
        for (int64_t q = 0; q < q_heads; ++q) {
          maxes[q] = carried[2 * (decode * q_heads + q)];
          sums[q] = carried[2 * (decode * q_heads + q) + 1];
        }
      } else {
        std::fill(maxes, maxes + q_heads, -FLT_MAX);
        std::fill(sums, sums + q_heads, 0.0f);
        std::fill(target, target + row_stride, 0.0f);
      }
      const int64_t* own_blocks = plan.own_blocks + decode * plan.own_width;
      const int64_t skip = plan.own_skips ? plan.own_skips[decode] : 0;
      bool walked = false;
      if constexpr (kPairedFew)
        walked = paired_few && skip == 0 &&
                 bfloat16_rows(query, rows + decode, 1, row_stride, kv_heads, per_kv, dim, s.query_pairs.data()) &&
                 walk_few_paired(s.query_pairs.data(), per_kv, pool, own_blocks, plan.own_lens[decode], scale, s,
                                 maxes, sums, target);
      if (!walked) {
        float* query_rows = s.rows.data();  // [heads][per_kv][dim]: the flat batch's own layout
        const float* source = query + rows[decode] * row_stride;
        for (int64_t i = 0; i < row_stride; ++i) query_rows[i] = scale * source[i];
        walk_few<Wide>(query_rows, per_kv, pool, own_blocks, plan.own_lens[decode], s, maxes, sums, target, skip);
      }
      for (int64_t q = 0; q < q_heads; ++q) {
        const float inverse = sums[q] > 0.0f ? 1.0f / sums[q] : 0.0f;  // a row that read no token gets zeros
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) target[q * dim + d] *= inverse;
      }
    }
  }
}

// ---- bfloat16 pools on CPUs with AMX: both walks as tile matmuls -------------------------------------------
//
// A set's rows over its shared prefix, and a decode's query heads over its own blocks, are matrix-matrix work
// (Hydragen's observation): [rows x dim] queries against [tokens x dim] keys, then the softmax weights against
// the values. On a CPU with AMX each product is a bfloat16 tile multiply with float32 sums (TDPBF16PS: 16 x 16
// outputs over 32 products in one instruction), where the walks above spend a broadcast and an FMA on every
// key element for every 16 rows; the softmax stays float32 in the vector registers. Tokens go 32 at a time (one
// tile's depth for the weights-times-values product), as two 16-token slices of the pool's blocks.
//
// Layouts, all tiles 16 rows of 64 bytes:
// - scores are computed transposed, S^T = K Q^T: the keys are the A operand straight from the pool (16 tokens of
//   one head, the token stride as the tile's stride), the queries the B operand, packed once per walk as pairs of
//   adjacent dimensions ([dim / 32][16 dim pairs][16 rows] of 2 x bfloat16). S^T lands as [token][row], so the
//   online softmax runs across 16 rows per vector register, as walk_many's does;
// - the weights, rounded to bfloat16 (as GPU flash attention does), are the A operand of P V: [16 rows][16 token
//   pairs], turned from [token][row] by pairing two tokens' rows and a 16 x 16 transpose of 32-bit pairs;
// - the values are the B operand, [dim / 16][16 token pairs][16 dims] of 2 x bfloat16, built once per chunk and
//   head for every row tile.
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kTiles = true;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the AMX register state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); where it refuses, the bfloat16 pool takes the vector walks.
bool tiles_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.bytes_per_row[i] = 64;
    config.rows[i] = 16;
  }
  // GCC 12 does not count the load as a read of `config` and drops the stores above without this barrier
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// [16][16] 32-bit elements transposed in registers: four rounds of unpacks and lane shuffles.
inline void transpose_16x16(const uint32_t* source, uint32_t* target) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(source + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(target + 16 * i, r[i]);  // r[i] is column i
}

struct TileScratch {
  std::vector<uint32_t> queries;  // [row tiles][dim / 32][16 dim pairs][16 rows] query pairs
  std::vector<uint32_t> values;   // [kChunk / 32][dim / 16][16 token pairs][16 dims] value pairs of a chunk
  std::vector<uint32_t> pairs;    // [16 token pairs][16 rows] weight pairs
  std::vector<uint32_t> weights;  // [kChunk / 32][16 rows][16 token pairs] the same, by row
  std::vector<float> scores;      // [kChunk tokens][16 rows]
  std::vector<float> products;    // [16 rows][dim]
};

// exp(x) for x <= 0 in about half the instructions of exp_nonpositive: 2^(x log2 e) as 2^n (scalef) times a
// degree-5 polynomial of 2^f on [-0.5, 0.5] (relative error about 3e-6). The softmax weights it makes are rounded
// to bfloat16 (2^-9) for the tile product anyway; in the walks over a decode's own blocks, where 3 of a tile's 16
// rows are real, the exponentials were a third of the time.
inline __m512 exp_weights(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(kLog2e));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Rows `row_of(r)` (each `dim` bfloat16 values) packed as the B operand of S^T = K Q^T, tile by tile of 16 rows.
template <typename RowOf>
void pack_queries(RowOf row_of, int64_t n, int64_t dim, uint32_t* packed) {
  const int64_t tiles = (n + 15) / 16, depth = dim / 32;
  std::fill(packed, packed + tiles * depth * 256, 0u);
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* q = row_of(r);
    uint32_t* tile = packed + (r / 16) * depth * 256 + r % 16;
    for (int64_t d = 0; d < dim; d += 2)
      tile[(d / 32) * 256 + ((d % 32) / 2) * 16] = q[d] | static_cast<uint32_t>(q[d + 1]) << 16;
  }
}

// Tile register numbers are immediates: the i-th query tile is register 2 + i, the i-th output tile 2 + i.
inline void load_query_tile(int64_t i, const uint32_t* source) {
  switch (i) {
    case 0: _tile_loadd(2, source, 64); break;
    case 1: _tile_loadd(3, source, 64); break;
    case 2: _tile_loadd(4, source, 64); break;
    default: _tile_loadd(5, source, 64);
  }
}

inline void score_product(int64_t i) {  // tmm0 += tmm1 (keys) x query tile i
  switch (i) {
    case 0: _tile_dpbf16ps(0, 1, 2); break;
    case 1: _tile_dpbf16ps(0, 1, 3); break;
    case 2: _tile_dpbf16ps(0, 1, 4); break;
    default: _tile_dpbf16ps(0, 1, 5);
  }
}

inline void value_product(int64_t i) {  // output tile i += tmm0 (weights) x tmm1 (values)
  switch (i) {
    case 0: _tile_dpbf16ps(2, 0, 1); break;
    case 1: _tile_dpbf16ps(3, 0, 1); break;
    case 2: _tile_dpbf16ps(4, 0, 1); break;
    default: _tile_dpbf16ps(5, 0, 1);
  }
}

inline void zero_and_store_output(int64_t i, float* target, int64_t stride, bool store) {
  switch (i) {
    case 0: if (store) _tile_stored(2, target, stride); else _tile_zero(2); break;
    case 1: if (store) _tile_stored(3, target, stride); else _tile_zero(3); break;
    case 2: if (store) _tile_stored(4, target, stride); else _tile_zero(4); break;
    default: if (store) _tile_stored(5, target, stride); else _tile_zero(5);
  }
}

// 16-bit lane orders, built at compile time rather than at every walk: (a0 b0 a1 b1 ... a15 b15) and
// (a16 b16 ... a31 b31) of two 32-lane vectors, and the two halves of one vector interleaved.
struct LaneOrders {
  uint16_t low[32], high[32], interleave[32];
};

constexpr LaneOrders lane_orders() {
  LaneOrders orders{};
  for (uint16_t i = 0; i < 16; ++i) {
    orders.low[2 * i] = i, orders.low[2 * i + 1] = 32 + i;
    orders.high[2 * i] = 16 + i, orders.high[2 * i + 1] = 48 + i;
    orders.interleave[2 * i] = i, orders.interleave[2 * i + 1] = 16 + i;
  }
  return orders;
}

constexpr LaneOrders kLanes = lane_orders();

// n rows per KV head (packed by pack_queries, [heads][tiles][...]) over `length` tokens of `blocks`, continuing their
// online softmax: maxes and sums [heads][tiles * 16], acc [heads][n][dim] (unnormalized). `limits` [n], or null:
// row r sees only the walk's first limits[r] tokens; no row sees the first `skip` (a sliding window's start). A
// row's bits do not depend on the walk going on past its limit, nor on the other rows of its tiles: past its limit
// its lane takes weight 0 (the sum adds exact zeros, the rescale is exp(0) = 1, the products add 0 x value), and a
// tile product computes each output on its own. Every head of a chunk is walked before the next chunk, whose
// blocks are requested meanwhile: a block holds all heads' rows of its tokens (6 KB at SmolLM2's 3 KV heads), and
// walking one head at a time over every block read each block three times in scattered thirds. Heads up to 128
// wide (four query tiles).
void walk_tiles(const uint32_t* packed, int64_t n, const Pool<uint16_t>& pool, const int64_t* blocks, int64_t length,
                float scale, TileScratch& s, float* maxes, float* sums, float* acc, const int64_t* limits = nullptr,
                int64_t skip = 0) {
  const int64_t dim = pool.dim, depth = dim / 32, tiles = (n + 15) / 16, dim_tiles = dim / 16;
  const int64_t stride = pool.token_stride * 2;  // bytes between a head's tokens
  const __m512i low_index = _mm512_loadu_si512(kLanes.low), high_index = _mm512_loadu_si512(kLanes.high);
  const __m512i pair_index = _mm512_loadu_si512(kLanes.interleave);
  const __m512 scaling = _mm512_set1_ps(scale);
  float* scores = s.scores.data();
  float* products = s.products.data();
  uint32_t* packed_values = s.values.data();
  for (int64_t start = 0; start < length; start += kChunk) {
    const int64_t count = std::min(kChunk, length - start);
    const int64_t slices = (count + 15) / 16, groups = (count + 31) / 32;
    int64_t slice_offsets[kChunk / 16];
    for (int64_t i = 0; i < slices; ++i) {
      const int64_t token = start + 16 * i;
      slice_offsets[i] = blocks[token / pool.block] * pool.block_stride + (token % pool.block) * pool.token_stride;
    }
    // the next chunk's blocks, requested now: blocks lie anywhere in the pool, so each is a fresh stream the
    // hardware prefetcher would pick up late, and the walks over a step's 30 layers read their pools from memory
    for (int64_t token = start + kChunk; token < std::min(length, start + 2 * kChunk); token += pool.block)
      prefetch(pool.k_cache, pool.v_cache, blocks[token / pool.block] * pool.block_stride,
               std::min(pool.block, length - token) * pool.token_stride);
    for (int64_t head = 0; head < pool.heads; ++head) {
      const uint16_t* keys[kChunk / 16];
      const uint16_t* values[kChunk / 16];
      for (int64_t i = 0; i < slices; ++i) {
        keys[i] = pool.k_cache + slice_offsets[i] + head * dim;
        values[i] = pool.v_cache + slice_offsets[i] + head * dim;
      }
      for (int64_t p = 0; p < 16 * groups; ++p) {
        const int64_t first = 2 * p;
        uint32_t* group = packed_values + (p / 16) * dim_tiles * 256 + (p % 16) * 16;
        for (int64_t d = 0; d < dim; d += 32) {
          __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
          if (first < count) a = _mm512_loadu_si512(values[first / 16] + (first % 16) * pool.token_stride + d);
          if (first + 1 < count) b = _mm512_loadu_si512(values[first / 16] + (first % 16 + 1) * pool.token_stride + d);
          _mm512_storeu_si512(group + (d / 16) * 256, _mm512_permutex2var_epi16(a, low_index, b));
          _mm512_storeu_si512(group + (d / 16 + 1) * 256, _mm512_permutex2var_epi16(a, high_index, b));
        }
      }
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const uint32_t* queries = packed + (head * tiles + tile) * depth * 256;
        for (int64_t k = 0; k < depth; ++k) load_query_tile(k, queries + k * 256);
        for (int64_t i = 0; i < slices; ++i) {
          _tile_zero(0);
          for (int64_t k = 0; k < depth; ++k) {
            _tile_loadd(1, keys[i] + 32 * k, stride);
            score_product(k);
          }
          _tile_stored(0, scores + 256 * i, 64);
        }
        float* tile_max = maxes + 16 * (head * tiles + tile);
        float* tile_sum = sums + 16 * (head * tiles + tile);
        alignas(64) int32_t seen[16];  // tokens of this chunk each lane sees, after the first `hidden`
        for (int64_t lane = 0; lane < 16; ++lane) {
          const int64_t r = std::min<int64_t>(16 * tile + lane, n - 1);
          seen[lane] = static_cast<int32_t>(limits ? std::clamp<int64_t>(limits[r] - start, 0, count) : count);
        }
        const __m512i lane_seen = _mm512_load_si512(seen);
        const int64_t hidden = std::clamp<int64_t>(skip - start, 0, count);  // a window's start: no lane sees them
        const __m512 previous = _mm512_loadu_ps(tile_max);
        __m512 highest = _mm512_set1_ps(-FLT_MAX);  // of the raw products; the scale is positive
        for (int64_t t = hidden; t < count; ++t) {
          const __mmask16 sees = _mm512_cmpgt_epi32_mask(lane_seen, _mm512_set1_epi32(static_cast<int32_t>(t)));
          highest = _mm512_mask_max_ps(highest, sees, highest, _mm512_loadu_ps(scores + 16 * t));
        }
        const __m512 running = _mm512_max_ps(previous, _mm512_mul_ps(highest, scaling));
        __m512 added = _mm512_setzero_ps();
        for (int64_t t = 0; t < 32 * groups; ++t) {
          __m512 weight = _mm512_setzero_ps();
          if (t >= hidden && t < count) {
            const __mmask16 sees = _mm512_cmpgt_epi32_mask(lane_seen, _mm512_set1_epi32(static_cast<int32_t>(t)));
            weight = _mm512_maskz_mov_ps(sees, exp_weights(_mm512_fmsub_ps(_mm512_loadu_ps(scores + 16 * t), scaling,
                                                                           running)));
            added = _mm512_add_ps(added, weight);
          }
          _mm512_storeu_ps(scores + 16 * t, weight);
        }
        const __m512 rescale = exp_weights(_mm512_sub_ps(previous, running));
        _mm512_storeu_ps(tile_max, running);
        _mm512_storeu_ps(tile_sum, _mm512_fmadd_ps(_mm512_loadu_ps(tile_sum), rescale, added));
        uint32_t* pairs = s.pairs.data();
        for (int64_t g = 0; g < groups; ++g) {
          for (int64_t p = 0; p < 16; ++p) {
            const float* two_tokens = scores + 16 * (32 * g + 2 * p);
            const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(two_tokens + 16), _mm512_loadu_ps(two_tokens));
            _mm512_storeu_si512(pairs + 16 * p, _mm512_permutexvar_epi16(pair_index, reinterpret_cast<__m512i>(both)));
          }
          transpose_16x16(pairs, s.weights.data() + 256 * g);
        }
        for (int64_t first = 0; first < dim_tiles; first += 4) {  // four output tiles at a time
          const int64_t span = std::min<int64_t>(4, dim_tiles - first);
          for (int64_t j = 0; j < span; ++j) zero_and_store_output(j, nullptr, 0, false);
          for (int64_t g = 0; g < groups; ++g) {
            _tile_loadd(0, s.weights.data() + 256 * g, 64);
            for (int64_t j = 0; j < span; ++j) {
              _tile_loadd(1, packed_values + (g * dim_tiles + first + j) * 256, 64);
              value_product(j);
            }
          }
          for (int64_t j = 0; j < span; ++j) zero_and_store_output(j, products + 16 * (first + j), dim * 4, true);
        }
        alignas(64) float factors[16];
        _mm512_store_ps(factors, rescale);
        const int64_t real = std::min<int64_t>(16, n - 16 * tile);
        for (int64_t r = 0; r < real; ++r) {
          const __m512 factor = _mm512_set1_ps(factors[r]);
          float* row = acc + (head * n + 16 * tile + r) * dim;
          for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(row + d, _mm512_fmadd_ps(_mm512_loadu_ps(row + d), factor,
                                                      _mm512_loadu_ps(products + r * dim + d)));
        }
      }
    }
  }
}

// The first chunk of a walk over `blocks`, requested before the walk ahead of it starts: most own walks are one
// chunk long, so the prefetch inside a walk never covers them.
inline void prefetch_walk(const Pool<uint16_t>& pool, const int64_t* blocks, int64_t length) {
  for (int64_t token = 0; token < std::min(length, kChunk); token += pool.block)
    prefetch(pool.k_cache, pool.v_cache, blocks[token / pool.block] * pool.block_stride,
             std::min(pool.block, length - token) * pool.token_stride);
}

// A decode's own walk shorter than this runs the vector walk: a tile walk's chain of products, stores and loads
// has a fixed latency that a short walk does not repay (81 own walks of one token: 0.26 ms a layer as tiles, 0.10 ms
// as vectors; at 32 tokens level, at 64 tokens the tiles are 1.13x faster, at 128 1.16x).
constexpr int64_t kTileTokens = 40;

// decode_sets for a bfloat16 pool, each walk as tile matmuls (the same two phases and carried state).
//
// With plan.fixed_order (batch invariance) a row's bits depend only on its query and its keys: every walk takes
// tiles (no vector walk for short ones), and the planner starts every walk at a multiple of kChunk tokens (a set's
// shared part is whole chunks, or a prefill set's rows walk from 0 with lane limits), so each row reduces its keys
// in the same chunks, at the same positions, whatever it shares them with.
void decode_sets_tiles(const uint16_t* query, const Pool<uint16_t>& pool, const Plan& plan, float scale,
                       uint16_t* out, int threads) {
  const int64_t* sets = plan.sets;
  const int64_t* rows = plan.rows;
  const int64_t num_sets = plan.num_sets, per_kv = plan.per_kv;
  const int64_t kv_heads = pool.heads, dim = pool.dim;
  const int64_t q_heads = kv_heads * per_kv, row_stride = q_heads * dim;
  const auto [decodes, padded] = plan_sizes(plan);
  std::vector<float> carried(2 * decodes * q_heads);
  std::vector<char> continues(decodes, 0);
  // each decode's float32 sums between the walks ([decodes][q_heads][dim]); the bfloat16 output is written once
  std::vector<float> staged(decodes * row_stride);
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    TileScratch s;
    s.queries.resize(kv_heads * padded * dim / 2);
    s.values.resize(kChunk / 32 * dim * 16);
    s.pairs.resize(256);
    s.weights.resize(kChunk / 32 * 256);
    s.scores.resize(kChunk * 16);
    s.products.resize(16 * dim);
    std::vector<float> maxes(kv_heads * padded), sums(kv_heads * padded), acc(kv_heads * padded * dim);
    std::vector<int64_t> limits(padded);
    Scratch vector;  // the vector walk's buffers, for short own walks
    vector.keys.resize(pool.block * pool.token_stride);
    vector.values.resize(pool.block * pool.token_stride);
    vector.scores.resize(q_heads * pool.block);
    vector.rows.resize(row_stride);
    std::vector<float> few_maxes(q_heads), few_sums(q_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t set = 0; set < num_sets; ++set) {
      const int64_t first = sets[3 * set], members = sets[3 * set + 1], shared = sets[3 * set + 2];
      if (shared == 0) continue;
      const int64_t n = members * per_kv, width = (n + 15) / 16 * 16;  // rows per head, and padded to tiles
      for (int64_t h = 0; h < kv_heads; ++h) {
        const auto row_of = [&](int64_t r) {
          return query + rows[first + r / per_kv] * row_stride + (h * per_kv + r % per_kv) * dim;
        };
        pack_queries(row_of, n, dim, s.queries.data() + h * width * dim / 2);
      }
      std::fill(maxes.begin(), maxes.end(), -FLT_MAX);
      std::fill(sums.begin(), sums.end(), 0.0f);
      std::fill(acc.begin(), acc.begin() + kv_heads * n * dim, 0.0f);
      if (set + threads < num_sets)  // the set this thread is likely to take next
        prefetch_walk(pool, plan.shared_blocks + (set + threads) * plan.shared_width, sets[3 * (set + threads) + 2]);
      if (plan.lane_lengths)
        for (int64_t r = 0; r < n; ++r) limits[r] = plan.lane_lengths[first + r / per_kv];
      walk_tiles(s.queries.data(), n, pool, plan.shared_blocks + set * plan.shared_width, shared, scale, s,
                 maxes.data(), sums.data(), acc.data(), plan.lane_lengths ? limits.data() : nullptr);
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t decode = first + r / per_kv, q = h * per_kv + r % per_kv;
          continues[decode] = 1;
          carried[2 * (decode * q_heads + q)] = maxes[h * width + r];
          carried[2 * (decode * q_heads + q) + 1] = sums[h * width + r];
          std::memcpy(staged.data() + decode * row_stride + q * dim, acc.data() + (h * n + r) * dim, dim * 4);
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t decode = 0; decode < decodes; ++decode) {
      float* target = staged.data() + decode * row_stride;  // [kv heads][per_kv][dim]: the walk's acc layout
      const uint16_t* source = query + rows[decode] * row_stride;
      const int64_t width = (per_kv + 15) / 16 * 16;
      if (!continues[decode]) std::fill(target, target + row_stride, 0.0f);
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t r = 0; r < per_kv; ++r) {
          const int64_t q = h * per_kv + r;
          maxes[h * width + r] = continues[decode] ? carried[2 * (decode * q_heads + q)] : -FLT_MAX;
          sums[h * width + r] = continues[decode] ? carried[2 * (decode * q_heads + q) + 1] : 0.0f;
        }
        pack_queries([&](int64_t r) { return source + (h * per_kv + r) * dim; }, per_kv, dim,
                     s.queries.data() + h * width * dim / 2);
      }
      if (decode + threads < decodes)  // the decode this thread is likely to take next
        prefetch_walk(pool, plan.own_blocks + (decode + threads) * plan.own_width, plan.own_lens[decode + threads]);
      const int64_t length = plan.own_lens[decode];
      const int64_t skip = plan.own_skips ? plan.own_skips[decode] : 0;
      if (length < kTileTokens && !plan.fixed_order) {  // short: the vector walk, float32 on widened keys, values
        for (int64_t h = 0; h < kv_heads; ++h)
          for (int64_t r = 0; r < per_kv; ++r) {
            few_maxes[h * per_kv + r] = maxes[h * width + r];
            few_sums[h * per_kv + r] = sums[h * width + r];
          }
        widen(source, vector.rows.data(), row_stride);
        for (int64_t i = 0; i < row_stride; ++i) vector.rows[i] *= scale;
        walk_few<true>(vector.rows.data(), per_kv, pool, plan.own_blocks + decode * plan.own_width, length, vector,
                       few_maxes.data(), few_sums.data(), target, skip);
        for (int64_t h = 0; h < kv_heads; ++h)
          for (int64_t r = 0; r < per_kv; ++r) sums[h * width + r] = few_sums[h * per_kv + r];
      } else {
        walk_tiles(s.queries.data(), per_kv, pool, plan.own_blocks + decode * plan.own_width, length, scale, s,
                   maxes.data(), sums.data(), target, nullptr, skip);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t r = 0; r < per_kv; ++r) {
          const float total = sums[h * width + r];
          const float inverse = total > 0.0f ? 1.0f / total : 0.0f;  // a row that read no token gets zeros
          const float* row = target + (h * per_kv + r) * dim;
          uint16_t* written = out + rows[decode] * row_stride + (h * per_kv + r) * dim;
          for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(written + d), reinterpret_cast<__m256i>(
                                    _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + d), _mm512_set1_ps(inverse)))));
        }
      }
    }
    _tile_release();
  }
}
#else
constexpr bool kTiles = false;
bool tiles_permitted() { return false; }
void decode_sets_tiles(const uint16_t*, const Pool<uint16_t>&, const Plan&, float, uint16_t*, int) {}
#endif

// Whether a bfloat16 pool of this shape walks as tile matmuls: AMX built in and granted, heads a multiple of 32
// wide up to 128, blocks a multiple of 16 tokens.
bool takes_tiles(int64_t block, int64_t dim) {
  return kTiles && dim % 32 == 0 && dim <= 128 && block % 16 == 0 && tiles_permitted();
}

// The vector walks take a block of more than kSlice tokens as consecutive slices of kSlice, each slice one block of
// a pool viewed with kSlice-token blocks (block id b of a pool of 4 x 16-token blocks is slices 4b to 4b + 3 of the
// same memory). Walked whole, a bigger block's converted keys, paired values and scores outgrew the L1 cache the
// walks keep them in. As slices, blocks of 32, 64 and 128 tokens walk in 0.74-0.90x the time over a bfloat16 pool and
// 0.79-0.94x over e4m3 (benchmarks/cpu/fp8_kv.py --walks --block N --baseline 751f2c4: 9 sets of 9 decodes over 448
// shared tokens, 81 and 80 lone decodes; one thread, 30 layers, AMD EPYC Zen 4), and every block size a multiple of
// 16 walks the arithmetic of blocks of 16, so its bits.
constexpr int64_t kSlice = 16;

// `count` block ids as the ids of their `slices` slices each, in order.
inline std::vector<int64_t> slice_ids(const int64_t* blocks, int64_t count, int64_t slices) {
  std::vector<int64_t> ids(count * slices);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < slices; ++j) ids[i * slices + j] = blocks[i] * slices + j;
  return ids;
}

template <typename Cache>
void run(const float* query, const Cache* k_cache, const Cache* v_cache, const Plan& given, int64_t block,
         int64_t kv_heads, int64_t dim, float scale, float* out, int threads) {
  Plan plan = given;
  std::vector<int64_t> shared_slices, own_slices;
  if (block > kSlice && block % kSlice == 0) {
    const int64_t slices = block / kSlice;
    shared_slices = slice_ids(plan.shared_blocks, plan.num_sets * plan.shared_width, slices);
    own_slices = slice_ids(plan.own_blocks, plan_sizes(plan).first * plan.own_width, slices);
    plan.shared_blocks = shared_slices.data();
    plan.own_blocks = own_slices.data();
    plan.shared_width *= slices;
    plan.own_width *= slices;
    block = kSlice;
  }
  const Pool<Cache> pool{k_cache, v_cache, block, kv_heads, dim, kv_heads * dim, block * kv_heads * dim};
  if (kWide && dim % 16 == 0) {
    decode_sets<kWide>(query, pool, plan, scale, out, threads);
  } else {
    decode_sets<false>(query, pool, plan, scale, out, threads);
  }
}

}  // namespace

// The entry points, one per pool dtype (ctypes passes the plan's arrays one by one).
extern "C" {

void paged_decode_f32(const float* query, const float* k_cache, const float* v_cache, const int64_t* sets,
                      const int64_t* shared_blocks, const int64_t* rows, const int64_t* own_blocks,
                      const int64_t* own_lens, int64_t num_sets, int64_t shared_width, int64_t own_width,
                      int64_t block, int64_t kv_heads, int64_t per_kv, int64_t dim, float scale, float* out,
                      int threads, int fixed_order, const int64_t* own_skips) {
  const Plan plan{sets,         shared_blocks, rows,   own_blocks,       own_lens, num_sets,
                  shared_width, own_width,     per_kv, fixed_order != 0, nullptr,  own_skips};
  run(query, k_cache, v_cache, plan, block, kv_heads, dim, scale, out, threads);
}

void paged_decode_bf16(const float* query, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* sets,
                       const int64_t* shared_blocks, const int64_t* rows, const int64_t* own_blocks,
                       const int64_t* own_lens, int64_t num_sets, int64_t shared_width, int64_t own_width,
                       int64_t block, int64_t kv_heads, int64_t per_kv, int64_t dim, float scale, float* out,
                       int threads, int fixed_order, const int64_t* own_skips) {
  const Plan plan{sets,         shared_blocks, rows,   own_blocks,       own_lens, num_sets,
                  shared_width, own_width,     per_kv, fixed_order != 0, nullptr,  own_skips};
  run(query, k_cache, v_cache, plan, block, kv_heads, dim, scale, out, threads);
}

// FP8 pools (kernels/fp8_kv.py): the vector walks (with bfloat16 queries and AVX512_BF16 + VBMI, the paired ones);
// never the tile walks.
void paged_decode_e4m3(const float* query, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* sets,
                       const int64_t* shared_blocks, const int64_t* rows, const int64_t* own_blocks,
                       const int64_t* own_lens, int64_t num_sets, int64_t shared_width, int64_t own_width,
                       int64_t block, int64_t kv_heads, int64_t per_kv, int64_t dim, float scale, float* out,
                       int threads, int fixed_order, const int64_t* own_skips) {
  const Plan plan{sets,         shared_blocks, rows,   own_blocks,       own_lens, num_sets,
                  shared_width, own_width,     per_kv, fixed_order != 0, nullptr,  own_skips};
  run(query, reinterpret_cast<const E4M3*>(k_cache), reinterpret_cast<const E4M3*>(v_cache), plan, block, kv_heads,
      dim, scale, out, threads);
}

void paged_decode_e5m2(const float* query, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* sets,
                       const int64_t* shared_blocks, const int64_t* rows, const int64_t* own_blocks,
                       const int64_t* own_lens, int64_t num_sets, int64_t shared_width, int64_t own_width,
                       int64_t block, int64_t kv_heads, int64_t per_kv, int64_t dim, float scale, float* out,
                       int threads, int fixed_order, const int64_t* own_skips) {
  const Plan plan{sets,         shared_blocks, rows,   own_blocks,       own_lens, num_sets,
                  shared_width, own_width,     per_kv, fixed_order != 0, nullptr,  own_skips};
  run(query, reinterpret_cast<const E5M2*>(k_cache), reinterpret_cast<const E5M2*>(v_cache), plan, block, kv_heads,
      dim, scale, out, threads);
}

// A bfloat16 model over a bfloat16 pool where takes_tiles holds: queries and outputs in bfloat16 (the flat batch's
// own tensors, no float32 copies), the walks as tile matmuls; `lane_lengths` and `own_skips` may be null (see
// Plan). A float32 model over a bfloat16 pool takes paged_decode_bf16, whose float32 walks do not round its queries.
void paged_decode_bf16_tiles_run(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache,
                                 const int64_t* sets, const int64_t* shared_blocks, const int64_t* rows,
                                 const int64_t* own_blocks, const int64_t* own_lens, int64_t num_sets,
                                 int64_t shared_width, int64_t own_width, int64_t block, int64_t kv_heads,
                                 int64_t per_kv, int64_t dim, float scale, uint16_t* out, int threads,
                                 int fixed_order, const int64_t* lane_lengths, const int64_t* own_skips) {
  const Plan plan{sets,         shared_blocks, rows,   own_blocks,       own_lens,     num_sets,
                  shared_width, own_width,     per_kv, fixed_order != 0, lane_lengths, own_skips};
  const Pool<uint16_t> pool{k_cache, v_cache, block, kv_heads, dim, kv_heads * dim, block * kv_heads * dim};
  decode_sets_tiles(query, pool, plan, scale, out, threads);
}

// Tokens per chunk of the tile walks: a batch-invariant plan starts every tile walk at a multiple of it.
int64_t paged_decode_tile_chunk() { return kChunk; }

// 1 where a bfloat16 pool of this block size and head size runs the tile walks (what the run's summary reports).
int paged_decode_bf16_tiles(int64_t block, int64_t dim) { return takes_tiles(block, dim) ? 1 : 0; }
}
