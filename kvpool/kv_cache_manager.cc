#include "kvpool/kv_cache_manager.h"

#include <algorithm>
#include <utility>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {
namespace {

// Adds `blocks` to the entry for `ns` in a short list (a batch touches few namespaces).
void AddTo(std::vector<std::pair<NamespaceId, int64_t>>* by_ns, NamespaceId ns, int64_t blocks) {
  for (auto& [id, n] : *by_ns) {
    if (id == ns) {
      n += blocks;
      return;
    }
  }
  by_ns->emplace_back(ns, blocks);
}

absl::Status EmptyBatch(std::string_view what) {
  return absl::InvalidArgumentError(fmt::format("{}: empty batch", what));
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCacheManager>> KvCacheManager::Create(
    const KvCacheOptions& options) {
  if (options.block_size <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("block_size must be > 0 (got {})", options.block_size));
  }
  if (options.max_blocks_per_seq <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("max_blocks_per_seq must be > 0 (got {})", options.max_blocks_per_seq));
  }
  if (options.clock == nullptr) return absl::InvalidArgumentError("clock must not be null");
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<BlockPool> pool,
                          BlockPool::Create(BlockPoolOptions{.num_blocks = options.num_blocks,
                                                             .trace_depth = options.trace_depth,
                                                             .fences = options.fences}));
  return std::unique_ptr<KvCacheManager>(new KvCacheManager(options, std::move(pool)));
}

KvCacheManager::KvCacheManager(const KvCacheOptions& options, std::unique_ptr<BlockPool> pool)
    : block_size_(options.block_size),
      max_blocks_per_seq_(options.max_blocks_per_seq),
      clock_(options.clock),
      pool_(std::move(pool)),
      ns_quota_{kUnlimited} {}

absl::Status KvCacheManager::SetNamespaceQuota(NamespaceId ns, int64_t max_blocks) {
  if (max_blocks < 0) {
    return absl::InvalidArgumentError(fmt::format("negative namespace quota {}", max_blocks));
  }
  KVPOOL_ASSIGN_OR_RETURN(NamespaceSlot slot, pool_->RegisterNamespace(ns));
  if (ns_quota_.size() <= slot.value()) ns_quota_.resize(slot.value() + 1, kUnlimited);
  ns_quota_[slot.value()] = max_blocks;
  return absl::OkStatus();
}

absl::Status KvCacheManager::SetSessionQuota(SessionId session, int64_t max_block_refs) {
  if (max_block_refs < 0) {
    return absl::InvalidArgumentError(fmt::format("negative session quota {}", max_block_refs));
  }
  sessions_[session].quota = max_block_refs;
  return absl::OkStatus();
}

absl::StatusOr<Sequence*> KvCacheManager::Owned(SessionId caller, SequenceId sequence) {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) {
    return absl::NotFoundError(fmt::format("no sequence {}", sequence.value()));
  }
  if (it->second.session != caller) {
    return absl::PermissionDeniedError(
        fmt::format("sequence {} belongs to another session", sequence.value()));
  }
  return &it->second;
}

absl::Status KvCacheManager::CountExhausted(absl::Status status) {
  if (absl::IsResourceExhausted(status)) ++counters_.exhausted;
  return status;
}

