#include "client/internal/fork.h"

#include <pthread.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <mutex>

namespace kvpool::client::internal {
namespace {

// A slot holds kFree, a registered socket's descriptor + 1 (so that the zero-initialized array,
// constant-initialized before any constructor runs, is all free), or kClosedByFork: the child
// handler closed the socket, and the slot stays taken until its Client unregisters it.
constexpr int kFree = 0;
constexpr int kClosedByFork = -1;

constinit std::array<std::atomic<int>, kForkSlots> slots{};
static_assert(std::atomic<int>::is_always_lock_free);

// Runs in the child only, on the one thread fork() left: loads, close() and stores, nothing else.
void CloseAttachSocketsInChild() {
  for (std::atomic<int>& slot : slots) {
    const int value = slot.load(std::memory_order_acquire);
    if (value <= kFree) continue;
    ::close(value - 1);
    slot.store(kClosedByFork, std::memory_order_release);
  }
}

}  // namespace

int RegisterAttachSocket(int fd) {
  static std::once_flag installed;
  std::call_once(installed, [] { pthread_atfork(nullptr, nullptr, &CloseAttachSocketsInChild); });
  for (size_t i = 0; i < slots.size(); ++i) {
    int expected = kFree;
    if (slots[i].compare_exchange_strong(expected, fd + 1, std::memory_order_acq_rel)) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

bool UnregisterAttachSocket(int slot) {
  if (slot < 0) return true;
  return slots[static_cast<size_t>(slot)].exchange(kFree, std::memory_order_acq_rel) !=
         kClosedByFork;
}

}  // namespace kvpool::client::internal
