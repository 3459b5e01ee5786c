#include "daemon/engine/step.h"

#include <algorithm>

#include "daemon/engine/promotion.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {
namespace {

// The sequences a call names; SequenceId(0) (a new sequence) names none.
std::vector<SequenceId> Names(const ComputeRequest& r) {
  std::vector<SequenceId> out;
  if (r.prefill()) {
    if (r.sequence != SequenceId(0)) out.push_back(r.sequence);
  } else {
    for (const model::DecodeInput& in : r.decode) out.push_back(in.sequence);
  }
  return out;
}

// Gives back what `item`'s plan took (model::UndoItem); what cannot be given back is logged.
void GiveBackItem(KvCacheManager& cache, SessionId caller, const model::PlannedItem& item,
                  bool ran) {
  if (absl::Status s = model::UndoItem(cache, caller, item, ran); !s.ok()) {
    Logger("daemon").warn("sequence {}: a step's tokens not taken back: {}", item.sequence.value(),
                          s.message());
  }
}

void KeepTopK(int32_t top_k, model::ItemResult* result) {
  if (static_cast<int32_t>(result->top.size()) > top_k) {
    result->top.resize(static_cast<size_t>(top_k));
  }
}

}  // namespace

void Step::Plan(EngineState& state) {
  PoolState& pool = state.pool(pool_);
  fence_ = pool.steps().Issue();
  view_ = pool.view();
  device_ = &pool.device();
  for (ComputeCall* call : calls_) {
    if (absl::Status s = PlanCall(state, *call); !s.ok()) call->result().status = s;
  }
}

absl::Status Step::Admit(EngineState& state, const ComputeCall& call) const {
  // Again, as the call joins a step: its session may have ended, its caller given up, or the
  // engine begun draining since it queued (admission.h).
  const Verdict verdict = gate_.Admit(AdmissionGate::AskOf(call, /*queued=*/false),
                                      state.FactsOf(call.session(), call.context().Check()));
  Count(verdict.counted, state.call_counters);
  return verdict.status;
}

absl::Status Step::PlanCall(EngineState& state, ComputeCall& call) {
  PoolState& pool = state.pool(pool_);
  call.result() = ComputeResult{};
  if (absl::Status s = Admit(state, call); !s.ok()) {
    Abandon(state, call);  // a prefill between chunks gives its sequence back
    return s;
  }
  Entry entry{.call = &call};
  if (PrefillProgress* p = call.progress()) {
    // The next chunk of a prefill under way: its plan must still hold (a Free, Truncate or Grow in
    // between, or the session's end, changed it: its blocks may be someone else's by now).
    if (absl::Status s = p->StillHolds(pool.cache(), call.session().id); !s.ok()) {
      call.EndProgress();
      return s;
    }
    KVPOOL_RETURN_IF_ERROR(ExtendWindow(state, call));
  } else {
    const absl::Status planned = PlanNew(state, call, &entry);
    // The new sequence matched what a promotion held for it (or the call failed): either way
    // the hold has done its work.
    if (call.promotion.has_value()) {
      ReleaseHold(state, *call.promotion, /*adopted=*/planned.ok());
      call.promotion.reset();
    }
    KVPOOL_RETURN_IF_ERROR(planned);
  }
  const std::span<const model::PlannedItem> items =
      call.progress() ? std::span(&call.progress()->item(), 1) : std::span(entry.decode);
  // Every block the step reads or writes stays out of the free list until the step has run, even
  // if its sequence is freed (or its client dies) meanwhile, and even if a later call of this
  // step evicts it.
  KVPOOL_CHECK_OK(pool.cache().MarkInFlight(model::BlocksOf(items), fence_));
  KVPOOL_CHECK_OK(pool.cache().MarkStatesInFlight(model::StatesOf(items), fence_));
  if (pool.cache().window() != nullptr) {
    KVPOOL_CHECK_OK(pool.cache().MarkWindowInFlight(model::WindowBlocksOf(items), fence_));
  }
  for (const model::PlannedItem& item : items) in_step_.insert(item.sequence);
  entries_.push_back(std::move(entry));
  return absl::OkStatus();
}

