// e^x in float for x in [-87, 88] (clamped there): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor series to r^7 (relative error below 1e-8), 2^n by building the float's exponent. A loop
// of these vectorises, where std::exp stays a call per element.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>

inline float exp_float(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // 2^n stays a normal float
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.0f / 5040;
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 1.0f / 2, 1.0f, 1.0f})
    p = p * r + c;
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);
}
