// The CPU path's per-token ops, each one pass over its rows: RMSNorm with the residual add folded in,
// rotate-half RoPE, and the new keys and values written into the paged pool; for float32 and bfloat16 tensors,
// into a pool of their own dtype or of FP8 (kernels/fp8_kv.py).
//
// Why: in a decode step these run between matmuls that stream the weights through the caches, so their
// tensors are cold, and torch runs RMSNorm as seven ops and RoPE as about ten, each writing a fresh output to
// cold memory. Here each row is read once and written once: at 80 decodes (SmolLM2-135M, float32,
// benchmarks/step_ops.py) RMSNorm, RoPE and the KV store took 4.5, 1.9 and 1.5 ms of a decode step against
// 7.7, 5.7 and 3.1 ms as torch ops (BENCHMARKS.md, session 5). In bfloat16 the torch ops are worse than in
// float32 (each widens its whole tensor to float32 and rounds it back: 6.4 ms RMSNorm and 4.6 ms RoPE a step);
// here a bfloat16 row is widened in registers, computed in float32 as the torch ops do, and rounded once.
//
// RMSNorm splits a call of 16 rows or more across the threads: between a step's matmuls the residual and the
// weight come from memory, not the caches, and one core does not draw the bandwidth two do. With the caches flushed
// before each call (benchmarks/cpu/norm_threads.py, AMD EPYC Zen 4), 2 threads take a bfloat16 norm of 16-160 rows
// in 0.58-0.78x one thread's time (80 rows: 16.1 against 22.0 us); a build splitting from one row measured 4-8 rows
// level. In the decode job (benchmarks/cpu/step_ops.py, 80 rows) the norms went from 3.5-4.5 to 2.2-2.4 ms a step.
// RoPE reads the projection the matmul has just written, from the caches: split the same way it was no faster
// (1.1-1.7 against 1.1-1.4 ms a step), so it stays on the calling thread up to 512 rows (a long prefill chunk).
// Every row is computed by one thread in one order, so the bits do not depend on the split.

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "exp_nonpositive.h"

namespace {
constexpr int64_t kParallelNormRows = 16;
constexpr int64_t kParallelRopeRows = 512;

inline float widen(float x) { return x; }

inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// float32 to FP8 as kernels/fp8_kv.py's to_cache rounds (torch's cast after a clamp): to nearest, ties to even,
// saturated at the format's largest; `Mantissa` 3 is e4m3fn (bias 7, largest 448), 2 is e5m2 (bias 15, largest
// 57344). Normal results round the float's bits (the carry steps the exponent); below the smallest normal the
// step is fixed, 2^(1 - bias - mantissa), so the rounding is rint of the value over it (the default mode, to
// even), whose top count is the smallest normal's encoding.
template <int Mantissa>
inline uint8_t to_fp8(float x) {
  constexpr int kBias = Mantissa == 3 ? 7 : 15;
  constexpr uint32_t kLargest = Mantissa == 3 ? 0x43E00000u : 0x47600000u;  // 448.0f, 57344.0f
  constexpr uint8_t kLargestCode = Mantissa == 3 ? 0x7E : 0x7B;
  constexpr int kDropped = 23 - Mantissa;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return sign | 0x7F;  // NaN: torch's cast gives both formats' NaN code, signed
  if (bits >= kLargest) return sign | kLargestCode;
  if (bits < static_cast<uint32_t>(128 - kBias) << 23) {  // below the smallest normal, 2^(1 - bias)
    float magnitude;
    std::memcpy(&magnitude, &bits, 4);
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(magnitude, kBias - 1 + Mantissa)));
  }
  const uint32_t rounded = bits + ((1u << (kDropped - 1)) - 1) + ((bits >> kDropped) & 1u);
  return sign | static_cast<uint8_t>((rounded >> kDropped) - (static_cast<uint32_t>(127 - kBias) << Mantissa));
}

// float32 to bfloat16 as torch rounds: to nearest, ties to even, a NaN stays a NaN.
inline void narrow(float x, float* target) { *target = x; }

inline void narrow(float x, uint16_t* target) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  *target = static_cast<uint16_t>(std::isnan(x) ? 0x7FC0u : rounded);
}

