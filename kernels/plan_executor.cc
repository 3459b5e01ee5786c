#include "kernels/plan_executor.h"

#include "fmt/format.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::kernels {

absl::StatusOr<FillPolicy> ParseFillPolicy(std::string_view name) {
  if (name == "none") return FillPolicy::kNone;
  if (name == "zero") return FillPolicy::kZero;
  if (name == "poison") return FillPolicy::kPoison;
  return absl::InvalidArgumentError(
      fmt::format("unknown fill policy '{}' (none, zero, poison)", name));
}

PlanExecutor::PlanExecutor(Device* device, StreamId stream, KvPoolView pool, FillPolicy policy)
    : device_(device), stream_(stream), pool_(pool), policy_(policy) {}

std::vector<BlockId> PlanExecutor::TouchedBlocks(const DevicePlan& plan) {
  std::vector<BlockId> out;
  for (const BlockFill& f : plan.fills) out.push_back(f.block);
  for (const BlockCopy& c : plan.copies) {
    out.push_back(c.src);
    out.push_back(c.dst);
  }
  return out;
}

absl::Status PlanExecutor::Stage(const std::vector<int32_t>& host,
                                 std::unique_ptr<DeviceBuffer>* buffer) {
  const int64_t bytes = static_cast<int64_t>(host.size() * sizeof(int32_t));
  if (*buffer == nullptr || (*buffer)->bytes() < bytes) {
    KVPOOL_ASSIGN_OR_RETURN(*buffer, device_->AllocateBuffer(std::max<int64_t>(bytes, 4096)));
  }
  return device_->CopyToDevice(stream_, (*buffer)->data(), host.data(), bytes).status();
}

absl::StatusOr<Fence> PlanExecutor::Execute(const DevicePlan& plan) {
  if (plan.empty()) return Fence{};
  // The staging buffers of the previous plan may still be read: wait for it (rare in practice:
  // plans are small and the stream is fast).
  KVPOOL_RETURN_IF_ERROR(device_->Synchronize(last_));
  zero_.clear();
  policy_fill_.clear();
  pairs_.clear();
  for (const BlockFill& f : plan.fills) {
    // Another tenant's bytes are always zeroed (DESIGN.md §4.6); the policy covers the rest.
    if (f.scrub || policy_ == FillPolicy::kZero) {
      zero_.push_back(f.block.value());
    } else if (policy_ == FillPolicy::kPoison) {
      policy_fill_.push_back(f.block.value());
    }
  }
  for (const BlockCopy& c : plan.copies) {
    pairs_.push_back(c.src.value());
    pairs_.push_back(c.dst.value());
  }
  Fence fence;  // value 0 unless something was enqueued
  if (!zero_.empty()) {
    KVPOOL_RETURN_IF_ERROR(Stage(zero_, &zero_dev_));
    KVPOOL_ASSIGN_OR_RETURN(
        fence, device_->FillBlocks(stream_, pool_,
                                   {.num_blocks = static_cast<int32_t>(zero_.size()),
                                    .blocks = static_cast<const int32_t*>(zero_dev_->data()),
                                    .pattern = FillPattern::kZero}));
  }
  if (!policy_fill_.empty()) {
    KVPOOL_RETURN_IF_ERROR(Stage(policy_fill_, &fill_dev_));
    KVPOOL_ASSIGN_OR_RETURN(
        fence, device_->FillBlocks(stream_, pool_,
                                   {.num_blocks = static_cast<int32_t>(policy_fill_.size()),
                                    .blocks = static_cast<const int32_t*>(fill_dev_->data()),
                                    .pattern = FillPattern::kPoison}));
  }
  if (!pairs_.empty()) {
    KVPOOL_RETURN_IF_ERROR(Stage(pairs_, &pairs_dev_));
    KVPOOL_ASSIGN_OR_RETURN(
        fence, device_->CopyBlocks(stream_, pool_,
                                   {.num_pairs = static_cast<int32_t>(pairs_.size() / 2),
                                    .pairs = static_cast<const int32_t*>(pairs_dev_->data())}));
  }
  last_ = fence;
  return fence;
}

}  // namespace kvpool::kernels
