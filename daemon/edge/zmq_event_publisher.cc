// ZmqEventPublisher (zmq_event_publisher.h).

#include "daemon/edge/zmq_event_publisher.h"

#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/edge/vllm_events.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {
namespace {

spdlog::logger& Log() { return Logger("events"); }

constexpr size_t kReadBatch = 256;        // events read from the log at a time
constexpr int kReplaysPerWake = 8;        // replay requests answered before new events go out
constexpr int64_t kMaxRequestBytes = 64;  // a replay frame longer than this disconnects its peer
constexpr size_t kMaxRequestFrames = 3;   // identity, empty delimiter, start seq
// The shortest time between two wake-ups that publish: what an event may wait for company.
constexpr absl::Duration kCoalesce = absl::Milliseconds(1);

// A batch's payload, shared by the replay buffer and every send of it that ZeroMQ still holds
// (shared_ptr: whichever lets go last, the publisher's thread or a ZeroMQ I/O thread, frees it).
using Payload = std::shared_ptr<const std::string>;

// One send of a payload, alive while ZeroMQ holds it (however many of a PUB's pipes share it).
struct SendRef {
  Payload payload;
  std::atomic<int64_t>* queued;  // the publisher's queued_bytes, which outlives ZeroMQ's context
};

// Sends a reference to `payload` on `socket`, counted in `*queued` until ZeroMQ lets go of it.
// Returns whether ZeroMQ took it.
bool SendShared(void* socket, const Payload& payload, int flags, std::atomic<int64_t>* queued) {
  auto* ref = new SendRef{payload, queued};
  const auto size = static_cast<int64_t>(payload->size());
  queued->fetch_add(size, std::memory_order_relaxed);
  zmq_msg_t msg;
  KVPOOL_CHECK(zmq_msg_init_data(
                   &msg, const_cast<char*>(payload->data()), payload->size(),
                   [](void*, void* hint) {
                     auto* r = static_cast<SendRef*>(hint);
                     r->queued->fetch_sub(static_cast<int64_t>(r->payload->size()),
                                          std::memory_order_relaxed);
                     delete r;
                   },
                   ref) == 0);
  if (zmq_msg_send(&msg, socket, flags) >= 0) return true;
  zmq_msg_close(&msg);  // lets go of the reference
  return false;
}

std::string SeqBytes(uint64_t seq) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(seq >> (56 - 8 * i));
  return out;
}

uint64_t SeqOf(const std::string& bytes) {
  uint64_t seq = 0;
  for (char c : bytes) seq = (seq << 8) | static_cast<uint8_t>(c);
  return seq;
}

absl::Status ZmqError(std::string_view what, std::string_view endpoint) {
  return absl::InvalidArgumentError(
      fmt::format("{} {}: {}", what, endpoint, zmq_strerror(zmq_errno())));
}

std::string LastEndpoint(void* socket) {
  char buffer[1024];
  size_t size = sizeof(buffer);
  if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, buffer, &size) != 0 || size == 0) return {};
  return std::string(buffer, size - 1);  // without its NUL
}

}  // namespace

struct ZmqEventPublisher::Sockets {
  void* context = zmq_ctx_new();
  void* pub = nullptr;
  void* replay = nullptr;
  struct Kept {
    uint64_t seq;
    Payload payload;
  };
  std::deque<Kept> kept;  // the replay buffer, oldest first
  size_t kept_bytes = 0;

  ~Sockets() {
    kept.clear();
    if (pub != nullptr) zmq_close(pub);
    if (replay != nullptr) zmq_close(replay);
    zmq_ctx_term(context);  // linger 0: returns at once
  }
  void* Open(int type) {
    void* s = zmq_socket(context, type);
    const int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    return s;
  }
};

absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> ZmqEventPublisher::Start(
    const ZmqEventOptions& options, const Engine* engine, const Clock* clock) {
  if (options.queued_bytes <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("queued_bytes must be > 0 (got {})", options.queued_bytes));
  }
  auto sockets = std::make_unique<Sockets>();
  sockets->pub = sockets->Open(ZMQ_PUB);
  zmq_setsockopt(sockets->pub, ZMQ_SNDHWM, &options.send_hwm, sizeof(options.send_hwm));
  if (zmq_bind(sockets->pub, options.endpoint.c_str()) != 0) {
    return ZmqError("cannot bind the event endpoint", options.endpoint);
  }
  if (!options.replay_endpoint.empty()) {
    sockets->replay = sockets->Open(ZMQ_ROUTER);
    const int64_t max_bytes = kMaxRequestBytes;
    zmq_setsockopt(sockets->replay, ZMQ_MAXMSGSIZE, &max_bytes, sizeof(max_bytes));
    // A full replay fits a peer's queue; a peer that does not read loses what is past it
    // (ROUTER_MANDATORY: the send fails at once instead of being queued or blocking).
    const int hwm = static_cast<int>(options.replay_batches) + 1;
    zmq_setsockopt(sockets->replay, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    const int mandatory = 1;
    zmq_setsockopt(sockets->replay, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory));
    if (zmq_bind(sockets->replay, options.replay_endpoint.c_str()) != 0) {
      return ZmqError("cannot bind the replay endpoint", options.replay_endpoint);
    }
  }
  UniqueFd wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake.valid()) return absl::InternalError(fmt::format("eventfd: errno {}", errno));
  return std::unique_ptr<ZmqEventPublisher>(
      new ZmqEventPublisher(options, engine, clock, std::move(sockets), std::move(wake)));
}

