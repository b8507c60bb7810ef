// Decode attention read where the KV lies in the paged pool: no gathered copy of any context.
//
// One work item is one query set (a decode, or a group of decodes sharing a prefix) against its list of
// blocks. It walks the blocks in order, each block a contiguous [block, kv_heads, dim] run of the pool, and
// keeps an online softmax (running max, running sum, weighted values) per query row, so every key and value
// is read from memory once, straight from the pool. Items run in parallel on the OpenMP runtime torch has
// already loaded (the library links libgomp.so.1, which resolves to torch's copy), so the kernel and torch's
// ops share one thread pool.
//
// Layouts (all contiguous):
//   query   [items, kv_heads, rows, dim] float32: rows = the query heads of one KV head (x group members)
//   k, v    [num_blocks, block, kv_heads, dim] float32 or bfloat16 (raw uint16 bits)
//   blocks  [items, width] int64 block ids; lens [items] int64 tokens to read (from the first listed block)
//   out     [items, kv_heads, rows, dim] float32; lse [items, kv_heads, rows] float32 (natural log;
//           -inf where an item reads no token)

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline void widen(const float* source, float* target, int64_t count) { std::memcpy(target, source, count * 4); }

inline void widen(const uint16_t* source, float* target, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits = static_cast<uint32_t>(source[i]) << 16;
    std::memcpy(&target[i], &bits, 4);
  }
}

// exp(x) for x <= 0 (every exponent here is a score minus a running maximum), written so loops over it
// vectorize: Cephes' expf polynomial on x - n ln2, times 2^n built in the exponent bits (relative error about
// 1e-7; below -87, where expf is under 1.7e-38, it returns 2^-126, nothing beside the maximum's exp(0) = 1).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, 4);
  return p * power;
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

// One row's end: its weighted values divided by their weight, and its log-sum-exp (-inf and zeros where the
// item read no token).
inline void finish(float* acc, int64_t dim, float max, float sum, int64_t length, float* lse) {
  if (length <= 0) {
    *lse = -INFINITY;
    return;
  }
  const float inverse = 1.0f / sum;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) acc[d] *= inverse;
  *lse = max + std::log(sum);
}

