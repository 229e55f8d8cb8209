// QK-norm (where weights are given) and RoPE (the two halves of each head paired) in place on q's
// and k's heads, then each token's K and V rows into the pool: the reference's arithmetic in its
// order, each product rounded (built without FMA contraction), so without QK-norm the results are
// bit-equal to torch_ops.apply_rope_inplace's; the norm's mean is summed in another order.
#include <cstdint>
#include <cstring>

#include "rms.h"

namespace {

struct Heads {
  float* x;  // [tokens, heads, head_dim], heads contiguous within a token's row
  int64_t row_stride, heads;
  const float* norm_weight;  // [head_dim] for QK-norm, or nullptr
};

void rotate(const Heads& t, int64_t token, const float* cos, const float* sin, int64_t half,
            float eps) {
  for (int64_t h = 0; h < t.heads; ++h) {
    float* x1 = t.x + token * t.row_stride + h * 2 * half;
    float* x2 = x1 + half;
    if (t.norm_weight != nullptr) {
      scale_by(x1, inverse_rms(x1, 2 * half, eps), t.norm_weight, 2 * half, x1);
    }
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float a = x1[d], b = x2[d];
      x1[d] = a * cos[d] - b * sin[d];
      x2[d] = b * cos[d] + a * sin[d];
    }
  }
}

}  // namespace

extern "C" void rope_store(const int32_t* positions, int64_t tokens, const float* cos_sin,
                           int64_t head_dim, float* q, int64_t q_row_stride, int64_t q_heads,
                           float* k, int64_t k_row_stride, int64_t k_heads, const float* q_norm,
                           const float* k_norm, float eps, const float* v,
                           int64_t v_row_stride, const int32_t* out_loc, float* k_cache,
                           float* v_cache, int threads) {
  const int64_t half = head_dim / 2;
  const Heads qs{q, q_row_stride, q_heads, q_norm}, ks{k, k_row_stride, k_heads, k_norm};
  const int64_t row_bytes = k_heads * head_dim * int64_t(sizeof(float));
#pragma omp parallel for num_threads(threads) if (tokens > 16)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = cos_sin + positions[t] * head_dim;
    rotate(qs, t, cos, cos + half, half, eps);
    rotate(ks, t, cos, cos + half, half, eps);
    if (out_loc != nullptr) {
      std::memcpy(k_cache + out_loc[t] * k_heads * head_dim, k + t * k_row_stride, row_bytes);
      std::memcpy(v_cache + out_loc[t] * k_heads * head_dim, v + t * v_row_stride, row_bytes);
    }
  }
}