ZmqEventPublisher::ZmqEventPublisher(const ZmqEventOptions& options, const Engine* engine,
                                     const Clock* clock, std::unique_ptr<Sockets> sockets,
                                     UniqueFd wake)
    : options_(options),
      engine_(engine),
      clock_(clock),
      sockets_(std::move(sockets)),
      wake_(std::move(wake)),
      bound_endpoint_(LastEndpoint(sockets_->pub)),
      bound_replay_endpoint_(sockets_->replay ? LastEndpoint(sockets_->replay) : ""),
      counters_(options.counters != nullptr ? options.counters : &own_counters_) {
  // next_ = 1: from the daemon's first event; those the log no longer holds (a publisher added
  // late) become one resync batch.
  thread_ = std::thread([this] { Run(); });
  Log().info("publishing pool {}'s cache events on {} (replay: {})", options_.pool, bound_endpoint_,
             bound_replay_endpoint_.empty() ? "none" : bound_replay_endpoint_);
}

ZmqEventPublisher::~ZmqEventPublisher() {
  stopping_.store(true);
  {
    absl::MutexLock lock(&stop_mu_);
    stop_requested_ = true;  // ends a pacing wait
  }
  wake_pending_.store(false);
  OnEvents(options_.pool, 0);
  thread_.join();
  // Before the counters go (own_counters_ is destroyed first): ZeroMQ's I/O threads count the
  // sends they let go of until the context is terminated.
  sockets_.reset();
}

void ZmqEventPublisher::OnEvents(int32_t pool, uint64_t) {
  if (pool != options_.pool) return;
  // One write per wake-up: the appending thread skips the syscall while one is pending.
  if (wake_pending_.exchange(true)) return;
  const uint64_t one = 1;
  // Never blocks: a full counter (2^64 - 2 wake-ups pending) is as good as one.
  [[maybe_unused]] ssize_t n = write(wake_.get(), &one, sizeof(one));
}

void ZmqEventPublisher::Run() {
  PublishNew();  // what the log holds already (a resync first when some of it is gone)
  while (true) {
    zmq_pollitem_t items[2] = {{nullptr, wake_.get(), ZMQ_POLLIN, 0},
                               {sockets_->replay, 0, ZMQ_POLLIN, 0}};
    const int n = sockets_->replay != nullptr ? 2 : 1;
    if (zmq_poll(items, n, -1) < 0 && zmq_errno() != EINTR) {
      Log().error("event publisher: poll: {}", zmq_strerror(zmq_errno()));
    }
    if ((items[0].revents & ZMQ_POLLIN) != 0) {
      // Events come in bursts (a step, a batch of calls): one wake-up per kCoalesce at most
      // sends them together, where one per event would cost each call a thread switch.
      if (last_publish_ns_ != INT64_MIN) {
        absl::MutexLock lock(&stop_mu_);
        clock_->AwaitUntil(stop_mu_, absl::Condition(&stop_requested_),
                           last_publish_ns_ + absl::ToInt64Nanoseconds(kCoalesce));
      }
      uint64_t count = 0;
      [[maybe_unused]] ssize_t r = read(wake_.get(), &count, sizeof(count));
      // After the read (a write it consumed was for events appended before this point) and
      // before the log is read (an append after this point writes again).
      wake_pending_.store(false);
      last_publish_ns_ = clock_->NowNanos();
    }
    PublishNew();
    if (stopping_.load()) return;
    if (n == 2 && (items[1].revents & ZMQ_POLLIN) != 0) ServeReplays();
  }
}

void ZmqEventPublisher::PublishNew() {
  std::vector<KvEvent> events;
  while (true) {
    events.clear();
    // vLLM's `ts` is Unix time: the wall clock's, not the pacing clock's (which has no epoch).
    const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
    if (!engine_->ReadEvents(options_.pool, next_, kReadBatch, &events)) {
      // Lost behind the log: one batch restates the pool, numbered as the last event it covers.
      uint64_t resume = 0;
      const std::vector<KvEvent> snapshot = engine_->SnapshotEvents(options_.pool, &resume);
      Log().warn("event publisher fell behind the event log: events {} to {} replaced by a resync",
                 next_, resume - 1);
      Send(resume - 1, EncodeVllmBatch(snapshot, now, options_.data_parallel_rank,
                                       /*clear_first=*/true));
      counters_->resyncs.fetch_add(1, std::memory_order_relaxed);
      next_ = resume;
      continue;
    }
    if (events.empty()) return;
    for (const KvEvent& e : events) {
      Send(e.seq, EncodeVllmBatch(std::span(&e, 1), now, options_.data_parallel_rank));
    }
    next_ = events.back().seq + 1;
  }
}

