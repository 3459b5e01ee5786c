#pragma once

// Counters the edges keep and the stats tables (stats_table.h) read: the attach socket's
// (daemon/edge/attach_server.h) and the vLLM KV-event publisher's
// (daemon/edge/zmq_event_publisher.h). Declared here so that daemon/metrics depends on no edge:
// the edges write these, the metrics read them. Written by their edge's thread (the publisher's
// queued bytes also by ZeroMQ's I/O threads), read by anyone.

#include <atomic>
#include <cstdint>

namespace kvpool::daemon {

// What the attach loop has turned away, for stats (written by the loop, read by anyone).
struct AttachCounters {
  std::atomic<uint64_t> refused_at_accept{0};  // peers not allowed to attach, refused unread
  std::atomic<uint64_t> displaced{0};          // handshakes closed for a newer one over a cap
  std::atomic<uint64_t> timed_out{0};          // handshakes not complete in handshake_timeout
  std::atomic<uint64_t> malformed{0};          // oversized, unparsable or fd-carrying requests
  std::atomic<uint64_t> accept_backoffs{0};    // times accept ran out of descriptors
  std::atomic<uint64_t> doorbell_calls{0};     // decode calls answered through doorbells
  std::atomic<uint64_t> doorbells_refused{0};  // doorbells not granted: the uid has its share
};

// What a ZeroMQ event publisher counts. A message PUB drops for a subscriber past its high-water
// mark is not among them: ZeroMQ drops it silently (the subscriber sees the gap and asks for a
// replay).
struct ZmqEventCounters {
  std::atomic<uint64_t> batches{0};             // published
  std::atomic<uint64_t> dropped{0};             // not published: queued_bytes was at its bound
  std::atomic<int64_t> queued_bytes{0};         // payload bytes the PUB socket holds now (a gauge)
  std::atomic<int64_t> replay_queued_bytes{0};  // and the replay socket's answers (a gauge)
  std::atomic<uint64_t> resyncs{0};             // resync batches (events lost behind the log)
  std::atomic<uint64_t> send_errors{0};         // batches the PUB socket refused (not queued)
  std::atomic<uint64_t> replays{0};             // replay requests answered in full
  std::atomic<uint64_t> replays_refused{0};     // malformed replay requests dropped
  std::atomic<uint64_t> replays_abandoned{0};   // answers cut short: the peer was not reading
};

}  // namespace kvpool::daemon
