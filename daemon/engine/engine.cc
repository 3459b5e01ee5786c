// Engine: sessions, control calls and compute submission (admin in engine_admin.cc).

#include "daemon/engine/engine.h"

#include "daemon/engine/step.h"
#include "daemon/engine/step_runner.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {
namespace {

spdlog::logger& Log() { return Logger("daemon"); }

absl::Status DeviceError(const absl::Status& s) {
  return absl::InternalError(fmt::format("device: {}", s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       kernels::Device* device,
                                                       model::StepModel* model) {
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<EngineState> state, EngineState::Create(options, device));
  ModelInfo info;
  if (model != nullptr) {
    info = {.name = options.model_name.empty() ? "model" : options.model_name,
            .vocab_size = model->config().vocab_size,
            .max_position = model->config().max_position};
  }
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(state), model, std::move(info)));
  if (model != nullptr) {
    engine->runner_ = std::make_unique<StepRunner>(engine.get(), options.clock,
                                                   options.gather_window_ns, options.scheduler);
  }
  return engine;
}

Engine::Engine(std::unique_ptr<EngineState> state, model::StepModel* model, ModelInfo model_info)
    : layout_(state->layout()),
      epoch_(state->options().epoch),
      clock_(state->options().clock),
      device_(&state->device()),
      model_(model),
      model_info_(std::move(model_info)),
      started_ns_(state->now()),
      state_(std::move(state)) {}

Engine::~Engine() { StopCompute(); }

absl::StatusOr<std::shared_ptr<const Session>> Engine::OpenSession(SessionSpec spec) {
  absl::MutexLock lock(&mu_);
  const auto& quotas = state_->options().tenant_quota_blocks;
  if (auto it = quotas.find(spec.tenant); it != quotas.end()) {
    KVPOOL_RETURN_IF_ERROR(state_->cache().SetNamespaceQuota(
        state_->NamespaceOf(spec.tenant, spec.model), it->second));
  }
  return state_->Open(std::move(spec));
}

std::shared_ptr<const Session> Engine::Authenticate(std::string_view token) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->FindByToken(token);
}

int64_t Engine::EndSession(SessionId id, SessionEnd how) {
  int64_t released;
  {
    absl::MutexLock lock(&mu_);
    released = state_->End(id, how);
  }
  if (runner_) runner_->SessionEnded(id);
  return released;
}

absl::StatusOr<PoolGrant> Engine::Grant(std::shared_ptr<const Session> session) const {
  PoolGrant grant;
  {
    absl::ReaderMutexLock lock(&mu_);
    KVPOOL_RETURN_IF_ERROR(state_->CheckLive(session->id));
    KVPOOL_ASSIGN_OR_RETURN(grant.arena, state_->arena().Export());
    KVPOOL_ASSIGN_OR_RETURN(grant.generation_table, state_->generations().Export());
    grant.daemon_version = state_->options().daemon_version;
  }
  grant.session = std::move(session);
  grant.epoch = epoch_;
  grant.layout = layout_;
  grant.model = model_info_;
  return grant;
}

absl::Status Engine::Admit(const Session& s, bool creates) const {
  if (!state_->health.ok()) {
    return absl::UnavailableError(
        fmt::format("kvpoold stopped serving: {}", state_->health.message()));
  }
  if (absl::Status live = state_->CheckLive(s.id); !live.ok()) {
    ++state_->call_counters.session_ended;
    return live;
  }
  if (creates && state_->draining) {
    return absl::UnavailableError("kvpoold is draining: no new sequences");
  }
  return absl::OkStatus();
}

absl::Status Engine::Complete(const Session& s, Fence fence, std::span<const SequenceId> created,
                              const CallContext& context) {
  if (fence.value != 0) {
    if (absl::Status waited = device_->Synchronize(fence); !waited.ok()) {
      Log().critical("device failed, kvpoold stops serving: {}", waited.ToString());
      {
        absl::MutexLock lock(&mu_);
        if (state_->health.ok()) state_->health = waited;
      }
      Release(s, created);
      return DeviceError(waited);
    }
  }
  if (absl::Status gave_up = context.Check(); !gave_up.ok() && !created.empty()) {
    // The caller will never learn of these sequences: they must not outlive the call.
    Release(s, created);
    absl::MutexLock lock(&mu_);
    ++state_->call_counters.gave_up;
    state_->call_counters.released_on_give_up += created.size();
    return gave_up;
  }
  return absl::OkStatus();
}

void Engine::Release(const Session& s, std::span<const SequenceId> created) {
  absl::MutexLock lock(&mu_);
  for (SequenceId id : created) {
    // Gone already when the session ended meanwhile (its end released everything).
    const Sequence* seq = state_->cache().Find(id);
    if (seq != nullptr && seq->session == s.id) KVPOOL_CHECK_OK(state_->cache().Free(s.id, id));
  }
}

absl::StatusOr<Tables> Engine::Allocate(const Session& s, std::span<const AllocateRequest> requests,
                                        const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  std::vector<AllocateRequest> items(requests.begin(), requests.end());
  for (AllocateRequest& item : items) item.ns = s.ns;
  Tables out;
  std::vector<SequenceId> created;
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
    KVPOOL_RETURN_IF_ERROR(Admit(s, /*creates=*/true));
    std::vector<AllocateResult> results;
    DevicePlan plan;
    KVPOOL_RETURN_IF_ERROR(state_->cache().AllocateBatch(s.id, items, &results, &plan));
    for (const AllocateResult& r : results) created.push_back(r.sequence);
    const absl::StatusOr<Fence> carried = state_->Carry(plan);
    if (!carried.ok()) {
      KVPOOL_CHECK_OK(state_->cache().FreeBatch(s.id, created));
      ++state_->call_counters.device_failures;
      return DeviceError(carried.status());
    }
    fence = *carried;
    for (const AllocateResult& r : results) {
      state_->AppendTable(*state_->cache().Find(r.sequence), 0, r.matched_tokens, &out);
    }
  }
  KVPOOL_RETURN_IF_ERROR(Complete(s, fence, created, context));
  return out;
}

