#pragma once

// Row conversions of WriteKv (cpu_write_kv.cc), per instruction set: f32 rows to a pool's
// dtypes, the largest magnitude of a row, and the rescaling of 8-bit codes when a block's scale
// grows. Rows are a multiple of 8 values (head_dim is); pointers have any alignment.

#include "kernels/dtype.h"

namespace kvpool::kernels::cpu::internal {

struct ConvertFns {
  // dst = src[0..n) * mul, stored as the dtype indexed (dtype.h's rounding and saturation).
  void (*narrow[kNumDTypes])(const float* src, int n, float mul, char* dst);
  // An 8-bit row's codes re-encoded under a new scale: code' = encode(decode(code) * ratio),
  // ratio = old scale / new scale. Null for the 16- and 32-bit dtypes.
  void (*rescale[kNumDTypes])(char* row, int n, float ratio);
  // max |src[0..n)|, or NaN when any value is NaN or infinite.
  float (*absmax)(const float* src, int n);
};

// REQUIRES: the processor supports the set.
ConvertFns ConvertPortable();
ConvertFns ConvertAvx2();

}  // namespace kvpool::kernels::cpu::internal
