#pragma once

// EventStreamCounters: what the WatchEvents streams count, for the stats tables (stats_table.h):
// followers now, snapshots sent (asked for, or because a stream's position had left the event
// log: a gap it cannot be given event by event) and each follower's lag behind the log's head
// after each batch it is sent. Thread-safe (one small mutex: a stream touches it once per batch,
// never per event).

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvpool/util/histogram.h"

namespace kvpool::daemon {

// Buckets of EventStreamStats::follower_lag, in events.
inline constexpr double kFollowerLagBucketsEvents[] = {0,    1,    4,     16,    64,    256,
                                                       1024, 4096, 16384, 65536, 262144};

struct EventStreamStats {
  int64_t followers = 0;             // gauge: WatchEvents streams with follow, open now
  uint64_t snapshots_requested = 0;  // counter: snapshots the caller asked for
  uint64_t snapshots_behind = 0;     // counter: snapshots sent because the stream's next event
                                     // had been dropped from the log (at start or following)
  // Events a stream had still to send after each batch it was sent (the log's next seq minus
  // the stream's): 0 when it is caught up.
  Histogram follower_lag{kFollowerLagBucketsEvents};
};

class EventStreamCounters final {
 public:
  void FollowerOpened() {
    absl::MutexLock lock(&mu_);
    ++stats_.followers;
  }
  void FollowerClosed() {
    absl::MutexLock lock(&mu_);
    --stats_.followers;
  }
  void SnapshotSent(bool requested) {
    absl::MutexLock lock(&mu_);
    ++(requested ? stats_.snapshots_requested : stats_.snapshots_behind);
  }
  void BatchSent(uint64_t events_behind) {
    absl::MutexLock lock(&mu_);
    stats_.follower_lag.Observe(static_cast<double>(events_behind));
  }
  EventStreamStats Read() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  mutable absl::Mutex mu_;
  EventStreamStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::daemon