absl::StatusOr<Tables> Engine::Grow(const Session& s, std::span<const GrowRequest> requests,
                                    const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  Tables out;
  std::vector<int64_t> old_lengths;
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
    KVPOOL_RETURN_IF_ERROR(Admit(s, /*creates=*/false));
    DevicePlan plan;
    std::vector<TableChange> changes;
    KVPOOL_RETURN_IF_ERROR(state_->cache().GrowBatch(s.id, requests, &plan, &changes));
    const absl::StatusOr<Fence> carried = state_->Carry(plan);
    if (!carried.ok()) {
      state_->cache().RevertGrow(s.id, changes);
      ++state_->call_counters.device_failures;
      return DeviceError(carried.status());
    }
    fence = *carried;
    for (const TableChange& c : changes) {
      state_->AppendTable(*state_->cache().Find(c.sequence), c.first_changed, 0, &out);
      old_lengths.push_back(c.old_num_tokens);
    }
  }
  KVPOOL_RETURN_IF_ERROR(Complete(s, fence, {}, CallContext::Uncancellable()));
  if (absl::Status gave_up = context.Check(); !gave_up.ok()) {
    // The caller never learns of the new blocks: take the growth back (a copy-on-write copy, which
    // has run, stays in the table: it holds the same tokens as the block it replaced).
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < out.slices.size(); ++i) {
      const Sequence* seq = state_->cache().Find(out.slices[i].sequence);
      if (seq != nullptr && seq->session == s.id && seq->num_tokens == out.slices[i].num_tokens &&
          old_lengths[i] < seq->num_tokens) {
        KVPOOL_CHECK_OK(state_->cache().Truncate(s.id, seq->id, old_lengths[i]));
      }
    }
    ++state_->call_counters.gave_up;
    return gave_up;
  }
  return out;
}

absl::Status Engine::Truncate(const Session& s, SequenceId sequence, int64_t num_tokens,
                              const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, /*creates=*/false));
  return state_->cache().Truncate(s.id, sequence, num_tokens);
}

absl::StatusOr<Tables> Engine::Fork(const Session& s, SequenceId sequence,
                                    const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  Tables out;
  SequenceId child;
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
    KVPOOL_RETURN_IF_ERROR(Admit(s, /*creates=*/true));
    DevicePlan plan;
    KVPOOL_ASSIGN_OR_RETURN(child, state_->cache().Fork(s.id, sequence, &plan));
    const absl::StatusOr<Fence> carried = state_->Carry(plan);
    if (!carried.ok()) {
      KVPOOL_CHECK_OK(state_->cache().Free(s.id, child));
      ++state_->call_counters.device_failures;
      return DeviceError(carried.status());
    }
    fence = *carried;
    state_->AppendTable(*state_->cache().Find(child), 0, 0, &out);
  }
  KVPOOL_RETURN_IF_ERROR(Complete(s, fence, std::span(&child, 1), context));
  return out;
}

absl::Status Engine::Commit(const Session& s, SequenceId sequence, int64_t num_tokens,
                            std::span<const int32_t> new_tokens, const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, /*creates=*/false));
  return state_->cache().Commit(s.id, sequence, num_tokens, new_tokens);
}

absl::Status Engine::Free(const Session& s, std::span<const SequenceId> sequences, OnFree on_free,
                          const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, /*creates=*/false));
  return state_->cache().FreeBatch(s.id, sequences, on_free);
}

absl::StatusOr<int64_t> Engine::MatchPrefix(const Session& s,
                                            std::span<const int32_t> tokens) const {
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, /*creates=*/false));
  return state_->cache().MatchPrefix(s.ns, tokens);
}

void Engine::Submit(std::unique_ptr<ComputeCall> call) {
  if (runner_ == nullptr) {
    call->result().status =
        absl::FailedPreconditionError("kvpoold runs no model (config: model { name: \"none\" })");
    call->Complete();
    return;
  }
  runner_->Submit(std::move(call));
}

void Engine::StopCompute() {
  if (runner_) runner_->Stop();
}

void Engine::RunStep(std::span<ComputeCall* const> calls) {
  Step step(calls, model_->config().vocab_size);
  {
    absl::MutexLock lock(&mu_);
    step.Plan(*state_);
  }
  // The step itself, outside the lock: control calls go on meanwhile.
  const absl::Status launched = step.Launch(*model_, *clock_);
  absl::MutexLock lock(&mu_);
  step.Finish(*state_, launched);
}

void Engine::Abandon(ComputeCall& call, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  const bool created = call.request().creates() && call.progress() != nullptr &&
                       call.progress()->StillHolds(state_->cache(), call.session().id).ok();
  Step::Abandon(*state_, call);
  call.result().status = why;
  if (absl::IsCancelled(why) || absl::IsDeadlineExceeded(why)) {
    ++state_->call_counters.gave_up;
    if (created) ++state_->call_counters.released_on_give_up;
  }
}

}  // namespace kvpool::daemon
