#pragma once

// Which vector instruction set host code uses (the CPU kernels, the host model's matrix
// products), chosen at run time: the default build assumes nothing beyond x86-64. AVX-512 (F, BW,
// VL, DQ) where the processor and the OS support it, else AVX2 + FMA + F16C, else portable C++.
// Each file compiles its vector paths with function-level target attributes or a
// `#pragma GCC target` region, so nothing outside them uses these instructions.
//
// Test seam: LimitKernelIsaForTesting caps the choice, so every path is covered on any machine
// that has it. Thread-safe.

#include <cstdint>
#include <string_view>

namespace kvpool::kernels::cpu {

// Ordered: each includes the ones before it.
enum class Isa : uint8_t { kPortable, kAvx2, kAvx512 };

std::string_view IsaName(Isa isa);  // "portable", "avx2+fma+f16c", "avx512"

// What this processor (and OS) supports.
Isa DetectedIsa();

// What the kernels use now: DetectedIsa(), capped by LimitKernelIsaForTesting.
Isa KernelIsa();

// Caps KernelIsa() at `max` (kAvx512 lifts the cap).
void LimitKernelIsaForTesting(Isa max);

// Same as LimitKernelIsaForTesting(portable ? kPortable : kAvx512).
void ForcePortableKernelsForTesting(bool portable);

}  // namespace kvpool::kernels::cpu