absl::Status KvCacheManager::PlanGrow(Sequence* sequence, int64_t num_tokens,
                                      std::vector<std::pair<BlockId, uint32_t>>* cow_taken,
                                      GrowPlan* plan) const {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(fmt::format("negative token count {}", num_tokens));
  }
  *plan = GrowPlan{.sequence = sequence, .num_tokens = num_tokens};
  if (num_tokens <= sequence->num_tokens) return absl::OkStatus();  // already covered
  const int64_t need = BlocksFor(num_tokens);
  if (need > max_blocks_per_seq_) {
    return ResourceExhausted(Resource::kTableBound, need - max_blocks_per_seq_,
                             fmt::format("sequence {} to {} tokens needs {} blocks",
                                         sequence->id.value(), num_tokens, need));
  }
  plan->new_blocks = static_cast<int32_t>(need - static_cast<int64_t>(sequence->table.size()));
  // The first token written lands in the existing last block when the sequence ends inside it.
  if (sequence->num_tokens % block_size_ != 0) {
    const BlockId target = sequence->table[static_cast<size_t>(sequence->num_tokens / block_size_)];
    if (pool_->refs(target) > 1) {  // shared: rare, so a short list is enough
      auto it = std::find_if(cow_taken->begin(), cow_taken->end(),
                             [&](const auto& entry) { return entry.first == target; });
      if (it == cow_taken->end()) it = cow_taken->insert(it, {target, 0});
      const uint32_t holders = pool_->refs(target) - it->second;
      if (holders > 1 || pool_->cache_held(target)) {
        plan->cow = true;
        ++it->second;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckCapacity(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                                           SessionId session, int64_t refs, std::string_view what) {
  int64_t blocks = 0;
  int64_t new_namespaces = 0;
  for (const auto& [ns, n] : by_ns) {
    blocks += n;
    const std::optional<NamespaceSlot> slot = pool_->FindNamespace(ns);
    if (!slot) {
      ++new_namespaces;
      continue;
    }
    const int64_t quota = slot->value() < ns_quota_.size() ? ns_quota_[slot->value()] : kUnlimited;
    const int64_t used = pool_->active_blocks(*slot);
    if (n > 0 && quota != kUnlimited && used + n > quota) {
      return ResourceExhausted(Resource::kNamespaceQuota, used + n - quota,
                               fmt::format("{} in namespace {} ({} of {} blocks in use)", what,
                                           ns.value(), used, quota));
    }
  }
  if (new_namespaces > pool_->namespaces_left()) {
    return absl::ResourceExhaustedError(fmt::format("{}: the namespace table is full", what));
  }
  if (refs > 0) {
    auto it = sessions_.find(session);
    if (it != sessions_.end() && it->second.quota != kUnlimited &&
        it->second.block_refs + refs > it->second.quota) {
      const SessionUsage& usage = it->second;
      return ResourceExhausted(Resource::kSessionQuota, usage.block_refs + refs - usage.quota,
                               fmt::format("{} for session {} ({} of {} block references held)",
                                           what, session.value(), usage.block_refs, usage.quota));
    }
  }
  if (blocks > pool_->num_free()) ReclaimRetired();
  if (blocks > pool_->num_free()) {
    return ResourceExhausted(
        Resource::kPoolBlocks, blocks - pool_->num_free(),
        fmt::format("{} needs {} blocks, {} free", what, blocks, pool_->num_free()));
  }
  return absl::OkStatus();
}

void KvCacheManager::ApplyGrow(const GrowPlan& plan, const TraceContext& ctx,
                               DevicePlan* device_plan) {
  Sequence& seq = *plan.sequence;
  if (plan.num_tokens <= seq.num_tokens) return;
  if (plan.cow) {
    const size_t index = static_cast<size_t>(seq.num_tokens / block_size_);
    const BlockId src = seq.table[index];
    std::vector<BlockId> dst;
    KVPOOL_CHECK_OK(pool_->Allocate(1, seq.slot, ctx, &dst, /*fills=*/nullptr));
    KVPOOL_CHECK_OK(pool_->Release(src, ctx));
    seq.table[index] = dst[0];
    device_plan->copies.push_back(BlockCopy{src, dst[0]});
    ++counters_.cow_copies;
  }
  if (plan.new_blocks > 0) {
    KVPOOL_CHECK_OK(
        pool_->Allocate(plan.new_blocks, seq.slot, ctx, &seq.table, &device_plan->fills));
  }
  seq.num_tokens = plan.num_tokens;
}

absl::StatusOr<SequenceId> KvCacheManager::Allocate(SessionId caller,
                                                    const AllocateRequest& request,
                                                    DevicePlan* plan) {
  std::vector<SequenceId> ids;
  KVPOOL_RETURN_IF_ERROR(AllocateBatch(caller, std::span(&request, 1), &ids, plan));
  return ids[0];
}

absl::Status KvCacheManager::AllocateBatch(SessionId caller,
                                           std::span<const AllocateRequest> requests,
                                           std::vector<SequenceId>* ids, DevicePlan* plan) {
  ++counters_.allocate_calls;
  if (requests.empty()) return EmptyBatch("allocate");
  if (caller == kNoSession) return absl::InvalidArgumentError("session 0 is reserved");
  std::vector<std::pair<NamespaceId, int64_t>> by_ns;
  int64_t refs = 0;
  for (const AllocateRequest& r : requests) {
    if (r.ns == kNoNamespace) return absl::InvalidArgumentError("namespace 0 is reserved");
    if (r.num_tokens < 0) {
      return absl::InvalidArgumentError(fmt::format("negative token count {}", r.num_tokens));
    }
    const int64_t need = BlocksFor(r.num_tokens);
    if (need > max_blocks_per_seq_) {
      return CountExhausted(ResourceExhausted(
          Resource::kTableBound, need - max_blocks_per_seq_,
          fmt::format("a sequence of {} tokens needs {} blocks", r.num_tokens, need)));
    }
    AddTo(&by_ns, r.ns, need);
    refs += need;
  }
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckCapacity(by_ns, caller, refs, "allocate")));

  // Everything checked: from here on nothing can fail.
  TraceContext ctx = Context(caller, SequenceId(0));
  for (const AllocateRequest& r : requests) {
    const SequenceId id(next_sequence_id_++);
    const absl::StatusOr<NamespaceSlot> slot = pool_->RegisterNamespace(r.ns);
    KVPOOL_CHECK_OK(slot.status());
    Sequence& seq = sequences_[id];
    seq = Sequence{.id = id, .session = caller, .ns = r.ns, .slot = *slot};
    ctx.sequence = id;
    ApplyGrow(GrowPlan{.sequence = &seq,
                       .num_tokens = r.num_tokens,
                       .new_blocks = static_cast<int32_t>(BlocksFor(r.num_tokens))},
              ctx, plan);
    ids->push_back(id);
  }
  SessionUsage& usage = sessions_[caller];
  usage.sequences += static_cast<int64_t>(requests.size());
  usage.block_refs += refs;
  return absl::OkStatus();
}

absl::Status KvCacheManager::Grow(SessionId caller, SequenceId sequence, int64_t num_tokens,
                                  DevicePlan* plan) {
  const GrowRequest request{sequence, num_tokens};
  return GrowBatch(caller, std::span(&request, 1), plan);
}

absl::Status KvCacheManager::GrowBatch(SessionId caller, std::span<const GrowRequest> requests,
                                       DevicePlan* plan) {
  ++counters_.grow_calls;
  if (requests.empty()) return EmptyBatch("grow");
  std::vector<GrowPlan> plans(requests.size());
  std::vector<std::pair<BlockId, uint32_t>> cow_taken;
  std::vector<std::pair<NamespaceId, int64_t>> by_ns;
  int64_t refs = 0;
  const uint64_t mark = ++batch_serial_;
  for (size_t k = 0; k < requests.size(); ++k) {
    const GrowRequest& r = requests[k];
    KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, r.sequence));
    if (seq->batch_mark == mark) {
      return absl::InvalidArgumentError(
          fmt::format("sequence {} appears twice in one grow batch", r.sequence.value()));
    }
    seq->batch_mark = mark;
    KVPOOL_RETURN_IF_ERROR(CountExhausted(PlanGrow(seq, r.num_tokens, &cow_taken, &plans[k])));
    const int64_t blocks = plans[k].new_blocks + (plans[k].cow ? 1 : 0);
    if (blocks > 0) AddTo(&by_ns, seq->ns, blocks);
    refs += plans[k].new_blocks;
  }
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckCapacity(by_ns, caller, refs, "grow")));

  TraceContext ctx = Context(caller, SequenceId(0));  // one clock reading per call
  for (const GrowPlan& p : plans) {
    ctx.sequence = p.sequence->id;
    ApplyGrow(p, ctx, plan);
  }
  if (refs > 0) sessions_[caller].block_refs += refs;
  return absl::OkStatus();
}

