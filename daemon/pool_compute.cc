// DaemonPool::RunStep: the model's steps over the pool (see pool.h).

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "daemon/pool.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {
namespace {

// The sequences a call names; SequenceId(0) (a new sequence) names none.
std::vector<SequenceId> Names(const ComputeCall& call) {
  std::vector<SequenceId> out;
  if (call.prefill) {
    if (call.sequence != SequenceId(0)) out.push_back(call.sequence);
  } else {
    for (const model::DecodeInput& in : call.decode) out.push_back(in.sequence);
  }
  return out;
}

}  // namespace

void DaemonPool::set_model(std::string name, int32_t vocab_size, int32_t max_position) {
  absl::MutexLock lock(&mu_);
  model_.name = std::move(name);
  model_.vocab_size = vocab_size;
  model_.max_position = max_position;
}

absl::Status DaemonPool::CheckPlanned(const ComputeCall& call) const {
  const model::PlannedItem& item = call.items[0];
  const Sequence* seq = cache_->Find(item.sequence);
  const int64_t end = item.start + static_cast<int64_t>(item.tokens.size());
  const bool same = seq != nullptr && seq->session == call.session->id && seq->num_tokens == end &&
                    seq->table.size() >= item.table.size() &&
                    std::equal(item.table.begin(), item.table.end(), seq->table.begin(),
                               [](int32_t a, BlockId b) { return a == b.value(); });
  if (same) return absl::OkStatus();
  return absl::AbortedError(fmt::format(
      "sequence {} was freed or changed while its prefill was in progress ({} of {} prompt "
      "tokens computed)",
      item.sequence.value(), call.computed, item.tokens.size()));
}

void DaemonPool::Abandon(ComputeCall* call) {
  absl::MutexLock lock(&mu_);
  if (!call->planned) return;
  if (CheckPlanned(*call).ok()) {
    for (const model::PlannedItem& item : call->items) {
      model::UndoItem(*cache_, call->session->id, item);
    }
  }
  call->items.clear();
  call->planned = false;
}