// The next block's keys and values, requested while this block computes: blocks lie anywhere in the pool, so
// each is a fresh 12 KB stream (SmolLM2: 16 tokens x 3 KV heads x 64) that the hardware prefetcher would only
// pick up halfway; the loads then stalled the kernel most of its time.
template <typename Cache>
inline void prefetch(const Cache* k_cache, const Cache* v_cache, int64_t offset, int64_t count) {
  const char* k = reinterpret_cast<const char*>(k_cache + offset);
  const char* v = reinterpret_cast<const char*>(v_cache + offset);
  for (int64_t byte = 0; byte < count * static_cast<int64_t>(sizeof(Cache)); byte += 64) {
    __builtin_prefetch(k + byte);
    __builtin_prefetch(v + byte);
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

// exp_nonpositive on 16 lanes (the same steps as the scalar one): the compiler left that loop scalar.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(power));
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

// A query set of many rows (a group of decodes over its shared prefix: members x query heads of a KV head)
// against its blocks, vectorized across rows instead of across the head: the query transposed to
// [dim][rows], each key element broadcast against 16 rows at once, so no dot product needs a horizontal
// reduction and the softmax state of 16 rows moves in one register. Scores are kept [token][rows].
template <typename Cache>
void attend_many(const float* query, const Cache* k_cache, const Cache* v_cache, const int64_t* blocks,
                 const int64_t* lens, int64_t items, int64_t width, int64_t block, int64_t kv_heads, int64_t rows,
                 int64_t dim, float scale, float* out, float* lse, int threads) {
  const int64_t token_stride = kv_heads * dim;
  const int64_t block_stride = block * token_stride;
  const int64_t head_rows = rows * dim;
  const int64_t padded = (rows + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> keys(block_stride), values(block_stride), transposed(kv_heads * dim * padded);
    std::vector<float> scores(kv_heads * block * padded), maxes(kv_heads * padded), sums(kv_heads * padded);
    std::vector<float> rescales(padded);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const float* q = query + item * kv_heads * head_rows;
      float* o = out + item * kv_heads * head_rows;
      std::fill(o, o + kv_heads * head_rows, 0.0f);
      std::fill(maxes.begin(), maxes.end(), -FLT_MAX);
      std::fill(sums.begin(), sums.end(), 0.0f);
      std::fill(transposed.begin(), transposed.end(), 0.0f);
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t d = 0; d < dim; ++d)
            transposed[(h * dim + d) * padded + r] = scale * q[h * head_rows + r * dim + d];
      const int64_t length = lens[item];
      for (int64_t b = 0; b * block < length; ++b) {
        const int64_t count = std::min(block, length - b * block);
        const int64_t offset = blocks[item * width + b] * block_stride;
        if ((b + 1) * block < length)
          prefetch(k_cache, v_cache, blocks[item * width + b + 1] * block_stride,
                   std::min(block, length - (b + 1) * block) * token_stride);
        const auto [k, v] = as_float(k_cache, v_cache, offset, count * token_stride, keys.data(), values.data());
        for (int64_t h = 0; h < kv_heads; ++h) {
          const float* qt = transposed.data() + h * dim * padded;
          float* score = scores.data() + h * block * padded;
          // 16 rows x 8 tokens per pass: one load of the transposed query feeds 8 FMAs, each with its key
          // element broadcast from memory (a tail pass repeats its last token and stores only the real ones)
          for (int64_t tile = 0; tile < padded; tile += 16) {
            for (int64_t first = 0; first < count; first += 8) {
              const float* key[8];
              for (int i = 0; i < 8; ++i) key[i] = k + std::min(first + i, count - 1) * token_stride + h * dim;
              __m512 acc[8];
              for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
              for (int64_t d = 0; d < dim; ++d) {
                const __m512 column = _mm512_loadu_ps(qt + d * padded + tile);
                for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(key[i][d]), column, acc[i]);
              }
              for (int i = 0; i < 8 && first + i < count; ++i) _mm512_storeu_ps(score + (first + i) * padded + tile, acc[i]);
            }
          }
          float* head_max = maxes.data() + h * padded;
          float* head_sum = sums.data() + h * padded;
          for (int64_t tile = 0; tile < padded; tile += 16) {
            const __m512 previous = _mm512_loadu_ps(head_max + tile);
            __m512 running = previous;
            for (int64_t t = 0; t < count; ++t) running = _mm512_max_ps(running, _mm512_loadu_ps(score + t * padded + tile));
            __m512 added = _mm512_setzero_ps();
            for (int64_t t = 0; t < count; ++t) {
              const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(score + t * padded + tile), running));
              _mm512_storeu_ps(score + t * padded + tile, e);
              added = _mm512_add_ps(added, e);
            }
            const __m512 rescale = exp_nonpositive(_mm512_sub_ps(previous, running));
            _mm512_storeu_ps(rescales.data() + tile, rescale);
            _mm512_storeu_ps(head_max + tile, running);
            _mm512_storeu_ps(head_sum + tile, _mm512_fmadd_ps(_mm512_loadu_ps(head_sum + tile), rescale, added));
          }
          for (int64_t r = 0; r < rows; ++r)
            accumulate(score + r, padded, v + h * dim, count, token_stride, rescales[r], o + h * head_rows + r * dim,
                       dim);
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t r = 0; r < rows; ++r)
          finish(o + h * head_rows + r * dim, dim, maxes[h * padded + r], sums[h * padded + r], length,
                 lse + (item * kv_heads + h) * rows + r);
    }
  }
}
#else
constexpr bool kWide = false;
#endif

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

