#pragma once

// How the edges hear of cache events (DESIGN.md §10): the engine defines this tiny interface and
// the edges implement it (the FenceObserver pattern, kvpool/fence.h), so no edge has to remember
// to pump the engine after a call. The engine tells its listeners after every hold of its lock
// in which some pool's event log grew, whatever made the events: a control call, a model step,
// a session's end, an eviction, or the tier writers on their own schedule (host and disk tier
// events).

#include <cstdint>

namespace kvpool::daemon {

class EventListener {
 public:
  virtual ~EventListener() = default;
  // Pool `pool`'s event log (Engine::ReadEvents) holds events up to `next_seq` - 1 that may not
  // have been told before. Called on the thread that appended them (a gRPC callback thread, the
  // step runner, a tier writer), with no engine lock held, after the lock hold that appended
  // them. Calls from different threads may overlap and arrive out of order (a later `next_seq`
  // before an earlier one): treat it as a wake-up and read the log from your own cursor.
  // Must be thread-safe and return quickly; may call the engine's const methods (ReadEvents,
  // SnapshotEvents, next_event_seq), never one that changes the engine.
  virtual void OnEvents(int32_t pool, uint64_t next_seq) = 0;
};

}  // namespace kvpool::daemon
