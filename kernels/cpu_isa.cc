#include "kernels/cpu_isa.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>

namespace kvpool::kernels::cpu {
namespace {

// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

Isa Detect() {
  __builtin_cpu_init();
  // libgcc's cpu model also checks that the OS saves the wider registers (XCR0).
  const bool f16c = HasF16c();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && f16c) {
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return Isa::kAvx2;
  }
  return Isa::kPortable;
}

bool DetectAvx512Vnni() {
  __builtin_cpu_init();
  return DetectedIsa() == Isa::kAvx512 && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
}

std::atomic<Isa> limit{Isa::kAvx512};
std::atomic<bool> vnni_enabled{true};

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2+fma+f16c";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

Isa DetectedIsa() {
  static const Isa detected = Detect();
  return detected;
}

Isa KernelIsa() { return std::min(DetectedIsa(), limit.load(std::memory_order_relaxed)); }

void LimitKernelIsaForTesting(Isa max) { limit.store(max, std::memory_order_relaxed); }

void ForcePortableKernelsForTesting(bool portable) {
  LimitKernelIsaForTesting(portable ? Isa::kPortable : Isa::kAvx512);
}

bool DetectedAvx512Vnni() {
  static const bool detected = DetectAvx512Vnni();
  return detected;
}

bool KernelAvx512Vnni() {
  return KernelIsa() == Isa::kAvx512 && DetectedAvx512Vnni() &&
         vnni_enabled.load(std::memory_order_relaxed);
}

void SetAvx512VnniForTesting(bool enabled) {
  vnni_enabled.store(enabled, std::memory_order_relaxed);
}

}  // namespace kvpool::kernels::cpu
