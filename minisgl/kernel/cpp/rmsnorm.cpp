// RMSNorm of each row, after adding it into the residual stream where one is given:
//   residual <- residual + x;  out <- weight * (residual * inverse_rms(residual))
// (out may be x). One call per norm of a step: at 32 decode rows of the CPU benchmark's model the
// reference's seven torch ops cost ~90 us a call, for ~1 us of arithmetic.
#include <cstdint>

#include "rms.h"

extern "C" void rmsnorm(float* x, int64_t x_row_stride, float* residual,
                        int64_t residual_row_stride, const float* weight, int64_t rows, int64_t n,
                        float eps, float* out, int64_t out_row_stride, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 64)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * x_row_stride;
    if (residual != nullptr) {
      float* sum = residual + r * residual_row_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sum[i] += row[i];
      row = sum;
    }
    scale_by(row, inverse_rms(row, n, eps), weight, n, out + r * out_row_stride);
  }
}
