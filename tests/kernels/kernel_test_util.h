#pragma once

// What the CPU kernel tests and the CUDA parity test share: random K/V in any dtype, and the
// normalized error the two hold kernels to.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/dtype.h"

namespace kvpool::kernels::test_util {

// `count` standard-normal values stored in `dtype`, as raw bytes.
inline std::vector<char> RandomValues(int64_t count, DType dtype, std::mt19937* rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<char> out(static_cast<size_t>(count * DTypeSize(dtype)));
  for (int64_t i = 0; i < count; ++i) {
    const float f = dist(*rng);
    switch (dtype) {
      case DType::kF32:
        std::memcpy(out.data() + i * 4, &f, 4);
        break;
      case DType::kF16: {
        const uint16_t h = FloatToF16(f);
        std::memcpy(out.data() + i * 2, &h, 2);
        break;
      }
      case DType::kBF16: {
        const uint16_t h = FloatToBF16(f);
        std::memcpy(out.data() + i * 2, &h, 2);
        break;
      }
    }
  }
  return out;
}

// max |a - b| / max |b|, and whether any value is NaN.
inline double NormalizedError(const std::vector<float>& a, const std::vector<float>& b, bool* nan) {
  double diff = 0, scale = 0;
  *nan = false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) *nan = true;
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

}  // namespace kvpool::kernels::test_util