void KvCacheManager::ReleaseTail(Sequence* sequence, size_t keep, const TraceContext& ctx) {
  // Last block first, so the LIFO free list hands the sequence's first block out next.
  for (size_t i = sequence->table.size(); i > keep; --i) {
    KVPOOL_CHECK_OK(pool_->Release(sequence->table[i - 1], ctx));
  }
  sessions_[sequence->session].block_refs -= static_cast<int64_t>(sequence->table.size() - keep);
  sequence->table.resize(keep);
}

absl::Status KvCacheManager::Truncate(SessionId caller, SequenceId sequence, int64_t num_tokens) {
  ++counters_.truncate_calls;
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (num_tokens < 0 || num_tokens > seq->num_tokens) {
    return absl::InvalidArgumentError(fmt::format("cannot truncate sequence {} of {} tokens to {}",
                                                  sequence.value(), seq->num_tokens, num_tokens));
  }
  ReleaseTail(seq, static_cast<size_t>(BlocksFor(num_tokens)), Context(caller, sequence));
  seq->num_tokens = num_tokens;
  return absl::OkStatus();
}

absl::StatusOr<SequenceId> KvCacheManager::Fork(SessionId caller, SequenceId sequence,
                                                DevicePlan* plan) {
  ++counters_.fork_calls;
  KVPOOL_ASSIGN_OR_RETURN(Sequence * parent, Owned(caller, sequence));
  const bool partial = parent->num_tokens % block_size_ != 0;
  const std::pair<NamespaceId, int64_t> by_ns[] = {{parent->ns, partial ? 1 : 0}};
  KVPOOL_RETURN_IF_ERROR(CountExhausted(
      CheckCapacity(by_ns, caller, static_cast<int64_t>(parent->table.size()), "fork")));

  const SequenceId id(next_sequence_id_++);
  // Copy what the child needs before inserting: the insert may move `parent`.
  Sequence child{.id = id,
                 .session = caller,
                 .ns = parent->ns,
                 .slot = parent->slot,
                 .num_tokens = parent->num_tokens,
                 .table = parent->table};
  const TraceContext ctx = Context(caller, id);
  const size_t shared = child.table.size() - (partial ? 1 : 0);
  for (size_t i = 0; i < shared; ++i) KVPOOL_CHECK_OK(pool_->Retain(child.table[i], ctx));
  if (partial) {
    std::vector<BlockId> dst;
    KVPOOL_CHECK_OK(pool_->Allocate(1, child.slot, ctx, &dst, /*fills=*/nullptr));
    plan->copies.push_back(BlockCopy{child.table.back(), dst[0]});
    child.table.back() = dst[0];
    ++counters_.cow_copies;
  }
  SessionUsage& usage = sessions_[caller];
  usage.block_refs += static_cast<int64_t>(child.table.size());
  ++usage.sequences;
  sequences_.emplace(id, std::move(child));
  return id;
}

