#pragma once

// Which vector instruction set host code uses (the CPU kernels, the host model's matrix
// products), chosen at run time: the default build assumes nothing beyond x86-64. AVX-512 (F, BW,
// VL, DQ) where the processor and the OS support it, else AVX2 + FMA + F16C, else portable C++.
// Each file compiles its vector paths with function-level target attributes or a
// `#pragma GCC target` region, so nothing outside them uses these instructions.
//
// Within AVX-512 the 8-bit decode (int8 and fp8 K/V) also uses three extensions where the
// processor has all of them: VNNI (vpdpbusd, vpdpwssd), VBMI (vpermi2b) and BF16 (vdpbf16ps), as
// Sapphire Rapids and Zen 4 or later do (Ice Lake lacks BF16, Cascade and Cooper Lake VBMI: they
// keep the plain AVX-512 path). The extensions are not a level of their own: the levels stay the
// three below, and everything but the 8-bit decode runs the same code with or without them.
//
// Test seam: LimitKernelIsaForTesting caps the choice and SetAvx512VnniForTesting turns the
// extensions off, so every path is covered on any machine that has it. Thread-safe.

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

// Whether the processor has AVX-512 VNNI, VBMI and BF16 (and DetectedIsa() is kAvx512).
bool DetectedAvx512Vnni();

// What the 8-bit decode uses now: KernelIsa() is kAvx512, DetectedAvx512Vnni(), and the tests
// have not turned the extensions off.
bool KernelAvx512Vnni();

// Turns the extensions off (false) or back on where the processor has them (true, the default).
void SetAvx512VnniForTesting(bool enabled);

}  // namespace kvpool::kernels::cpu
