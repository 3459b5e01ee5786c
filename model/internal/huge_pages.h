#pragma once

// HugePageAllocator: a std::allocator that backs large buffers with transparent huge pages.
//
// A decode step streams every weight once (tens of megabytes for `tiny`, gigabytes for a real
// checkpoint). On 4 KiB pages that walk misses the TLB every 4 KiB and the hardware prefetcher
// stops at each page boundary; on 2 MiB pages it does neither. Linux hands out huge pages only to
// regions that ask (transparent_hugepage=madvise is the common default), and only for memory
// touched after asking, so the region is mapped 2 MiB-aligned and madvise(MADV_HUGEPAGE)d before
// anything is written to it. Where the kernel has huge pages off the advice is a no-op and the
// buffer is ordinary memory. Buffers under 2 MiB come from operator new.

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace kvpool::model::internal {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Maps `bytes` (rounded up to whole huge pages) at a huge-page boundary and advises huge pages.
// Throws std::bad_alloc when the mapping fails, as operator new does.
inline void* MapHugePages(size_t bytes) {
  const size_t size = (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  // Over-map by one huge page, then trim both ends to the aligned range.
  void* raw = mmap(nullptr, size + kHugePageBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  if (aligned > base) munmap(raw, aligned - base);
  const uintptr_t end = base + size + kHugePageBytes;
  if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
  madvise(reinterpret_cast<void*>(aligned), size, MADV_HUGEPAGE);  // advice: failure is harmless
  return reinterpret_cast<void*>(aligned);
}

inline void UnmapHugePages(void* p, size_t bytes) {
  munmap(p, (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
}

template <typename T>
struct HugePageAllocator {
  using value_type = T;

  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT(google-explicit-constructor)

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) return static_cast<T*>(::operator new(bytes));
    return static_cast<T*>(MapHugePages(bytes));
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) {
      ::operator delete(p);
      return;
    }
    UnmapHugePages(p, bytes);
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
};

// A weight matrix the step streams through.
using HugeVector = std::vector<float, HugePageAllocator<float>>;

}  // namespace kvpool::model::internal
