#pragma once

// DecodeDoorbell: one session's decode doorbell (kvpool/v1/doorbell.h), the daemon's side. It
// owns the sealed memfd page and one thread that waits on the page's ring word, copies each
// request out once, queues it in the engine as a Decode call of the session (the same checks,
// limits and model step as the Decode RPC), and writes the answer back. One call at a time per
// session: a client that rings again before its answer is served after it.
//
// Each call's CallContext carries the client's deadline (the page's timeout_ns, from the moment
// the request is copied), as a gRPC deadline would.
//
// A client that rings faster than it can be served well (request after refused request, each
// answered at once) cannot keep the thread spinning: after an answer that is an error, the next
// ring is served no sooner than a back-off after the refused request was taken, on the injected
// clock (kFirstBackoffNs, doubling on each further error up to kMaxBackoffNs, reset by a
// success). With the daemon's bound on doorbells per uid
// (limits.doorbells_per_uid), this bounds the CPU one uid's doorbells can take.
//
// A doorbell ends with its session: Stop() cancels the call in flight (CallContext) and wakes the
// thread without waiting for it; the destructor joins it. Nothing a client writes into the page
// can keep the thread from stopping (the stop flag is in the daemon's memory) or make it read
// out of bounds (num_items is read once and bounded; the memfd cannot be shrunk).
//
// Doorbells: the daemon's set of them, by session. A stopped doorbell is joined once its thread
// has exited (Reap), so ending a session never waits for a model step on the attach loop.
//
// Thread-safe.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/engine/call_context.h"
#include "daemon/engine/compute_call.h"
#include "daemon/engine/session.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/doorbell.h"

namespace kvpool::daemon {

struct LockOrderPeer;

class DecodeDoorbell final {
 public:
  // Queues a call (Engine::Submit); it must complete exactly once.
  using SubmitFn = std::function<void(std::unique_ptr<ComputeCall>)>;
  // What the daemon does with each answer (may be empty). (Event watchers need no hook: the
  // engine tells its EventListeners of the events a step made.)
  struct Hooks {
    // Before the client can see it: the daemon counts it, so a client that has its answer finds
    // it counted in GetStats, as after a Decode RPC.
    std::function<void()> counted;
  };

  static constexpr int64_t kFirstBackoffNs = 50'000;    // after one error
  static constexpr int64_t kMaxBackoffNs = 10'000'000;  // after many in a row
  // After an answer this thread wrote itself (the step ran here, for this call alone), it polls
  // the ring this many
  // times (a PAUSE each: about 40 us on this machine's Zen cores, ~2x that on Intel's) before it
  // sleeps on the futex: a client decoding in a loop rings again within that, and is then served
  // without a thread wake-up, which on a small VM costs tens of microseconds.
  static constexpr int kRingPolls = 2048;

  // Creates the page and starts serving `session`. `client_fd` receives a descriptor of the page
  // for the client. `clock` (not owned, outlives the doorbell) times deadlines and back-offs.
  // Errors: INTERNAL (memfd, seals, mmap).
  static absl::StatusOr<std::unique_ptr<DecodeDoorbell>> Start(
      std::shared_ptr<const Session> session, SubmitFn submit, Hooks hooks, UniqueFd* client_fd,
      const Clock* clock);
  ~DecodeDoorbell();  // Stop(), then joins the thread

  DecodeDoorbell(const DecodeDoorbell&) = delete;
  DecodeDoorbell& operator=(const DecodeDoorbell&) = delete;

  // Cancels the call in flight and tells the thread to exit; does not wait. Idempotent.
  void Stop();
  // The thread has exited (joining it will not wait).
  bool exited() const { return exited_.load(std::memory_order_acquire); }
  // Requests served so far (answered, whatever the outcome).
  uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }
  uid_t uid() const { return session_->spec.uid; }

 private:
  friend struct LockOrderPeer;  // tests/daemon/lock_order_test.cc takes the locks in order
  DecodeDoorbell(std::shared_ptr<const Session> session, SubmitFn submit, Hooks hooks, UniqueFd fd,
                 wire::DoorbellPage* page, const Clock* clock);

  void Loop();
  // Serves the request rung as `ring`; returns once it is answered, with whether it succeeded.
  // `answered_here`: whether its step ran on this thread and served this call alone.
  bool Serve(uint32_t ring, bool* answered_here);
  // Polls the ring (kRingPolls times at most) until it moves past `served` or Stop().
  void PollRing(uint32_t served) const;
  void Answer(uint32_t ring, const absl::Status& status, const ComputeResult* result);
  // Waits out the back-off after an error (returns early when stopped).
  void BackOff(int64_t until_ns);

  const std::shared_ptr<const Session> session_;
  const SubmitFn submit_;
  const Hooks hooks_;
  const UniqueFd fd_;
  wire::DoorbellPage* const page_;  // mapped kDoorbellBytes, read-write
  const Clock* const clock_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // stop_, for waits under mu_
  // The call in flight's context: Stop() cancels it.
  std::shared_ptr<ManualCallContext> current_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> exited_{false};
  std::atomic<uint64_t> calls_{0};
  std::thread thread_;
};

class Doorbells final {
 public:
  ~Doorbells();  // StopAll()

  // Adds `doorbell` for `session`, first joining the stopped ones whose threads have exited.
  void Add(SessionId session, std::unique_ptr<DecodeDoorbell> doorbell);
  // Stops the doorbell of `session`, if any, without waiting for it.
  void Remove(SessionId session);
  // Stops every doorbell and joins them all.
  void StopAll();
  // Doorbells not yet joined (live or stopping).
  size_t size() const;
  // Live doorbells of sessions of `uid`.
  int32_t live_for_uid(uid_t uid) const;

 private:
  friend struct LockOrderPeer;  // tests/daemon/lock_order_test.cc takes the locks in order
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionId, std::unique_ptr<DecodeDoorbell>> live_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<DecodeDoorbell>> stopped_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::daemon
