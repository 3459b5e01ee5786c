#pragma once

// PlanExecutor: carries out the core's DevicePlans on one stream of a device, in the order
// DevicePlan documents: copies first (copy-on-write), then fills (fresh blocks; scrubbed ones
// always zeroed). A plan whose fills and copies overlap (a block filled twice, copied into twice,
// or both filled and copied) is refused whole: in one plan that can only be a bookkeeping bug,
// and carrying it out would copy bytes that a fill is about to replace, or the reverse.
//
// The block lists are staged in device buffers owned by the executor, one set per plan still in
// flight, reused once that plan's fence has passed: Execute never waits for earlier work.
//
// Thread-compatible (the daemon calls it under its pool lock, right after the call that returned
// the plan, and marks the plan's blocks in flight with the returned fence before unlocking).

#include <deque>
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
  // had nothing to do). Errors: INVALID_ARGUMENT for overlapping fills and copies (nothing
  // enqueued); those of the device's enqueue calls. After a device error, what was enqueued
  // before it still runs: its fence is pending(), and the plan's blocks must stay out of reuse
  // until that fence has passed.
  absl::StatusOr<Fence> Execute(const DevicePlan& plan);

  // The fence of the newest work this executor enqueued (value 0 before any).
  Fence pending() const { return pending_; }

  // INVALID_ARGUMENT when a block is filled twice, copied into twice, or both filled and copied
  // (as source or target).
  static absl::Status CheckDisjoint(const DevicePlan& plan);

  // Every block the plan touches (copy sources and targets, filled blocks): the ones to mark in
  // flight with Execute's fence.
  static std::vector<BlockId> TouchedBlocks(const DevicePlan& plan);

  // The plan's state-group part (state_copies, state_zeros) as a plan of its own, for an
  // executor over the state slots (KvPoolView::StateSlots) whose every fill zeroes.
  static DevicePlan StatePart(const DevicePlan& plan);
  // The plan's window-group part (window_copies, window_fills) as a plan of its own, for an
  // executor over the window blocks (KvPoolView::Window).
  static DevicePlan WindowPart(const DevicePlan& plan) {
    return {.copies = plan.window_copies, .fills = plan.window_fills};
  }

 private:
  // One plan's block lists, on the host and staged on the device; busy until `fence` passed.
  struct Staging {
    Fence fence;
    std::vector<int32_t> zero, policy_fill, pairs;
    std::unique_ptr<DeviceBuffer> zero_dev, fill_dev, pairs_dev;
  };

  std::unique_ptr<Staging> TakeStaging();
  absl::Status Stage(const std::vector<int32_t>& host, std::unique_ptr<DeviceBuffer>* buffer);
  absl::Status Enqueue(Staging& s);

  Device* const device_;
  const StreamId stream_;
  const KvPoolView pool_;
  const FillPolicy policy_;
  Fence pending_;
  std::deque<std::unique_ptr<Staging>> busy_;  // in enqueue order
  std::vector<std::unique_ptr<Staging>> idle_;
};

}  // namespace kvpool::kernels
