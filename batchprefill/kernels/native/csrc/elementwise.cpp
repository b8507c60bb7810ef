// The CPU path's per-token ops, each one pass over its rows: RMSNorm with the residual add folded in,
// rotate-half RoPE, and the new keys and values written into the paged pool.
//
// Why: in a decode step these run between matmuls that stream the weights through the caches, so their
// tensors are cold, and torch runs RMSNorm as seven ops and RoPE as about ten, each writing a fresh output to
// cold memory. Here each row is read once and written once: at 80 decodes (SmolLM2-135M, float32,
// benchmarks/step_ops.py) RMSNorm, RoPE and the KV store took 4.5, 1.9 and 1.5 ms of a decode step against
// 7.7, 5.7 and 3.1 ms as torch ops (BENCHMARKS.md, session 5).
//
// A step of a few hundred rows runs on the calling thread (too little work to split); long prefill chunks are
// split across threads.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {
constexpr int64_t kParallelRows = 512;
}

extern "C" {

// sum = x + residual (when residual is given; rows of x and residual may be strided), normed = sum *
// rsqrt(mean(sum^2) + eps) * weight; float32 [rows, cols], outputs contiguous.
void add_rms_norm_f32(const float* x, int64_t x_stride, const float* residual, int64_t residual_stride,
                      const float* weight, int64_t rows, int64_t cols, float eps, float* normed, float* sum,
                      int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const float* source = x + r * x_stride;
    float* total = residual != nullptr ? sum + r * cols : nullptr;
    float squares = 0.0f;
    if (total != nullptr) {
      const float* add = residual + r * residual_stride;
#pragma omp simd reduction(+ : squares)
      for (int64_t c = 0; c < cols; ++c) {
        total[c] = source[c] + add[c];
        squares += total[c] * total[c];
      }
      source = total;
    } else {
#pragma omp simd reduction(+ : squares)
      for (int64_t c = 0; c < cols; ++c) squares += source[c] * source[c];
    }
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(cols) + eps);
    float* target = normed + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) target[c] = source[c] * inverse * weight[c];
  }
}

// Rotate-half RoPE of one tensor's heads [tokens, heads, width] (token and head strides given, the last
// dimension contiguous) into a contiguous [tokens, heads, width]: with cos and sin from the table row of the
// token's position ([positions, width]: cos then sin, width / 2 each), the first half becomes
// x1 * cos - x2 * sin and the second x2 * cos + x1 * sin.
void rope_f32(const float* x, int64_t token_stride, int64_t head_stride, int64_t heads, const int64_t* positions,
              const float* table, int64_t width, int64_t tokens, float* out, int threads) {
  const int64_t half = width / 2;
#pragma omp parallel for num_threads(threads) if (tokens >= kParallelRows)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = table + positions[t] * width;
    const float* sin = cos + half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* first = x + t * token_stride + h * head_stride;
      const float* second = first + half;
      float* target = out + (t * heads + h) * width;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        target[d] = first[d] * cos[d] - second[d] * sin[d];
        target[half + d] = second[d] * cos[d] + first[d] * sin[d];
      }
    }
  }
}

// Each token's key and value row ([kv_heads * dim] floats, rows strided) into its pool slot; a negative slot
// (a padding row) is skipped. torch did this as a mask test that synchronises, then two index copies.
void store_kv_f32(const float* key, int64_t key_stride, const float* value, int64_t value_stride,
                  const int64_t* slots, int64_t tokens, int64_t width, float* k_cache, float* v_cache) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(k_cache + slots[t] * width, key + t * key_stride, width * 4);
    std::memcpy(v_cache + slots[t] * width, value + t * value_stride, width * 4);
  }
}
}