// sum = x + residual (when residual is given; rows of x and residual may be strided), normed = sum *
// rsqrt(mean(sum^2) + eps) * weight; [rows, cols], outputs contiguous. The sum is rounded to the element type
// before its squares are taken, as the torch ops round x + residual.
template <typename T>
void add_rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t residual_stride, const T* weight,
                  int64_t rows, int64_t cols, float eps, T* normed, T* sum, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= kParallelNormRows)
  for (int64_t r = 0; r < rows; ++r) {
    const T* source = x + r * x_stride;
    T* total = residual != nullptr ? sum + r * cols : nullptr;
    float squares = 0.0f;
    if (total != nullptr) {
      const T* add = residual + r * residual_stride;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) narrow(widen(source[c]) + widen(add[c]), &total[c]);
      source = total;
    }
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < cols; ++c) squares += widen(source[c]) * widen(source[c]);
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(cols) + eps);
    T* target = normed + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) narrow(widen(source[c]) * inverse * widen(weight[c]), &target[c]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// bfloat16 rows 16 at a time in the vector registers: the scalar widen/narrow above do not vectorize (the
// rounding's NaN test and the bit copies stop the compiler), which made the bfloat16 RMSNorm 1.5x the float32 one.
// VCVTNEPS2BF16 rounds to nearest even like torch; a NaN stays a NaN.
inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void store16(uint16_t* p, __mmask16 m, __m512 x) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}
#endif

// One head: the first half becomes x1 * cos - x2 * sin, the second x2 * cos + x1 * sin.
template <typename T>
inline void rotate(const T* first, const float* cos, const float* sin, int64_t half, T* target) {
  const T* second = first + half;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float a = widen(first[d]), b = widen(second[d]);
    narrow(a * cos[d] - b * sin[d], &target[d]);
    narrow(b * cos[d] + a * sin[d], &target[half + d]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// One bfloat16 head, 16 lanes at a time (an overload declared before rope, so rope<uint16_t> takes it).
inline void rotate(const uint16_t* first, const float* cos, const float* sin, int64_t half, uint16_t* target) {
  for (int64_t d = 0; d < half; d += 16) {
    const __mmask16 m = lanes(half - d);
    const __m512 a = load16(first + d, m), b = load16(first + half + d, m);
    const __m512 c = _mm512_maskz_loadu_ps(m, cos + d), s = _mm512_maskz_loadu_ps(m, sin + d);
    store16(target + d, m, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, s)));
    store16(target + half + d, m, _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, s)));
  }
}
#endif

// Rotate-half RoPE of one tensor's heads [tokens, heads, width] (token and head strides given, the last
// dimension contiguous) into a contiguous [tokens, heads, width]: with cos and sin from the float32 table row of
// the token's position ([positions, width]: cos then sin, width / 2 each), the first half becomes
// x1 * cos - x2 * sin and the second x2 * cos + x1 * sin.
template <typename T>
void rope(const T* x, int64_t token_stride, int64_t head_stride, int64_t heads, const int64_t* positions,
          const float* table, int64_t width, int64_t tokens, T* out, int threads) {
  const int64_t half = width / 2;
#pragma omp parallel for num_threads(threads) if (tokens >= kParallelRopeRows)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = table + positions[t] * width;
    const float* sin = cos + half;
    for (int64_t h = 0; h < heads; ++h)
      rotate(x + t * token_stride + h * head_stride, cos, sin, half, out + (t * heads + h) * width);
  }
}
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
template <>
void add_rms_norm<uint16_t>(const uint16_t* x, int64_t x_stride, const uint16_t* residual, int64_t residual_stride,
                            const uint16_t* weight, int64_t rows, int64_t cols, float eps, uint16_t* normed,
                            uint16_t* sum, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= kParallelNormRows)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* source = x + r * x_stride;
    __m512 squares = _mm512_setzero_ps();
    if (residual != nullptr) {
      const uint16_t* add = residual + r * residual_stride;
      uint16_t* total = sum + r * cols;
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = lanes(cols - c);
        // The sum rounded to bfloat16 in the registers, stored, and squared as stored (as torch takes it). Read back
        // from memory instead, each chunk waited for its masked store, which does not forward to a load: an 80-row
        // norm of 576 columns took 34 us that way and takes 14 now (AMD EPYC Zen 4, one thread).
        const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(load16(source + c, m), load16(add + c, m)));
        _mm256_mask_storeu_epi16(total + c, m, reinterpret_cast<__m256i>(rounded));
        const __m512 stored =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(rounded)), 16));
        squares = _mm512_fmadd_ps(stored, stored, squares);
      }
      source = total;
    } else {
      for (int64_t c = 0; c < cols; c += 16) {
        const __m512 value = load16(source + c, lanes(cols - c));
        squares = _mm512_fmadd_ps(value, value, squares);
      }
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / cols + eps));
    uint16_t* target = normed + r * cols;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = lanes(cols - c);
      store16(target + c, m, _mm512_mul_ps(_mm512_mul_ps(load16(source + c, m), inverse), load16(weight + c, m)));
    }
  }
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline void store16(float* p, __mmask16 m, __m512 x) { _mm512_mask_storeu_ps(p, m, x); }

