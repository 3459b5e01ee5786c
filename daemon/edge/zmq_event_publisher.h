#pragma once

// ZmqEventPublisher: one pool's cache events on ZeroMQ in vLLM's KV-event protocol, for routers
// written against vLLM (llm-d's KV-cache manager, Dynamo, AIBrix); docs/events.md has the wire
// format and the guarantees.
//
// - A PUB socket bound at `endpoint` sends each kvpool event as one batch, the multipart message
//   [topic, seq as 8 bytes big-endian, payload] (vllm_events.h). The batch's seq is the event's
//   own sequence number, the one WatchEvents reports, so both streams number the same events the
//   same way and neither has gaps. PUB drops a message for a subscriber whose queue is full (its
//   high-water mark); the consumer sees the gap in seq and asks the replay socket.
// - What ZeroMQ holds for subscribers is bounded in bytes, not only in messages: a payload handed
//   to the PUB socket counts in counters().queued_bytes until ZeroMQ lets go of it (written out
//   to every subscriber, or dropped). A batch that would take that past `queued_bytes` is
//   published to no one (counted in counters().dropped) and still kept for replay: a consumer
//   sees the gap and replays it, as after a high-water-mark drop. Replay answers count apart
//   (counters().replay_queued_bytes) under the same bound; an answer that would pass it stops
//   there (counted abandoned). A batch larger than the bound alone goes out when nothing else is
//   queued. So subscribers that stop reading hold at most `queued_bytes` of payload, however
//   large the events; but while they hold it, no subscriber receives new batches.
// - A ROUTER socket bound at `replay_endpoint` (optional) answers a request [seq as 8 bytes
//   big-endian] (a REQ or DEALER peer) with every batch still kept whose seq is >= it, each as
//   [seq, payload], then the end marker [-1 as 8 bytes, empty]. Malformed requests are dropped
//   (counted) and answer nothing; a frame over 64 bytes disconnects its peer. Replies never block
//   the publisher: a peer that does not read loses them.
// - When the publisher fell behind the engine's event log (its bound, EngineOptions::
//   event_capacity), the lost events are replaced by one resync batch: AllBlocksCleared, then the
//   pool's snapshot as BlockStored events, numbered with the seq of the last event it covers.
//
// It is an EventListener: the engine wakes it (never blocking) and its own thread reads the log
// and sends. Thread-safe. Lock order: Engine::listeners_mu_ (reader) -> nothing (OnEvents writes
// an eventfd); its thread takes Engine::mu_ as reader only, holding nothing.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/event_listener.h"
#include "daemon/metrics/edge_counters.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::daemon {

struct ZmqEventOptions {
  std::string endpoint;         // PUB, bound (tcp://127.0.0.1:5557, ipc://path, tcp://*:5557)
  std::string replay_endpoint;  // ROUTER, bound; empty: no replay socket
  std::string topic;            // the first frame of every published message
  int32_t pool = 0;             // whose events
  int64_t data_parallel_rank = 0;
  size_t replay_batches = 10000;           // batches kept for replay (vLLM's buffer_steps)
  size_t replay_bytes = size_t{64} << 20;  // their payloads' bytes, at most
  int32_t send_hwm = 100000;               // PUB messages queued per subscriber
  // Payload bytes ZeroMQ may hold for all subscribers and replay peers together (the sends not
  // yet written out or dropped by ZeroMQ; the replay buffer's own are replay_bytes); > 0.
  int64_t queued_bytes = int64_t{256} << 20;
  // Where the publisher counts (the daemon's, for its stats tables); null: its own.
  ZmqEventCounters* counters = nullptr;
};

class ZmqEventPublisher final : public EventListener {
 public:
  // Binds the sockets and starts the thread; publishes from the pool's first event (a resync
  // for those the log no longer holds). The caller adds it to `engine` (AddEventListener) and
  // removes it before it goes. `clock` (not owned; outlives the publisher) paces the sends (one
  // wake-up per kCoalesce at most). Errors: INVALID_ARGUMENT (an endpoint ZeroMQ cannot bind:
  // syntax, address in use, ...; a queued_bytes <= 0).
  static absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> Start(const ZmqEventOptions& options,
                                                                  const Engine* engine,
                                                                  const Clock* clock);
  ~ZmqEventPublisher() override;  // publishes what is in the log, then stops

  void OnEvents(int32_t pool, uint64_t next_seq) override;

  // The endpoints as bound (a wildcard port resolved).
  const std::string& endpoint() const { return bound_endpoint_; }
  const std::string& replay_endpoint() const { return bound_replay_endpoint_; }
  const ZmqEventCounters& counters() const { return *counters_; }

 private:
  struct Sockets;
  ZmqEventPublisher(const ZmqEventOptions& options, const Engine* engine, const Clock* clock,
                    std::unique_ptr<Sockets> sockets, UniqueFd wake);
  void Run();
  // Sends every event of the log from next_ on (a resync first when some were lost).
  void PublishNew();
  // Whether ZeroMQ may be handed `bytes` more of payload on the socket whose sends `queued_bytes`
  // counts (options_.queued_bytes).
  bool HasRoomFor(const std::atomic<int64_t>& queued_bytes, size_t bytes) const;
  // Publishes the batch (unless over queued_bytes) and keeps it for replay.
  void Send(uint64_t seq, std::string bytes);
  // Answers at most a few waiting replay requests.
  void ServeReplays();
  void ServeReplay();

  const ZmqEventOptions options_;
  const Engine* const engine_;
  const Clock* const clock_;
  std::unique_ptr<Sockets> sockets_;  // used by the thread alone
  UniqueFd wake_;                     // eventfd: OnEvents and the destructor write it
  std::string bound_endpoint_;
  std::string bound_replay_endpoint_;
  std::atomic<bool> stopping_{false};
  absl::Mutex stop_mu_;  // a leaf: only for the pacing wait to see stopping_
  bool stop_requested_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::atomic<bool> wake_pending_{false};  // an eventfd write not yet read
  uint64_t next_ = 1;                      // the thread's: the next seq to publish
  int64_t last_publish_ns_ = INT64_MIN;    // the thread's, on clock_
  ZmqEventCounters own_counters_;
  ZmqEventCounters* const counters_;  // options_.counters, or own_counters_
  std::thread thread_;
};

}  // namespace kvpool::daemon
