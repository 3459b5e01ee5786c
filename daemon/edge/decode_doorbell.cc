#include "daemon/edge/decode_doorbell.h"

#include <fcntl.h>
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "daemon/edge/convert.h"
#include "fmt/format.h"

namespace kvpool::daemon {
namespace {

absl::Status Errno(std::string_view what) {
  return absl::InternalError(fmt::format("decode doorbell: {}: {}", what, std::strerror(errno)));
}

// Waits for one call's completion (shared with the call's callback, which may still be returning
// when the waiter moves on).
struct Completion {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  bool ok ABSL_GUARDED_BY(mu) = false;     // answered with a success
  bool alone ABSL_GUARDED_BY(mu) = false;  // its step served this call's sequences only
};

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeDoorbell>> DecodeDoorbell::Start(
    std::shared_ptr<const Session> session, SubmitFn submit, Hooks hooks, UniqueFd* client_fd,
    const Clock* clock) {
  UniqueFd fd(memfd_create("kvpool-doorbell", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return Errno("memfd_create");
  if (ftruncate(fd.get(), static_cast<off_t>(wire::kDoorbellBytes)) != 0) return Errno("ftruncate");
  // The client maps it read-write too, but can never resize it: the daemon's reads stay in
  // bounds (no SIGBUS from a shrunk file).
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Errno("seal");
  }
  void* page = mmap(nullptr, wire::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (page == MAP_FAILED) return Errno("mmap");
  UniqueFd dup(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!dup.valid()) {
    const absl::Status s = Errno("dup");
    munmap(page, wire::kDoorbellBytes);
    return s;
  }
  *client_fd = std::move(dup);
  // A fresh memfd reads as zeros: ring and answered start at 0, as the client expects.
  return std::unique_ptr<DecodeDoorbell>(
      new DecodeDoorbell(std::move(session), std::move(submit), std::move(hooks), std::move(fd),
                         static_cast<wire::DoorbellPage*>(page), clock));
}

DecodeDoorbell::DecodeDoorbell(std::shared_ptr<const Session> session, SubmitFn submit, Hooks hooks,
                               UniqueFd fd, wire::DoorbellPage* page, const Clock* clock)
    : session_(std::move(session)),
      submit_(std::move(submit)),
      hooks_(std::move(hooks)),
      fd_(std::move(fd)),
      page_(page),
      clock_(clock),
      thread_([this] { Loop(); }) {}

DecodeDoorbell::~DecodeDoorbell() {
  Stop();
  thread_.join();
  munmap(page_, wire::kDoorbellBytes);
}

void DecodeDoorbell::Stop() {
  if (stop_.exchange(true, std::memory_order_acq_rel)) return;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;  // ends a back-off
    if (current_ != nullptr) current_->Cancel();
  }
  // Change the ring word under the thread's futex wait, so that it wakes whatever the client
  // wrote; it then reads stop_, which no client can touch.
  page_->ring.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&page_->ring);
}

void DecodeDoorbell::Loop() {
  uint32_t served = 0;
  int64_t backoff_ns = 0;
  int64_t not_before_ns = 0;
  bool poll = false;  // the last call was answered on this thread: look for the next ring first
  for (;;) {
    const uint32_t ring = page_->ring.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) break;
    if (ring == served) {
      if (poll) {
        poll = false;
        PollRing(served);
      } else {
        wire::FutexWait(&page_->ring, ring);
      }
      continue;
    }
    if (backoff_ns > 0) BackOff(not_before_ns);
    if (stop_.load(std::memory_order_acquire)) break;
    served = page_->ring.load(std::memory_order_acquire);  // the latest request
    // Read before the answer is written: whoever sees the answer sees the back-off's start.
    const int64_t taken_ns = clock_->NowNanos();
    if (Serve(served, &poll)) {
      backoff_ns = 0;
    } else {
      poll = false;
      backoff_ns = std::clamp(2 * backoff_ns, kFirstBackoffNs, kMaxBackoffNs);
      not_before_ns = taken_ns + backoff_ns;
    }
  }
  exited_.store(true, std::memory_order_release);
}

void DecodeDoorbell::PollRing(uint32_t served) const {
  for (int i = 0; i < kRingPolls; ++i) {
    if (page_->ring.load(std::memory_order_acquire) != served) return;
    if (stop_.load(std::memory_order_relaxed)) return;
    _mm_pause();
  }
}

void DecodeDoorbell::BackOff(int64_t until_ns) {
  absl::MutexLock lock(&mu_);
  clock_->AwaitUntil(mu_, absl::Condition(&stopping_), until_ns);
}

bool DecodeDoorbell::Serve(uint32_t ring, bool* answered_here) {
  *answered_here = false;
  // Read once: the client may change the page at any moment.
  const uint32_t n = __atomic_load_n(&page_->num_items, __ATOMIC_RELAXED);
  const int64_t timeout_ns = __atomic_load_n(&page_->timeout_ns, __ATOMIC_RELAXED);
  if (n > wire::kDoorbellMaxItems) {
    Answer(ring,
           absl::InvalidArgumentError(
               fmt::format("decode doorbell: {} items; at most {}", n, wire::kDoorbellMaxItems)),
           nullptr);
    return false;
  }
  wire::DoorbellItem items[wire::kDoorbellMaxItems];
  std::memcpy(items, page_->items, n * sizeof(wire::DoorbellItem));
  ComputeRequest request{.kind = ComputeRequest::Kind::kDecode};
  request.decode.reserve(n);
  for (uint32_t i = 0; i < n; ++i)
    request.decode.push_back({SequenceId(items[i].sequence_id), items[i].token});

  // A year stands for "no deadline" and keeps the sum from overflowing.
  constexpr int64_t kLongest = int64_t{365} * 24 * 3600 * 1'000'000'000;
  auto context = std::make_shared<ManualCallContext>(
      clock_, clock_->NowNanos() + std::clamp<int64_t>(timeout_ns, 0, kLongest));
  {
    absl::MutexLock lock(&mu_);
    if (stop_.load(std::memory_order_acquire)) context->Cancel();
    current_ = context;
  }
  auto completion = std::make_shared<Completion>();
  submit_(std::make_unique<ComputeCall>(session_, std::move(request), std::move(context),
                                        [this, ring, n, completion](ComputeCall& call) {
                                          const ComputeResult& result = call.result();
                                          Answer(ring, result.status, &result);
                                          absl::MutexLock lock(&completion->mu);
                                          completion->ok = result.status.ok();
                                          completion->alone =
                                              result.step_sequences == static_cast<int32_t>(n);
                                          completion->done = true;
                                        }));
  absl::MutexLock lock(&completion->mu);
  // Done already: the step ran on this thread (Engine::SubmitOrRun found the model idle). Only a
  // client decoding on its own is worth polling for: with others in the step, the next one
  // gathers them anyway, and the polls of several doorbells would take the cores from the model.
  *answered_here = completion->done && completion->alone;
  completion->mu.Await(absl::Condition(&completion->done));
  return completion->ok;
}

void DecodeDoorbell::Answer(uint32_t ring, const absl::Status& status,
                            const ComputeResult* result) {
  wire::DoorbellPage& p = *page_;
  p.code = static_cast<int32_t>(status.code());
  if (!status.ok()) {
    const size_t bytes = std::min<size_t>(status.message().size(), wire::kDoorbellMessageBytes);
    std::memcpy(p.message, status.message().data(), bytes);
    p.message_bytes = static_cast<uint32_t>(bytes);
    const std::string shortfall = ShortfallValue(status).value_or("");
    const size_t short_bytes = std::min<size_t>(shortfall.size(), wire::kDoorbellShortfallBytes);
    std::memcpy(p.shortfall, shortfall.data(), short_bytes);
    p.shortfall_bytes = static_cast<uint32_t>(short_bytes);
    p.step_sequences = 0;
  } else {
    p.message_bytes = 0;
    p.step_sequences = result->step_sequences;
    const size_t n = std::min<size_t>(result->results.size(), wire::kDoorbellMaxItems);
    for (size_t i = 0; i < n; ++i) {
      p.results[i] = {.num_tokens = result->lengths[i],
                      .next_token = result->results[i].next_token,
                      .reserved = 0};
    }
  }
  calls_.fetch_add(1, std::memory_order_relaxed);
  if (hooks_.counted) hooks_.counted();
  p.answered.store(ring, std::memory_order_release);
  wire::FutexWakeAll(&p.answered);
}

Doorbells::~Doorbells() { StopAll(); }

void Doorbells::Add(SessionId session, std::unique_ptr<DecodeDoorbell> doorbell) {
  absl::MutexLock lock(&mu_);
  Reap();
  live_[session] = std::move(doorbell);
}

void Doorbells::Remove(SessionId session) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(session);
  if (it == live_.end()) return;
  it->second->Stop();
  stopped_.push_back(std::move(it->second));
  live_.erase(it);
  Reap();
}

void Doorbells::StopAll() {
  std::vector<std::unique_ptr<DecodeDoorbell>> all;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, d] : live_) stopped_.push_back(std::move(d));
    live_.clear();
    all.swap(stopped_);
    for (auto& d : all) d->Stop();
  }
  all.clear();  // joins, outside the lock
}

size_t Doorbells::size() const {
  absl::MutexLock lock(&mu_);
  return live_.size() + stopped_.size();
}

int32_t Doorbells::live_for_uid(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  int32_t n = 0;
  for (const auto& [session, d] : live_) n += d->uid() == uid ? 1 : 0;
  return n;
}

void Doorbells::Reap() {
  auto done = std::partition(stopped_.begin(), stopped_.end(),
                             [](const std::unique_ptr<DecodeDoorbell>& d) { return !d->exited(); });
  stopped_.erase(done, stopped_.end());  // joins threads that have already exited
}

}  // namespace kvpool::daemon
