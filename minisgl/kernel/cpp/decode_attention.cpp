// Decode attention on the CPU: each request of a batch that computes one token attends to all
// of its keys, read from the paged pool where they lie (through the page table), so nothing is
// gathered or padded. One task per (request, KV head), spread over torch's OpenMP threads; each
// task runs its query heads one at a time over keys that stay in the core's cache.
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "exp.h"

namespace {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16) { return std::bit_cast<float>(uint32_t(bf16) << 16); }

struct Batch {
  const float* q;  // [rows, qo_heads, head_dim]
  int64_t q_row_stride;
  const void* k;  // [locations, kv_heads, head_dim]
  const void* v;
  const int32_t* page_table;  // [slots, table_width]: the location of each position's K/V
  int64_t table_width;
  const int32_t* cu_seqlens_q;  // request i computes rows cu[i]:cu[i + 1]
  const int32_t* slots;
  const int32_t* seq_lens;
  int64_t requests, qo_heads, kv_heads, head_dim;
  float scale;
  float* out;  // like q
  int64_t out_row_stride;
  int threads;
};

// HEAD_DIM 0: b.head_dim, read at run time; a known one lets the compiler keep a head in registers
template <typename KV, int64_t HEAD_DIM>
void attend(const Batch& b) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : b.head_dim;
  const int64_t group = b.qo_heads / b.kv_heads;
  const int64_t loc_stride = b.kv_heads * head_dim;
  const KV* k = static_cast<const KV*>(b.k);
  const KV* v = static_cast<const KV*>(b.v);
#pragma omp parallel for schedule(dynamic, 1) num_threads(b.threads)
  for (int64_t task = 0; task < b.requests * b.kv_heads; ++task) {
    const int64_t i = task / b.kv_heads, h = task % b.kv_heads;
    const int64_t row = b.cu_seqlens_q[i];
    if (b.cu_seqlens_q[i + 1] - row != 1) continue;  // a prompt chunk: not ours
    const int64_t len = b.seq_lens[i];
    const int32_t* locs = b.page_table + b.slots[i] * b.table_width;
    std::vector<float> scores(len);
    float* __restrict__ p = scores.data();
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = h * group + g;
      const float* q = b.q + row * b.q_row_stride + head * head_dim;
      for (int64_t w = 0; w < len; ++w) {
        const KV* __restrict__ key = k + locs[w] * loc_stride + h * head_dim;
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * to_float(key[d]);
        p[w] = b.scale * dot;
      }
      float max_score = -INFINITY;
      for (int64_t w = 0; w < len; ++w) max_score = p[w] > max_score ? p[w] : max_score;
      float sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t w = 0; w < len; ++w) {
        p[w] = exp_float(p[w] - max_score);
        sum += p[w];
      }
      std::vector<float> acc(head_dim, 0.0f);
      for (int64_t w = 0; w < len; ++w) {
        const KV* __restrict__ value = v + locs[w] * loc_stride + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[w] * to_float(value[d]);
      }
      float* out = b.out + row * b.out_row_stride + head * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) out[d] = acc[d] / sum;
    }
  }
}

template <typename KV>
void attend_any_head_dim(const Batch& b) {
  switch (b.head_dim) {
    case 64: return attend<KV, 64>(b);
    case 128: return attend<KV, 128>(b);
    default: return attend<KV, 0>(b);
  }
}

}  // namespace

extern "C" void decode_attention(const float* q, int64_t q_row_stride, const void* k,
                                 const void* v, int kv_is_bf16, const int32_t* page_table,
                                 int64_t table_width, const int32_t* cu_seqlens_q,
                                 const int32_t* slots, const int32_t* seq_lens, int64_t requests,
                                 int64_t qo_heads, int64_t kv_heads, int64_t head_dim, float scale,
                                 float* out, int64_t out_row_stride, int threads) {
  const Batch b{q,        q_row_stride, k,        v,         page_table, table_width,
                cu_seqlens_q, slots,    seq_lens, requests,  qo_heads,   kv_heads,
                head_dim, scale,        out,      out_row_stride, threads};
  if (kv_is_bf16)
    attend_any_head_dim<uint16_t>(b);
  else
    attend_any_head_dim<float>(b);
}
