#pragma once

// StreamCopy: memcpy for the CPU device's transfer stream, whose copies are large (a promoted
// run of blocks from a host tier, a demoted block) and whose destination is not read by the
// copying core soon after. From kStreamCopyMinBytes up, on x86-64, it stores with non-temporal
// (streaming) stores: they skip the read-for-ownership of every destination line that glibc's
// memcpy pays below its non-temporal threshold (240 MiB on this VM: `ld.so --list-tunables`),
// and they leave the caches to the threads that compute. On this project's 2-core EPYC VM
// (bench/tier_bench, 2026-12-07): a promotion of a 4 MiB run took 0.85 of its time with memcpy
// (ab_compare, 10 rounds); a 64 KiB copy from DRAM ran 1.15-1.2x memcpy's speed, a 4 MiB one
// 0.94-1.17x (noisy). Where source and destination both sit in the caches, memcpy is faster
// (0.7x at 64 KiB): the transfer stream's copies are not that case.
// Below the threshold, or elsewhere, it is memcpy.
//
// The copy is complete and globally visible when StreamCopy returns (it ends with a store
// fence), so a fence completed after it orders it as a memcpy would be. Thread-safe; the
// ranges must not overlap.

#include <cstddef>

namespace kvpool::kernels::internal {

inline constexpr size_t kStreamCopyMinBytes = size_t{64} << 10;

void StreamCopy(void* dst, const void* src, size_t bytes);

}  // namespace kvpool::kernels::internal