void DaemonPool::RunStep(model::StepModel* model, std::span<ComputeCall* const> calls) {
  const int32_t vocab = model->config().vocab_size;
  const kernels::KvPoolView view{arena_->base(), layout_};
  std::vector<ComputeCall*> live;  // the calls in the step
  std::vector<model::StepItem> step;
  std::vector<model::ItemResult> results;
  absl::Status step_status;
  int32_t top_k = 0;
  Fence prepared;  // the plan's device work
  Fence fence;     // the step's
  auto undo = [&](const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (ComputeCall* call : live) {
      for (const model::PlannedItem& item : call->items) {
        model::UndoItem(*cache_, call->session->id, item);
      }
      call->items.clear();
      call->planned = false;
      call->status = why;
    }
  };
  {
    absl::MutexLock lock(&mu_);
    DevicePlan plan;
    absl::flat_hash_set<SequenceId> in_step;
    for (ComputeCall* call : calls) {
      call->finished = true;
      if (call->planned) {
        // A prefill's next chunk: its plan stands if its sequence is still as planned (a Free,
        // Truncate or Grow in between, or the session's end, changed it: its blocks may be
        // someone else's by now, so nothing more is written).
        if (absl::Status s = CheckPlanned(*call); !s.ok()) {
          call->items.clear();
          call->planned = false;
          call->status = s;
          continue;
        }
        in_step.insert(call->items[0].sequence);
        live.push_back(call);
        continue;
      }
      call->items.clear();
      const std::vector<SequenceId> names = Names(*call);
      if (draining_ && call->prefill && call->sequence == SequenceId(0)) {
        call->status = absl::UnavailableError("kvpoold is draining: no new sequences");
        continue;
      }
      // (Only the session's own sequences: another's gets PERMISSION_DENIED from the plan.)
      if (auto clash = std::find_if(names.begin(), names.end(),
                                    [&](SequenceId id) {
                                      const Sequence* seq = cache_->Find(id);
                                      return in_step.contains(id) && seq != nullptr &&
                                             seq->session == call->session->id;
                                    });
          clash != names.end()) {
        call->status = absl::FailedPreconditionError(
            fmt::format("sequence {} is already in a model step", clash->value()));
        continue;
      }
      DevicePlan own;
      const Session& s = *call->session;
      if (call->prefill) {
        call->items.resize(1);
        call->status = model::PlanPrefill(*cache_, s.id, s.ns, call->sequence, call->tokens,
                                          call->priority, vocab, &call->items[0], &own);
      } else {
        call->status = model::PlanDecode(*cache_, s.id, call->decode, vocab, &call->items, &own);
      }
      if (!call->status.ok()) {
        call->items.clear();
        continue;
      }
      plan.copies.insert(plan.copies.end(), own.copies.begin(), own.copies.end());
      plan.fills.insert(plan.fills.end(), own.fills.begin(), own.fills.end());
      for (const model::PlannedItem& item : call->items) in_step.insert(item.sequence);
      if (call->prefill) {
        call->planned = true;
        call->computed = 0;
      }
      live.push_back(call);
    }
    if (live.empty()) return;

    // Copies and fills run on the transfer stream; the step waits for them below.
    absl::StatusOr<Fence> carried = Carry(plan);
    if (!carried.ok()) {
      undo(absl::InternalError(fmt::format("device: {}", carried.status().message())));
      return;
    }
    prepared = *carried;
    std::vector<model::PlannedItem> all;
    for (ComputeCall* call : live) {
      top_k = std::max(top_k, call->top_k);
      if (call->prefill) {
        // This step's chunk of the prompt: at least one token, at most `chunk`.
        const model::PlannedItem& item = call->items[0];
        const int64_t left = static_cast<int64_t>(item.tokens.size()) - call->computed;
        const int64_t n = std::clamp<int64_t>(call->chunk, 1, left);
        step.push_back({std::span(item.tokens)
                            .subspan(static_cast<size_t>(call->computed), static_cast<size_t>(n)),
                        item.start + call->computed, item.table});
      } else {
        for (const model::PlannedItem& item : call->items) step.push_back(item.AsStepItem());
      }
      all.insert(all.end(), call->items.begin(), call->items.end());
    }
    // Every block the step reads or writes stays out of the free list until it has run, even if
    // its sequence is freed (or its client dies) meanwhile.
    fence = steps_->Issue();
    KVPOOL_CHECK_OK(cache_->MarkInFlight(model::BlocksOf(all), fence));
  }

  // The step itself, outside the lock: control calls go on meanwhile.
  absl::Status waited = prepared.value != 0 ? device_->Synchronize(prepared) : absl::OkStatus();
  const absl::Time start = absl::Now();
  if (waited.ok()) step_status = model->Step(view, step, {.top_k = top_k}, &results);
  const absl::Duration busy = absl::Now() - start;
  steps_->Complete(fence);

  absl::MutexLock lock(&mu_);
  // Blocks released while the step ran (a client died, a sequence was freed) can go now.
  cache_->ReclaimRetired();
  if (!waited.ok()) step_status = waited;
  if (!step_status.ok()) {
    Logger("daemon").error("model step failed: {}", step_status.ToString());
    undo(absl::InternalError(fmt::format("model step failed: {}", step_status.message())));
    return;
  }
  ++model_.steps;
  model_.step_sequences += step.size();
  model_.busy += busy;
  size_t next = 0;
  for (ComputeCall* call : live) {
    if (call->prefill) {
      call->computed += static_cast<int64_t>(step[next].tokens.size());
      if (call->computed < static_cast<int64_t>(call->items[0].tokens.size())) {
        // More chunks to go: the result of this one is a mid-prompt prediction, not an answer.
        call->finished = false;
        ++model_.prefill_chunks;
        ++next;
        continue;
      }
      call->planned = false;
    }
    call->results.assign(std::make_move_iterator(results.begin() + static_cast<ptrdiff_t>(next)),
                         std::make_move_iterator(
                             results.begin() + static_cast<ptrdiff_t>(next + call->items.size())));
    next += call->items.size();
    call->step_sequences = static_cast<int32_t>(step.size());
    call->lengths.clear();
    for (model::ItemResult& r : call->results) {
      if (static_cast<int32_t>(r.top.size()) > call->top_k)
        r.top.resize(static_cast<size_t>(call->top_k));
    }
    for (const model::PlannedItem& item : call->items) {
      absl::Status s = model::FinishItem(*cache_, call->session->id, item);
      if (!s.ok() && call->status.ok()) call->status = s;
      const Sequence* seq = cache_->Find(item.sequence);
      call->lengths.push_back(seq ? seq->num_tokens : 0);
    }
    if (call->prefill) {
      ++model_.prefill_calls;
      model_.prefill_reused += static_cast<uint64_t>(call->items[0].reused);
      model_.prefill_computed += call->items[0].tokens.size();
    } else {
      model_.decode_tokens += call->items.size();
    }
  }
}

}  // namespace kvpool::daemon
