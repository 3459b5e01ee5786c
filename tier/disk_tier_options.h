#pragma once

// Configuration of the disk tier (DESIGN.md §9, docs/tiers.md): a directory on a local file
// system with a byte budget, between the host tier and Redis. A plain struct: the daemon fills it
// from its config file; DiskBlockStore::Open validates it (INVALID_ARGUMENT names the field).

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvpool::tier {

// When the tier's writes are made durable. Whatever the policy, a record that did not reach the
// disk whole is a miss after a crash (its MAC fails, docs/tiers.md), never data: the policy only
// decides how much of what was written survives a power loss.
enum class DiskFsync : uint8_t {
  kNone,      // never: the kernel writes back when it likes (the default; a crash of the daemon
              // alone loses nothing the kernel accepted)
  kBatch,     // after each write batch: the blocks' bytes, then their index entries
  kPeriodic,  // at most every fsync_interval, after a batch
};

struct DiskTierOptions {
  // The store's own directory (the daemon gives each pool <tiers.disk.directory>/<pool>); made
  // (mode 0700) when absent. Empty: no disk tier.
  std::string directory;
  // Bytes of block records the tier may keep; the least recently used record makes room past
  // it. The index beside them takes 128 bytes per record slot more.
  int64_t capacity_bytes = 0;
  DiskFsync fsync = DiskFsync::kNone;
  absl::Duration fsync_interval = absl::Seconds(1);  // kPeriodic only
  int64_t write_queue_blocks = 256;                  // blocks waiting for the writer, at most
  int64_t write_queue_bytes = int64_t{256} << 20;    // their bytes, at most
  int write_batch_blocks = 32;                       // blocks the writer takes per batch
  // Open the records with O_DIRECT (no page cache: large reads and writes go straight to the
  // device) where the file system allows it; buffered I/O otherwise (tmpfs, some overlays).
  bool direct_io = true;
  // Names what the stored bytes mean beyond their layout: the daemon's model (name, seed or
  // checkpoint). A tier written for another model starts empty.
  uint64_t content_fingerprint = 0;
  // Breaker: this many consecutive failed I/O calls (a full or failing disk) open it; while open
  // lookups miss and writes drop at once, until a probe after the back-off succeeds.
  int breaker_failure_threshold = 3;
  absl::Duration breaker_backoff = absl::Seconds(1);
  absl::Duration breaker_max_backoff = absl::Seconds(30);

  // Tenant shares of the records' fair order (internal::FairSlotLru, as the host tier's: a full
  // tier makes room in the tenant share with the most records per unit of weight); 0: one LRU
  // order for all. The daemon sets it from the pool's limits.eviction_shares.
  int32_t tenant_shares = 16;

  // Tests only. Runs on the writer's thread with no lock held, in the writer's lock gap: after a
  // batch's slots are taken (counted, out of every list) and before its bytes are written. A test
  // holds the gap open there (a latch) and works the store from other threads meanwhile.
  std::function<void()> writer_gap_hook;
  // Tests only. Runs on a lookup's thread with no lock held, in the lookup's lock gap: after its
  // slots are planned (under the lock) and before they are read and verified.
  std::function<void()> lookup_gap_hook;
  // Tests only. Asked before the writer clears each index entry of a dropped record: an error it
  // returns is that write's (a failing disk: EIO, EROFS), and the entry is not written.
  std::function<absl::Status()> clear_entry_fault;

  bool enabled() const { return !directory.empty(); }
};

// The content_fingerprint of a model identity string (what the daemon writes from its ModelSpec).
uint64_t ContentFingerprint(std::string_view identity);

}  // namespace kvpool::tier