absl::Status KvCacheManager::Free(SessionId caller, SequenceId sequence) {
  ++counters_.free_calls;
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  ReleaseTail(seq, 0, Context(caller, sequence));
  auto it = sessions_.find(caller);
  if (--it->second.sequences == 0 && it->second.quota == kUnlimited) sessions_.erase(it);
  sequences_.erase(sequence);
  return absl::OkStatus();
}

int64_t KvCacheManager::FreeSession(SessionId session) {
  std::vector<SequenceId> owned;
  for (const auto& [id, seq] : sequences_) {
    if (seq.session == session) owned.push_back(id);
  }
  std::sort(owned.begin(), owned.end());  // deterministic release order
  for (SequenceId id : owned) KVPOOL_CHECK_OK(Free(session, id));
  sessions_.erase(session);
  return static_cast<int64_t>(owned.size());
}

absl::Status KvCacheManager::MarkInFlight(std::span<const BlockId> blocks, Fence fence) {
  for (BlockId block : blocks) {
    if (!pool_->Contains(block)) {
      return absl::NotFoundError(fmt::format("block {} does not exist", block.value()));
    }
    const BlockState state = pool_->state(block);
    if (state != BlockState::kActive && state != BlockState::kCached) {
      return absl::FailedPreconditionError(
          fmt::format("device work on block {} in state {}", block.value(), BlockStateName(state)));
    }
  }
  const TraceContext ctx = Context(kNoSession, SequenceId(0));
  for (BlockId block : blocks) KVPOOL_RETURN_IF_ERROR(pool_->MarkInFlight(block, fence, ctx));
  return absl::OkStatus();
}

int32_t KvCacheManager::ReclaimRetired() {
  return pool_->ReclaimRetired(Context(kNoSession, SequenceId(0)));
}

const Sequence* KvCacheManager::Find(SequenceId sequence) const {
  auto it = sequences_.find(sequence);
  return it == sequences_.end() ? nullptr : &it->second;
}