template <bool Wide, typename Cache>
void attend(const float* query, const Cache* k_cache, const Cache* v_cache, const int64_t* blocks,
            const int64_t* lens, int64_t items, int64_t width, int64_t block, int64_t kv_heads, int64_t rows,
            int64_t dim, float scale, float* out, float* lse, int threads) {
  const int64_t token_stride = kv_heads * dim;
  const int64_t block_stride = block * token_stride;
  const int64_t head_rows = rows * dim;
#pragma omp parallel num_threads(threads)
  {
    // Per thread: one block's keys and values as float32 (a copy only for bfloat16), its scores, and the
    // online softmax state of every (head, row).
    std::vector<float> keys(block_stride), values(block_stride), scores(kv_heads * rows * block);
    std::vector<float> maxes(kv_heads * rows), sums(kv_heads * rows), rescales(kv_heads * rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const float* q = query + item * kv_heads * head_rows;
      float* o = out + item * kv_heads * head_rows;
      std::fill(o, o + kv_heads * head_rows, 0.0f);
      std::fill(maxes.begin(), maxes.end(), -FLT_MAX);
      std::fill(sums.begin(), sums.end(), 0.0f);
      const int64_t length = lens[item];
      for (int64_t b = 0; b * block < length; ++b) {
        const int64_t count = std::min(block, length - b * block);
        const int64_t offset = blocks[item * width + b] * block_stride;
        const int64_t next = (b + 1) * block < length ? blocks[item * width + b + 1] * block_stride : -1;
        const auto [k, v] = as_float(k_cache, v_cache, offset, count * token_stride, keys.data(), values.data());
        const int64_t states = kv_heads * rows;
        // Scores token by token, so the block is read front to back (the next block's same token is requested
        // meanwhile), then each (head, row)'s online softmax, then values token by token.
        for (int64_t t = 0; t < count; ++t) {
          if (next >= 0) prefetch(k_cache, v_cache, next + t * token_stride, token_stride);
          const float* kt = k + t * token_stride;
          for (int64_t h = 0; h < kv_heads; ++h) {
            for (int64_t r = 0; r < rows; r += 4) {
              const float* qr = q + h * head_rows + r * dim;
              float* score = scores.data() + (h * rows + r) * block + t;
              if constexpr (Wide) {
                dot_rows(qr, std::min<int64_t>(4, rows - r), kt + h * dim, dim, scale, score, block);
              } else {
                for (int64_t i = 0; i < std::min<int64_t>(4, rows - r); ++i)
                  score[i * block] = scale * dot_plain(qr + i * dim, kt + h * dim, dim);
              }
            }
          }
        }
        for (int64_t state = 0; state < states; ++state) {
          float* score = scores.data() + state * block;
          float running = maxes[state];
          for (int64_t t = 0; t < count; ++t) running = std::max(running, score[t]);
          rescales[state] = exp_nonpositive(maxes[state] - running);
          maxes[state] = running;
          float added = 0.0f;
          if constexpr (Wide) {
            added = exponentiate(score, count, running);
          } else {
            for (int64_t t = 0; t < count; ++t) {
              score[t] = exp_nonpositive(score[t] - running);
              added += score[t];
            }
          }
          sums[state] = sums[state] * rescales[state] + added;
        }
        for (int64_t h = 0; h < kv_heads; ++h) {
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t state = h * rows + r;
            float* acc = o + h * head_rows + r * dim;
            if constexpr (Wide) {
              accumulate(scores.data() + state * block, 1, v + h * dim, count, token_stride, rescales[state], acc, dim);
            } else {
              accumulate_plain(scores.data() + state * block, v + h * dim, count, token_stride, rescales[state], acc,
                               dim);
            }
          }
        }
      }
      for (int64_t state = 0; state < kv_heads * rows; ++state)
        finish(o + state * dim, dim, maxes[state], sums[state], length, lse + item * kv_heads * rows + state);
    }
  }
}

// From this many rows a query set runs vectorized across rows (attend_many).
constexpr int64_t kManyRows = 16;

template <typename Cache>
void run(const float* query, const Cache* k_cache, const Cache* v_cache, const int64_t* blocks, const int64_t* lens,
         int64_t items, int64_t width, int64_t block, int64_t kv_heads, int64_t rows, int64_t dim, float scale,
         float* out, float* lse, int threads) {
  if constexpr (kWide) {
    if (dim % 16 == 0 && rows >= kManyRows)
      return attend_many(query, k_cache, v_cache, blocks, lens, items, width, block, kv_heads, rows, dim, scale, out,
                         lse, threads);
  }
  if (kWide && dim % 16 == 0) {
    attend<kWide>(query, k_cache, v_cache, blocks, lens, items, width, block, kv_heads, rows, dim, scale, out, lse,
                  threads);
  } else {
    attend<false>(query, k_cache, v_cache, blocks, lens, items, width, block, kv_heads, rows, dim, scale, out, lse,
                  threads);
  }
}

}  // namespace

extern "C" {

void paged_decode_f32(const float* query, const float* k_cache, const float* v_cache, const int64_t* blocks,
                      const int64_t* lens, int64_t items, int64_t width, int64_t block, int64_t kv_heads,
                      int64_t rows, int64_t dim, float scale, float* out, float* lse, int threads) {
  run(query, k_cache, v_cache, blocks, lens, items, width, block, kv_heads, rows, dim, scale, out, lse, threads);
}

void paged_decode_bf16(const float* query, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* blocks,
                       const int64_t* lens, int64_t items, int64_t width, int64_t block, int64_t kv_heads,
                       int64_t rows, int64_t dim, float scale, float* out, float* lse, int threads) {
  run(query, k_cache, v_cache, blocks, lens, items, width, block, kv_heads, rows, dim, scale, out, lse, threads);
}
}
