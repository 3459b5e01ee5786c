#include "kernels/plan_executor.h"

#include <algorithm>

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

DevicePlan PlanExecutor::StatePart(const DevicePlan& plan) {
  DevicePlan states{.copies = plan.state_copies};
  states.fills.reserve(plan.state_zeros.size());
  for (BlockId slot : plan.state_zeros) states.fills.push_back({.block = slot, .scrub = true});
  return states;
}

absl::Status PlanExecutor::CheckDisjoint(const DevicePlan& plan) {
  // Written blocks (fill and copy targets) must be distinct; sources must not be written.
  std::vector<BlockId> written;
  written.reserve(plan.fills.size() + plan.copies.size());
  for (const BlockFill& f : plan.fills) written.push_back(f.block);
  for (const BlockCopy& c : plan.copies) written.push_back(c.dst);
  std::sort(written.begin(), written.end());
  if (auto twice = std::adjacent_find(written.begin(), written.end()); twice != written.end()) {
    return absl::InvalidArgumentError(
        fmt::format("device plan writes block {} twice (fill or copy target)", twice->value()));
  }
  for (const BlockCopy& c : plan.copies) {
    if (std::binary_search(written.begin(), written.end(), c.src)) {
      return absl::InvalidArgumentError(fmt::format(
          "device plan copies from block {}, which the same plan writes", c.src.value()));
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<PlanExecutor::Staging> PlanExecutor::TakeStaging() {
  while (!busy_.empty() && device_->HasPassed(busy_.front()->fence)) {
    idle_.push_back(std::move(busy_.front()));
    busy_.pop_front();
  }
  if (idle_.empty()) return std::make_unique<Staging>();
  std::unique_ptr<Staging> s = std::move(idle_.back());
  idle_.pop_back();
  s->zero.clear();
  s->policy_fill.clear();
  s->pairs.clear();
  return s;
}

absl::Status PlanExecutor::Stage(const std::vector<int32_t>& host,
                                 std::unique_ptr<DeviceBuffer>* buffer) {
  const int64_t bytes = static_cast<int64_t>(host.size() * sizeof(int32_t));
  if (*buffer == nullptr || (*buffer)->bytes() < bytes) {
    KVPOOL_ASSIGN_OR_RETURN(*buffer, device_->AllocateBuffer(std::max<int64_t>(bytes, 4096)));
  }
  KVPOOL_ASSIGN_OR_RETURN(pending_,
                          device_->CopyToDevice(stream_, (*buffer)->data(), host.data(), bytes));
  return absl::OkStatus();
}

absl::Status PlanExecutor::Enqueue(Staging& s) {
  if (!s.pairs.empty()) {
    KVPOOL_RETURN_IF_ERROR(Stage(s.pairs, &s.pairs_dev));
    KVPOOL_ASSIGN_OR_RETURN(
        pending_, device_->CopyBlocks(stream_, pool_,
                                      {.num_pairs = static_cast<int32_t>(s.pairs.size() / 2),
                                       .pairs = static_cast<const int32_t*>(s.pairs_dev->data())}));
  }
  if (!s.zero.empty()) {
    KVPOOL_RETURN_IF_ERROR(Stage(s.zero, &s.zero_dev));
    KVPOOL_ASSIGN_OR_RETURN(
        pending_, device_->FillBlocks(stream_, pool_,
                                      {.num_blocks = static_cast<int32_t>(s.zero.size()),
                                       .blocks = static_cast<const int32_t*>(s.zero_dev->data()),
                                       .pattern = FillPattern::kZero}));
  }
  if (!s.policy_fill.empty()) {
    KVPOOL_RETURN_IF_ERROR(Stage(s.policy_fill, &s.fill_dev));
    KVPOOL_ASSIGN_OR_RETURN(
        pending_, device_->FillBlocks(stream_, pool_,
                                      {.num_blocks = static_cast<int32_t>(s.policy_fill.size()),
                                       .blocks = static_cast<const int32_t*>(s.fill_dev->data()),
                                       .pattern = FillPattern::kPoison}));
  }
  return absl::OkStatus();
}

absl::StatusOr<Fence> PlanExecutor::Execute(const DevicePlan& plan) {
  if (plan.empty()) return Fence{};
  KVPOOL_RETURN_IF_ERROR(CheckDisjoint(plan));
  std::unique_ptr<Staging> s = TakeStaging();
  for (const BlockCopy& c : plan.copies) {
    s->pairs.push_back(c.src.value());
    s->pairs.push_back(c.dst.value());
  }
  for (const BlockFill& f : plan.fills) {
    // Another tenant's bytes are always zeroed (DESIGN.md §4.6); the policy covers the rest.
    if (f.scrub || policy_ == FillPolicy::kZero) {
      s->zero.push_back(f.block.value());
    } else if (policy_ == FillPolicy::kPoison) {
      s->policy_fill.push_back(f.block.value());
    }
  }
  const Fence before = pending_;
  const absl::Status enqueued = Enqueue(*s);
  // Whatever was enqueued reads the staging buffers until it has run, failure or not.
  const bool used = pending_.value != before.value || pending_.timeline != before.timeline;
  s->fence = pending_;
  if (used) {
    busy_.push_back(std::move(s));  // in fence order: one stream
  } else {
    idle_.push_back(std::move(s));
  }
  if (!enqueued.ok()) return enqueued;
  return used ? pending_ : Fence{};
}

}  // namespace kvpool::kernels