bool ZmqEventPublisher::HasRoomFor(const std::atomic<int64_t>& queued_bytes, size_t bytes) const {
  // Only this thread adds to the count (ZeroMQ's threads subtract), so what it reads is at least
  // what is queued when it sends.
  const int64_t queued = queued_bytes.load(std::memory_order_relaxed);
  return queued == 0 || queued + static_cast<int64_t>(bytes) <= options_.queued_bytes;
}

void ZmqEventPublisher::Send(uint64_t seq, std::string bytes) {
  const auto payload = std::make_shared<const std::string>(std::move(bytes));
  if (!HasRoomFor(counters_->queued_bytes, payload->size())) {
    // A subscriber gone is let go of only once the PUB socket has handled its commands, which it
    // does when called (ZMQ_EVENTS) from this thread; ZeroMQ's I/O thread then frees its queue.
    // Without this call nothing would be sent, and that queue would be held for good.
    int events = 0;
    size_t size = sizeof(events);
    zmq_getsockopt(sockets_->pub, ZMQ_EVENTS, &events, &size);
  }
  if (!HasRoomFor(counters_->queued_bytes, payload->size())) {
    // As a subscriber past its high-water mark: a gap in seq, filled by a replay.
    counters_->dropped.fetch_add(1, std::memory_order_relaxed);
  } else {
    const std::string seq_bytes = SeqBytes(seq);
    // PUB never blocks: a subscriber past its high-water mark loses the message (and replays).
    zmq_send(sockets_->pub, options_.topic.data(), options_.topic.size(), ZMQ_SNDMORE);
    zmq_send(sockets_->pub, seq_bytes.data(), seq_bytes.size(), ZMQ_SNDMORE);
    if (SendShared(sockets_->pub, payload, 0, &counters_->queued_bytes)) {
      counters_->batches.fetch_add(1, std::memory_order_relaxed);
    } else {
      counters_->send_errors.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (sockets_->replay == nullptr) return;
  sockets_->kept_bytes += payload->size();
  sockets_->kept.push_back({seq, payload});
  while (sockets_->kept.size() > options_.replay_batches ||
         (sockets_->kept_bytes > options_.replay_bytes && sockets_->kept.size() > 1)) {
    sockets_->kept_bytes -= sockets_->kept.front().payload->size();
    sockets_->kept.pop_front();
  }
}

void ZmqEventPublisher::ServeReplays() {
  for (int i = 0; i < kReplaysPerWake; ++i) {
    int events = 0;
    size_t size = sizeof(events);
    if (zmq_getsockopt(sockets_->replay, ZMQ_EVENTS, &events, &size) != 0) return;
    if ((events & ZMQ_POLLIN) == 0) return;
    ServeReplay();
  }
}

void ZmqEventPublisher::ServeReplay() {
  // One request: all its frames are read (the first kMaxRequestFrames kept), whatever it holds.
  std::vector<std::string> frames;
  bool more = true;
  while (more) {
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, sockets_->replay, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&part);
      break;
    }
    if (frames.size() <= kMaxRequestFrames) {
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&part)), zmq_msg_size(&part));
    }
    more = zmq_msg_more(&part) != 0;
    zmq_msg_close(&part);
  }
  if (frames.size() != kMaxRequestFrames || !frames[1].empty() || frames[2].size() != 8) {
    counters_->replays_refused.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const std::string& peer = frames[0];
  const uint64_t from = SeqOf(frames[2]);
  const auto send_header = [&](const std::string& seq) {
    return zmq_send(sockets_->replay, peer.data(), peer.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
           zmq_send(sockets_->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
           zmq_send(sockets_->replay, seq.data(), seq.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0;
  };
  for (Sockets::Kept& k : sockets_->kept) {
    if (k.seq < from) continue;
    // A peer gone or not reading: ROUTER_MANDATORY fails the send at once; give up on it. So
    // does a payload past queued_bytes.
    if (!HasRoomFor(counters_->replay_queued_bytes, k.payload->size()) ||
        !send_header(SeqBytes(k.seq)) ||
        !SendShared(sockets_->replay, k.payload, ZMQ_DONTWAIT, &counters_->replay_queued_bytes)) {
      counters_->replays_abandoned.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  // Counted before the end marker goes out: a peer that has read the whole answer sees it
  // counted (counting after the send raced with a reader of the counters).
  counters_->replays.fetch_add(1, std::memory_order_relaxed);
  const std::string end(8, '\xff');  // -1, vLLM's end marker
  if (send_header(end)) zmq_send(sockets_->replay, "", 0, ZMQ_DONTWAIT);
}

}  // namespace kvpool::daemon
