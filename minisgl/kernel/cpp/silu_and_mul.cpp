// x = [gate | up] per row -> silu(gate) * up = gate / (1 + e^-gate) * up, into out [rows, n]. One
// call where the reference runs a chunk, silu and a product, each over the whole activation.
#include <cstdint>

#include "exp.h"

extern "C" void silu_and_mul(const float* x, int64_t x_row_stride, int64_t rows, int64_t n,
                             float* out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * x_row_stride;
    const float* up = gate + n;
    float* y = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = gate[i] / (1.0f + exp_float(-gate[i])) * up[i];
  }
}