// to_fp8 on 16 lanes, the same steps: the normal rounding on the bits, the subnormal one by VCVTPS2DQ (to nearest
// even, as nearbyint) of the value times 2^(bias - 1 + mantissa), then saturation and NaN chosen by masks.
template <int Mantissa>
inline __m128i to_fp8(__m512 x) {
  constexpr int kBias = Mantissa == 3 ? 7 : 15;
  constexpr int32_t kLargest = Mantissa == 3 ? 0x43E00000 : 0x47600000;
  constexpr int32_t kLargestCode = Mantissa == 3 ? 0x7E : 0x7B;
  constexpr int kDropped = 23 - Mantissa;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, kDropped), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(magnitude, _mm512_set1_epi32((1 << (kDropped - 1)) - 1)), odd);
  __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(rounded, kDropped), _mm512_set1_epi32((127 - kBias) << Mantissa));
  const __m512 steps = _mm512_mul_ps(_mm512_castsi512_ps(magnitude),
                                     _mm512_castsi512_ps(_mm512_set1_epi32((127 + kBias - 1 + Mantissa) << 23)));
  code = _mm512_mask_mov_epi32(code, _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32((128 - kBias) << 23)),
                               _mm512_cvtps_epi32(steps));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epi32_mask(magnitude, _mm512_set1_epi32(kLargest)),
                               _mm512_set1_epi32(kLargestCode));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F800000)),
                               _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}
#endif

// A gated MLP's silu(gate) * up from its fused projection [rows, 2 width] (gate first, rows `stride` elements apart)
// into a contiguous [rows, width], in float32 and rounded once. silu(x) = x sigmoid(x), the sigmoid from e = exp(-|x|),
// which never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below. torch ran it as two ops, each a pass over the
// rows in its own parallel region: an 80-row call at SmolLM2's 1,536 took 51-53 us in bfloat16 and 42-43 in float32,
// this one pass 34-35 and 31-33 (benchmarks/cpu/cpu_ops.py --only elementwise, AMD EPYC Zen 4, 2 threads), about
// 0.5 ms of a bfloat16 decode step's 30 layers. Split across the threads from kParallelNormRows rows, as the norm: the
// exponentials are the work (a reciprocal estimate in place of the division measured level).
inline float silu_times(float gate, float up) {
  const float e = exp_nonpositive(-std::fabs(gate));
  return gate * (gate >= 0.0f ? 1.0f : e) / (1.0f + e) * up;
}

template <typename T>
void silu_and_mul(const T* gate_up, int64_t stride, int64_t rows, int64_t width, T* out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= kParallelNormRows)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * stride;
    const T* up = gate + width;
    T* target = out + r * width;
    int64_t c = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; c < width; c += 16) {
      const __mmask16 m = lanes(width - c);
      const __m512 x = load16(gate + c, m);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
      const __m512 numerator = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
      const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
      store16(target + c, m, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid), load16(up + c, m)));
    }
#endif
    for (; c < width; ++c) narrow(silu_times(widen(gate[c]), widen(up[c])), &target[c]);
  }
}

