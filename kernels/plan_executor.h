#pragma once

// PlanExecutor: carries out the core's DevicePlans on one stream of a device: fills first (fresh
// blocks; scrubbed ones always zeroed), then copies (copy-on-write), in that order, since a plan's
// fills and copies never touch the same block and copies must land before anyone writes the copy.
//
// The block lists are staged in a device buffer owned by the executor; a new plan reuses it only
// after the previous plan's fence has passed, so a plan's memory is never overwritten under it.
//
// Thread-compatible (the daemon calls it under its pool lock, right after the call that returned
// the plan, and marks the plan's blocks in flight with the returned fence before unlocking).

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/device.h"
#include "kvpool/kv_cache_manager.h"

namespace kvpool::kernels {

// What to write into a freshly handed-out block that did not change namespace.
enum class FillPolicy : uint8_t {
  kNone,  // leave the previous owner's (same tenant's) bytes
  kZero,
  kPoison,  // NaN pattern: a read of KV nobody wrote shows up at once (debug)
};

// "none", "zero", "poison". Errors: INVALID_ARGUMENT.
absl::StatusOr<FillPolicy> ParseFillPolicy(std::string_view name);

class PlanExecutor final {
 public:
  // `device` is not owned and must outlive the executor.
  PlanExecutor(Device* device, StreamId stream, KvPoolView pool, FillPolicy policy);

  // Enqueues the plan. Returns the fence after which all of it is done (value 0 when the plan
  // had nothing to do). Errors: those of the device's enqueue calls (nothing further enqueued).
  absl::StatusOr<Fence> Execute(const DevicePlan& plan);

  // Every block the plan touches (copy sources and targets, filled blocks): the ones to mark in
  // flight with Execute's fence.
  static std::vector<BlockId> TouchedBlocks(const DevicePlan& plan);

 private:
  absl::Status Stage(const std::vector<int32_t>& host, std::unique_ptr<DeviceBuffer>* buffer);

  Device* const device_;
  const StreamId stream_;
  const KvPoolView pool_;
  const FillPolicy policy_;
  Fence last_;  // of the previous plan: its staging buffers are free once it passed
  std::vector<int32_t> zero_, policy_fill_, pairs_;  // host staging (read by the copies)
  std::unique_ptr<DeviceBuffer> zero_dev_, fill_dev_, pairs_dev_;
};

}  // namespace kvpool::kernels