absl::Status Step::ExtendWindow(EngineState& state, ComputeCall& call) {
  PoolState& pool = state.pool(pool_);
  DevicePlan plan;
  absl::Status s =
      call.progress()->ExtendWindow(pool.cache(), call.session().id, call.chunk, &plan);
  if (s.ok()) {
    const absl::StatusOr<Fence> carried = pool.Carry(plan);
    if (carried.ok() && carried->value != 0) prepared_ = *carried;
    if (!carried.ok()) {
      ++state.call_counters.device_failures;
      s = absl::InternalError(fmt::format("device: {}", carried.status().message()));
    }
  }
  // A prefill that cannot go on gives its sequence back (or what it added to one).
  if (!s.ok()) Abandon(state, call);
  return s;
}

absl::Status Step::PlanNew(EngineState& state, ComputeCall& call, Entry* entry) {
  PoolState& pool = state.pool(pool_);
  const ComputeRequest& r = call.request();
  const Session& s = call.session();
  for (SequenceId id : Names(r)) {
    const Sequence* seq = pool.cache().Find(id);
    // (Only the session's own sequences: another's gets PERMISSION_DENIED from the plan.)
    if (in_step_.contains(id) && seq != nullptr && seq->session == s.id) {
      return absl::FailedPreconditionError(
          fmt::format("sequence {} is already in a model step", id.value()));
    }
  }
  DevicePlan plan;
  std::vector<TableChange> changes;
  model::PlannedItem item;
  if (r.prefill()) {
    NamespaceId ns = state.OwnNamespace(s);
    if (r.creates()) {
      KVPOOL_ASSIGN_OR_RETURN(ns, state.SaltedNamespace(s, r.cache_salt));
    }
    KVPOOL_RETURN_IF_ERROR(model::PlanPrefill(pool.cache(), s.id, ns, r.sequence, r.tokens,
                                              r.priority, limits_, &item, &plan, &changes,
                                              call.chunk));
  } else {
    KVPOOL_RETURN_IF_ERROR(
        model::PlanDecode(pool.cache(), s.id, r.decode, limits_, &entry->decode, &plan, &changes));
  }
  const absl::StatusOr<Fence> carried = pool.Carry(plan);
  if (!carried.ok()) {
    // The device work was not queued: undo the plan at once, while nothing else has changed.
    if (item.created) {
      KVPOOL_CHECK_OK(pool.cache().Free(s.id, item.sequence));
    } else {
      pool.cache().RevertGrow(s.id, changes);
    }
    entry->decode.clear();
    ++state.call_counters.device_failures;
    return absl::InternalError(fmt::format("device: {}", carried.status().message()));
  }
  if (carried->value != 0) prepared_ = *carried;  // one stream, in order: the last covers all
  // Copied now, under the lock: the step reads them without it.
  auto penalized = [&r](size_t i) {
    const model::SamplingParams* p = r.sampling_for(i);
    return p != nullptr && p->penalized();
  };
  if (r.prefill()) {
    if (penalized(0)) item.history = model::PenaltyHistory(pool.cache(), item);
    call.StartProgress(std::move(item));
  } else {
    for (size_t i = 0; i < entry->decode.size(); ++i) {
      if (penalized(i))
        entry->decode[i].history = model::PenaltyHistory(pool.cache(), entry->decode[i]);
    }
  }
  return absl::OkStatus();
}

