// RMSNorm's scale for one vector: 1 / sqrt(mean(x^2) + eps), in the reference's steps (the mean
// rounded to float before eps is added); the squares summed in double, so the result differs
// from torch's by its float sum's own rounding error (which grows with n) and the mean's rounding.
#pragma once
#include <cmath>
#include <cstdint>

inline float inverse_rms(const float* __restrict__ x, int64_t n, float eps) {
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
  const float mean = float(sum) / float(n);
  return 1.0f / std::sqrt(mean + eps);
}

// out = weight * (x * scale), each product rounded as the reference rounds it (the file is built
// without FMA contraction); out may be x
inline void scale_by(const float* x, float scale, const float* __restrict__ weight, int64_t n,
                     float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * scale);
}