// store_kv into an FP8 pool: each token's `width` elements of key and value (float32 or bfloat16 rows, `stride`
// elements apart) rounded to FP8 (`e5m2` 0: e4m3fn) at their slots; a negative slot is skipped. With AVX-512, 16
// elements at a time: the scalar rounding took 2.4 ms of a bfloat16 decode step at 80 decodes (SmolLM2-135M, 30
// layers, AMD EPYC Zen 4), against 1.0 for the bfloat16 store's copies.
template <typename Source, int Mantissa>
void store_fp8_rows(const Source* key, int64_t key_stride, const Source* value, int64_t value_stride,
                    const int64_t* slots, int64_t tokens, int64_t width, uint8_t* k_cache, uint8_t* v_cache) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; i < width; i += 16) {
      const __mmask16 m = lanes(width - i);
      _mm_mask_storeu_epi8(k_cache + slots[t] * width + i, m, to_fp8<Mantissa>(load16(key + t * key_stride + i, m)));
      _mm_mask_storeu_epi8(v_cache + slots[t] * width + i, m,
                           to_fp8<Mantissa>(load16(value + t * value_stride + i, m)));
    }
#endif
    for (; i < width; ++i) {
      k_cache[slots[t] * width + i] = to_fp8<Mantissa>(widen(key[t * key_stride + i]));
      v_cache[slots[t] * width + i] = to_fp8<Mantissa>(widen(value[t * value_stride + i]));
    }
  }
}

}  // namespace

extern "C" {

void add_rms_norm_f32(const float* x, int64_t x_stride, const float* residual, int64_t residual_stride,
                      const float* weight, int64_t rows, int64_t cols, float eps, float* normed, float* sum,
                      int threads) {
  add_rms_norm(x, x_stride, residual, residual_stride, weight, rows, cols, eps, normed, sum, threads);
}

void add_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* residual, int64_t residual_stride,
                       const uint16_t* weight, int64_t rows, int64_t cols, float eps, uint16_t* normed, uint16_t* sum,
                       int threads) {
  add_rms_norm(x, x_stride, residual, residual_stride, weight, rows, cols, eps, normed, sum, threads);
}

void rope_f32(const float* x, int64_t token_stride, int64_t head_stride, int64_t heads, const int64_t* positions,
              const float* table, int64_t width, int64_t tokens, float* out, int threads) {
  rope(x, token_stride, head_stride, heads, positions, table, width, tokens, out, threads);
}

void rope_bf16(const uint16_t* x, int64_t token_stride, int64_t head_stride, int64_t heads, const int64_t* positions,
               const float* table, int64_t width, int64_t tokens, uint16_t* out, int threads) {
  rope(x, token_stride, head_stride, heads, positions, table, width, tokens, out, threads);
}

void silu_and_mul_f32(const float* gate_up, int64_t stride, int64_t rows, int64_t width, float* out, int threads) {
  silu_and_mul(gate_up, stride, rows, width, out, threads);
}

void silu_and_mul_bf16(const uint16_t* gate_up, int64_t stride, int64_t rows, int64_t width, uint16_t* out,
                       int threads) {
  silu_and_mul(gate_up, stride, rows, width, out, threads);
}

// Each token's key and value row (`row_bytes`, rows `stride` bytes apart) into its pool slot; a negative slot
// (a padding row) is skipped. torch did this as a mask test that synchronises, then two index copies.
void store_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride, const int64_t* slots,
              int64_t tokens, int64_t row_bytes, char* k_cache, char* v_cache) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(k_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
    std::memcpy(v_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
  }
}

// The KV store into an FP8 pool, from float32 or bfloat16 keys and values (`e5m2` 0: e4m3fn).
void store_kv_fp8_f32(const float* key, int64_t key_stride, const float* value, int64_t value_stride,
                      const int64_t* slots, int64_t tokens, int64_t width, uint8_t* k_cache, uint8_t* v_cache,
                      int e5m2) {
  (e5m2 ? store_fp8_rows<float, 2> : store_fp8_rows<float, 3>)(key, key_stride, value, value_stride, slots, tokens,
                                                               width, k_cache, v_cache);
}

void store_kv_fp8_bf16(const uint16_t* key, int64_t key_stride, const uint16_t* value, int64_t value_stride,
                       const int64_t* slots, int64_t tokens, int64_t width, uint8_t* k_cache, uint8_t* v_cache,
                       int e5m2) {
  (e5m2 ? store_fp8_rows<uint16_t, 2> : store_fp8_rows<uint16_t, 3>)(key, key_stride, value, value_stride, slots,
                                                                     tokens, width, k_cache, v_cache);
}
}