void KvCacheManager::ForEachSequence(absl::FunctionRef<void(const Sequence&)> fn) const {
  for (const auto& [id, seq] : sequences_) fn(seq);
}

KvCacheStats KvCacheManager::stats() const {
  KvCacheStats s = counters_;
  s.pool = pool_->stats();
  s.sequences = static_cast<int64_t>(sequences_.size());
  s.sessions = 0;
  for (const auto& [id, usage] : sessions_) s.sessions += usage.sequences > 0 ? 1 : 0;
  return s;
}

absl::Status KvCacheManager::CheckInvariants() const {
  KVPOOL_RETURN_IF_ERROR(pool_->CheckInvariants());
  auto fail = [](auto&&... parts) { return absl::InternalError(fmt::format("{}", parts...)); };
  std::vector<uint32_t> refs(static_cast<size_t>(pool_->num_blocks()), 0);
  absl::flat_hash_map<SessionId, SessionUsage> usage;
  for (const auto& [id, seq] : sequences_) {
    if (seq.id != id) return fail("sequence ", id.value(), " is filed under another id");
    if (static_cast<int64_t>(seq.table.size()) != BlocksFor(seq.num_tokens)) {
      return fail("sequence ", id.value(), " of ", seq.num_tokens, " tokens has ", seq.table.size(),
                  " blocks");
    }
    if (static_cast<int64_t>(seq.table.size()) > max_blocks_per_seq_) {
      return fail("sequence ", id.value(), " exceeds max_blocks_per_seq");
    }
    if (pool_->FindNamespace(seq.ns) != seq.slot) {
      return fail("sequence ", id.value(), " has a stale namespace slot");
    }
    for (BlockId block : seq.table) {
      if (!pool_->Contains(block) || pool_->state(block) != BlockState::kActive) {
        return fail("sequence ", id.value(), " references block ", block.value(), " in state ",
                    pool_->Contains(block) ? BlockStateName(pool_->state(block)) : "invalid");
      }
      ++refs[static_cast<size_t>(block.value())];
    }
    usage[seq.session].block_refs += static_cast<int64_t>(seq.table.size());
    ++usage[seq.session].sequences;
  }
  for (int32_t b = 0; b < pool_->num_blocks(); ++b) {
    const BlockId block(b);
    const uint32_t expected = refs[static_cast<size_t>(b)] + (pool_->cache_held(block) ? 1 : 0);
    if (pool_->refs(block) != expected) {
      return fail("block ", b, " has refs ", pool_->refs(block), " but ", expected,
                  " references exist");
    }
  }
  for (const auto& [session, u] : sessions_) {
    auto it = usage.find(session);
    const SessionUsage want = it == usage.end() ? SessionUsage{} : it->second;
    if (u.block_refs != want.block_refs || u.sequences != want.sequences) {
      return fail("session ", session.value(), " usage is ", u.block_refs, " refs / ", u.sequences,
                  " sequences but ", want.block_refs, " / ", want.sequences, " exist");
    }
  }
  for (const auto& [session, u] : usage) {
    if (!sessions_.contains(session)) return fail("session ", session.value(), " is untracked");
  }
  return absl::OkStatus();
}

std::string KvCacheManager::DebugString() const {
  std::string out = pool_->DebugString();
  auto it = std::back_inserter(out);
  std::vector<SequenceId> ids;
  for (const auto& [id, seq] : sequences_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  fmt::format_to(it, "next_sequence={}\nsequences:\n", next_sequence_id_);
  for (SequenceId id : ids) {
    const Sequence& seq = sequences_.at(id);
    std::vector<int32_t> table;
    for (BlockId b : seq.table) table.push_back(b.value());
    fmt::format_to(it, "{} session={} ns={} tokens={} table={}\n", id.value(), seq.session.value(),
                   seq.ns.value(), seq.num_tokens, fmt::join(table, ","));
  }
  std::vector<std::pair<SessionId, SessionUsage>> sessions(sessions_.begin(), sessions_.end());
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  out += "sessions:";
  for (const auto& [id, u] : sessions) {
    fmt::format_to(it, " {}={}/{}/{}", id.value(), u.block_refs, u.sequences, u.quota);
  }
  fmt::format_to(it, "\nns_quota: {}\n", fmt::join(ns_quota_, " "));
  return out;
}

}  // namespace kvpool
