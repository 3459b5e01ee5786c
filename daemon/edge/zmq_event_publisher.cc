// ZmqEventPublisher (zmq_event_publisher.h).

#include "daemon/edge/zmq_event_publisher.h"

#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
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

// A message whose payload is shared, not copied, by every send of it (ZeroMQ counts references).
class SharedMessage final {
 public:
  explicit SharedMessage(std::string payload) : size_(payload.size()) {
    auto* owned = new std::string(std::move(payload));
    KVPOOL_CHECK(zmq_msg_init_data(
                     &msg_, owned->data(), owned->size(),
                     [](void*, void* hint) { delete static_cast<std::string*>(hint); },
                     owned) == 0);
  }
  ~SharedMessage() { zmq_msg_close(&msg_); }
  SharedMessage(const SharedMessage&) = delete;
  SharedMessage& operator=(const SharedMessage&) = delete;

  size_t size() const { return size_; }
  // Sends a reference to the payload. Returns whether ZeroMQ took it.
  bool SendOn(void* socket, int flags) {
    zmq_msg_t copy;
    zmq_msg_init(&copy);
    KVPOOL_CHECK(zmq_msg_copy(&copy, &msg_) == 0);
    if (zmq_msg_send(&copy, socket, flags) >= 0) return true;
    zmq_msg_close(&copy);
    return false;
  }

 private:
  zmq_msg_t msg_;
  const size_t size_;
};

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
    std::unique_ptr<SharedMessage> payload;
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

void ZmqEventPublisher::Send(uint64_t seq, std::string payload) {
  auto message = std::make_unique<SharedMessage>(std::move(payload));
  const std::string seq_bytes = SeqBytes(seq);
  // PUB never blocks: a subscriber past its high-water mark loses the message (and replays).
  zmq_send(sockets_->pub, options_.topic.data(), options_.topic.size(), ZMQ_SNDMORE);
  zmq_send(sockets_->pub, seq_bytes.data(), seq_bytes.size(), ZMQ_SNDMORE);
  if (message->SendOn(sockets_->pub, 0)) {
    counters_->batches.fetch_add(1, std::memory_order_relaxed);
  } else {
    counters_->send_errors.fetch_add(1, std::memory_order_relaxed);
  }
  if (sockets_->replay == nullptr) return;
  sockets_->kept_bytes += message->size();
  sockets_->kept.push_back({seq, std::move(message)});
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
    // A peer gone or not reading: ROUTER_MANDATORY fails the send at once; give up on it.
    if (!send_header(SeqBytes(k.seq)) || !k.payload->SendOn(sockets_->replay, ZMQ_DONTWAIT)) {
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