absl::Status Step::Launch(model::StepModel& model, const Clock& clock) {
  if (entries_.empty()) return absl::OkStatus();
  items_.clear();
  checkpoints_.clear();
  checkpoint_ranges_.clear();
  model::StepOptions options;
  // A sequence's state-space state is its slot in the pool's state group, advanced in place.
  const auto state_of = [&](BlockId slot) -> std::span<float> {
    if (slot == kInvalidBlock) return {};
    return {reinterpret_cast<float*>(view_.state(slot.value())),
            static_cast<size_t>(model.state_bytes() / sizeof(float))};
  };
  // The state checkpoints the core planned inside this step's part of each item.
  const auto add_checkpoints = [&](const model::PlannedItem& item, const model::StepItem& step) {
    const size_t first = checkpoints_.size();
    model::StepCheckpoints(item, step.start, step.start + static_cast<int64_t>(step.tokens.size()),
                           view_, model.state_bytes(), &checkpoints_);
    checkpoint_ranges_.emplace_back(first, checkpoints_.size() - first);
  };
  for (Entry& e : entries_) {
    const ComputeRequest& r = e.call->request();
    e.first = items_.size();
    if (const PrefillProgress* p = e.call->progress()) {
      model::StepItem chunk = p->NextChunk(e.call->chunk);
      if (static_cast<int64_t>(chunk.tokens.size()) == p->left()) {
        // The last chunk: its prediction is the call's answer (earlier ones are discarded).
        chunk.sampling = r.sampling_for(0);
      }
      chunk.state = state_of(p->item().state_slot);
      add_checkpoints(p->item(), chunk);
      items_.push_back(chunk);
    } else {
      for (size_t i = 0; i < e.decode.size(); ++i) {
        items_.push_back(e.decode[i].AsStepItem());
        items_.back().sampling = r.sampling_for(i);
        items_.back().state = state_of(e.decode[i].state_slot);
        add_checkpoints(e.decode[i], items_.back());
      }
    }
    e.count = items_.size() - e.first;
    options.top_k = std::max(options.top_k, r.top_k);
    options.logprobs = options.logprobs || r.logprobs;
  }
  for (size_t i = 0; i < items_.size(); ++i) {  // now that checkpoints_ no longer moves
    items_[i].checkpoints =
        std::span(checkpoints_).subspan(checkpoint_ranges_[i].first, checkpoint_ranges_[i].second);
  }
  if (prepared_.value != 0) {
    if (absl::Status s = device_->Synchronize(prepared_); !s.ok()) {
      return absl::InternalError(fmt::format("device: {}", s.message()));
    }
  }
  const int64_t start = clock.NowNanos();
  const absl::Status stepped = model.Step(view_, items_, options, &results_);
  busy_ns_ = clock.NowNanos() - start;
  return stepped;
}

void Step::Finish(EngineState& state, const absl::Status& launched) {
  PoolState& pool = state.pool(pool_);
  pool.steps().Complete(fence_);
  pool.cache().ReclaimRetired();  // blocks released while the step ran can go now
  if (entries_.empty()) return;
  if (!launched.ok()) {
    Logger("daemon").error("model step failed: {}", launched.ToString());
    if (absl::Status device = pool.device().status(); !device.ok() && state.health.ok()) {
      state.health = device;  // sticky: the arena's contents are undefined from here on
      Logger("daemon").critical("device failed, kvpoold stops serving: {}", device.ToString());
    }
    Undo(state, absl::InternalError(fmt::format("model step failed: {}", launched.message())));
    return;
  }
  ModelCounters& m = pool.model_counters;
  ++m.steps;
  m.step_sequences += items_.size();
  m.busy_ns += busy_ns_;
  m.step_seconds.Observe(static_cast<double>(busy_ns_) * 1e-9);
  m.step_batch.Observe(static_cast<double>(items_.size()));
  for (Entry& e : entries_) FinishEntry(state, e);
  pool.StagePublished();  // what the step published goes down to the tiers
}

