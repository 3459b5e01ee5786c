#include "kernels/cpu_isa.h"

#include <algorithm>
#include <atomic>

namespace kvpool::kernels::cpu {
namespace {

Isa Detect() {
  __builtin_cpu_init();
  // libgcc's cpu model also checks that the OS saves the wider registers (XCR0).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
  return Isa::kPortable;
}

std::atomic<Isa> limit{Isa::kAvx512};

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

}  // namespace kvpool::kernels::cpu
