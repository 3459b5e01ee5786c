// Engine: what operators ask of it (stats, listings, traces, events, eviction, invariants, drain).

#include <algorithm>

#include "daemon/engine/engine.h"
#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {

EngineStats Engine::Stats() const {
  EngineStats s;
  absl::ReaderMutexLock lock(&mu_);
  s.cache = state_->cache().stats();
  s.attached_sessions = static_cast<int64_t>(state_->sessions().size());
  s.sessions = state_->session_counters;
  s.calls = state_->call_counters;
  s.model = state_->model_counters;
  s.model_info = model_info_;
  s.events_next_seq = state_->cache().events() ? state_->cache().events()->next_seq() : 0;
  s.epoch = epoch_;
  s.device = device_->name();
  s.layout = layout_;
  s.uptime_seconds = static_cast<double>(state_->now() - started_ns_) * 1e-9;
  s.draining = state_->draining;
  s.health = state_->health;
  return s;
}

std::vector<SessionListing> Engine::ListSessions() const {
  std::vector<SessionListing> out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [id, session] : state_->sessions()) out.push_back({.session = session});
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.session->id < b.session->id; });
  state_->cache().ForEachSequence([&](const Sequence& seq) {
    auto it =
        std::lower_bound(out.begin(), out.end(), seq.session,
                         [](const SessionListing& l, SessionId id) { return l.session->id < id; });
    if (it == out.end() || it->session->id != seq.session) return;
    ++it->sequences;
    it->block_refs += static_cast<int64_t>(seq.table.size());
  });
  return out;
}

Tables Engine::ListSequences(SessionId session, std::vector<SessionId>* owners) const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<const Sequence*> seqs;
  state_->cache().ForEachSequence([&](const Sequence& seq) {
    if (session == kNoSession || seq.session == session) seqs.push_back(&seq);
  });
  std::sort(seqs.begin(), seqs.end(), [](const auto* a, const auto* b) { return a->id < b->id; });
  Tables out;
  for (const Sequence* seq : seqs) {
    state_->AppendTable(*seq, 0, 0, &out);
    owners->push_back(seq->session);
  }
  return out;
}

absl::StatusOr<std::vector<BlockTraceEntry>> Engine::BlockTrace(
    std::optional<BlockId> block) const {
  absl::ReaderMutexLock lock(&mu_);
  const BlockPool& pool = state_->cache().pool();
  if (!block) return pool.trace().All();
  if (!pool.Contains(*block)) {
    return absl::InvalidArgumentError(
        fmt::format("no block {} (the pool has {})", block->value(), pool.num_blocks()));
  }
  return pool.trace().History(*block);
}

MatchExplanation Engine::Explain(NamespaceId ns, std::span<const int32_t> tokens) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->cache().ExplainMatch(ns, tokens);
}

absl::StatusOr<int64_t> Engine::Evict(int64_t blocks, bool all) {
  absl::MutexLock lock(&mu_);
  if (all) {
    const int64_t before = state_->cache().stats().cache.nodes;
    KVPOOL_RETURN_IF_ERROR(state_->cache().ClearCache());
    return before;
  }
  if (blocks < 0) return absl::InvalidArgumentError("evict: negative block count");
  return state_->cache().EvictCached(blocks);
}

absl::Status Engine::CheckInvariants() const {
  absl::ReaderMutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(state_->cache().CheckInvariants());
  const BlockPool& pool = state_->cache().pool();
  for (int32_t b = 0; b < layout_.num_blocks; ++b) {
    const uint32_t shared = state_->generations().Get(BlockId(b));
    if (shared != pool.generation(BlockId(b))) {
      return absl::InternalError(fmt::format("block {} has generation {} but clients see {}", b,
                                             pool.generation(BlockId(b)), shared));
    }
  }
  return absl::OkStatus();
}

int64_t Engine::Drain() {
  absl::MutexLock lock(&mu_);
  state_->draining = true;
  return state_->cache().stats().sequences;
}

bool Engine::draining() const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->draining;
}

absl::Status Engine::health() const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->health;
}

bool Engine::ReadEvents(uint64_t from, size_t max, std::vector<KvEvent>* out) const {
  absl::ReaderMutexLock lock(&mu_);
  const EventLog* log = state_->cache().events();
  return log == nullptr || log->ReadFrom(from, max, out);
}

std::vector<KvEvent> Engine::SnapshotEvents(uint64_t* resume_seq) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->cache().SnapshotEvents(resume_seq);
}

uint64_t Engine::next_event_seq() const {
  absl::ReaderMutexLock lock(&mu_);
  const EventLog* log = state_->cache().events();
  return log ? log->next_seq() : 1;
}

}  // namespace kvpool::daemon