void Step::FinishEntry(EngineState& state, Entry& e) {
  PoolState& pool = state.pool(pool_);
  ComputeCall& call = *e.call;
  if (PrefillProgress* p = call.progress()) {
    p->Advance(static_cast<int64_t>(items_[e.first].tokens.size()));
    if (!p->done()) {
      p->SlideWindow(pool.cache(), call.session().id);
      // More chunks to go: this one's prediction is mid-prompt, not an answer.
      ++pool.model_counters.prefill_chunks;
      return;
    }
  }
  if (absl::Status gave_up = call.context().Check(); !gave_up.ok()) {
    GiveBack(state, e, gave_up);
    return;
  }
  ComputeResult& r = call.result();
  r.step_sequences = static_cast<int32_t>(items_.size());
  const std::span<const model::PlannedItem> items =
      call.progress() ? std::span(&call.progress()->item(), 1) : std::span(e.decode);
  for (size_t i = 0; i < items.size(); ++i) {
    const model::PlannedItem& item = items[i];
    if (absl::Status s = model::FinishItem(pool.cache(), call.session().id, item);
        absl::IsFailedPrecondition(s)) {
      // The tokens are computed and the call answered; only publishing them was refused: the
      // client committed other tokens for a block this sequence shares (a KV client's error).
      // The sequence stays unpublished from there on.
      Logger("daemon").warn("sequence {}: computed tokens not published: {}", item.sequence.value(),
                            s.message());
    } else if (!s.ok() && r.status.ok()) {
      r.status = s;  // NOT_FOUND: the client freed the sequence while the step ran
    }
    model::ItemResult result = std::move(results_[e.first + i]);
    KeepTopK(call.request().top_k, &result);
    r.results.push_back(std::move(result));
    r.sequences.push_back(item.sequence);
    const Sequence* seq = pool.cache().Find(item.sequence);
    r.lengths.push_back(seq ? seq->num_tokens : 0);
  }
  ModelCounters& m = pool.model_counters;
  if (call.progress() != nullptr) {
    const model::PlannedItem& item = call.progress()->item();
    r.reused = item.reused;
    r.computed = static_cast<int64_t>(item.tokens.size());
    ++m.prefill_calls;
    m.prefill_reused += static_cast<uint64_t>(item.reused);
    m.prefill_computed += item.tokens.size();
    call.EndProgress();
  } else {
    m.decode_tokens += e.decode.size();
  }
}

void Step::GiveBack(EngineState& state, Entry& e, const absl::Status& gave_up) {
  PoolState& pool = state.pool(pool_);
  ComputeCall& call = *e.call;
  ++state.call_counters.gave_up;
  if (call.request().creates() && call.progress() != nullptr &&
      call.progress()->StillHolds(pool.cache(), call.session().id).ok()) {
    ++state.call_counters.released_on_give_up;
  }
  // The caller will never see the answer: what the call made (a new sequence, or the tokens it
  // added) must not outlive it.
  Abandon(state, call, /*step_ran=*/true);
  for (const model::PlannedItem& item : e.decode) {
    GiveBackItem(pool.cache(), call.session().id, item, /*ran=*/true);
  }
  call.result().status = gave_up;
}

void Step::Undo(EngineState& state, const absl::Status& why) {
  PoolState& pool = state.pool(pool_);
  for (Entry& e : entries_) {
    ComputeCall& call = *e.call;
    Abandon(state, call, /*step_ran=*/true);  // (a failed step may have run in part)
    for (const model::PlannedItem& item : e.decode) {
      GiveBackItem(pool.cache(), call.session().id, item, /*ran=*/true);
    }
    call.result().status = why;
  }
}

void Step::Abandon(EngineState& state, ComputeCall& call, bool step_ran) {
  if (call.promotion.has_value()) {
    ReleaseHold(state, *call.promotion, /*adopted=*/false);
    call.promotion.reset();
  }
  PoolState& pool = state.pool_of(call.session());
  const PrefillProgress* p = call.progress();
  if (p == nullptr) return;
  if (p->StillHolds(pool.cache(), call.session().id).ok()) {
    GiveBackItem(pool.cache(), call.session().id, p->item(), step_ran || p->computed() > 0);
  }
  call.EndProgress();
}

}  // namespace kvpool::daemon
