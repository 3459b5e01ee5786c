#pragma once

// Test seam: run the portable (non-AVX2) CPU kernels even where AVX2 is present, so both code
// paths are covered on any machine.

namespace kvpool::kernels::cpu::internal {

void ForcePortableKernelsForTesting(bool portable);

}  // namespace kvpool::kernels::cpu::internal
