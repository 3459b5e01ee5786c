#pragma once

// The decode doorbell (DESIGN.md §7, docs/trust-model.md): a page of shared memory per session
// through which a client on the same host asks for decode steps without a gRPC round trip. It is
// a memfd the daemon creates, seals against resizing and hands over at attach (FD_ROLE_DOORBELL);
// both sides map it read-write.
//
// One call at a time:
//   client  writes num_items and items[], then bumps `ring` (release) and wakes it (futex);
//   daemon  waits on `ring`; when it changes, copies the request out once, runs it as a Decode
//           call of the session (the same checks, limits and step as the RPC), writes the
//           answer, stores the served ring value into `answered` (release) and wakes it;
//   client  waits on `answered` until it equals its ring.
// The daemon reads nothing of the page but `ring`, `num_items`, `timeout_ns` and items[], each
// once per call,
// and bounds num_items before copying: a client can only hurt itself by writing anything else at
// any time. Words are waited on with shared futexes (the page is MAP_SHARED).
//
// Depends on nothing but the standard library and Linux headers, like wire.h.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <type_traits>

namespace kvpool::wire {

inline constexpr uint32_t kDoorbellMaxItems = 256;  // larger batches go over gRPC
inline constexpr uint32_t kDoorbellMessageBytes = 480;
inline constexpr uint32_t kDoorbellShortfallBytes = 60;

struct DoorbellItem {
  uint64_t sequence_id;
  int32_t token;
  uint32_t reserved;
};

struct DoorbellResult {
  int64_t num_tokens;  // the sequence's tokens with K/V in the pool after the step
  int32_t next_token;
  uint32_t reserved;
};

struct DoorbellPage {
  // Written by the client.
  alignas(64) std::atomic<uint32_t> ring;  // bumped once per request
  uint32_t num_items;                      // in [1, kDoorbellMaxItems]
  // How long the client waits from the ring on (ns): the call's deadline, as a gRPC deadline
  // would be. A call still queued when it passes is refused (DEADLINE_EXCEEDED); <= 0: at once.
  int64_t timeout_ns;
  DoorbellItem items[kDoorbellMaxItems];
  // Written by the daemon.
  alignas(64) std::atomic<uint32_t> answered;  // the ring value last answered
  int32_t code;                                // absl::StatusCode of the call
  int32_t step_sequences;                      // sequences in the step that served it
  uint32_t message_bytes;                      // of message[], when code is not OK
  char message[kDoorbellMessageBytes];
  uint32_t shortfall_bytes;                   // of shortfall[]: RESOURCE_EXHAUSTED's
  char shortfall[kDoorbellShortfallBytes];    // "<resource>:<blocks>", as in kShortfallKey
  DoorbellResult results[kDoorbellMaxItems];  // in item order, when code is OK
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "the futex words must be plain 32-bit words");
static_assert(std::is_standard_layout_v<DoorbellPage>);
static_assert(std::is_trivially_destructible_v<DoorbellPage>);

// Bytes of the memfd: the page rounded up to 4 KiB.
inline constexpr size_t kDoorbellBytes = (sizeof(DoorbellPage) + 4095) / 4096 * 4096;

// Sleeps while `*word == expected`, at most `timeout` (null: no limit). Returns early on a wake,
// a signal, or when the word already differs; callers re-check the word.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
                      const struct timespec* timeout = nullptr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, timeout, nullptr, 0);
}

// Wakes every waiter on `word`, in any process mapping it.
inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace kvpool::wire
