// KvPoolService: authentication, the call life cycle and the control calls (compute calls in
// service_compute.cc, admin calls in service_admin.cc).

#include "daemon/edge/service.h"

#include <utility>

#include "daemon/edge/grpc_call_context.h"
#include "kvpool/v1/wire.h"

namespace kvpool::daemon {

absl::StatusOr<std::shared_ptr<const Session>> KvPoolService::Authenticate(const Context* context,
                                                                           bool admin) const {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(wire::kSessionTokenKey);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError("no kvpool-session-token metadata: attach first");
  }
  std::shared_ptr<const Session> session =
      engine_->Authenticate(std::string_view(it->second.data(), it->second.size()));
  if (session == nullptr) {
    return absl::UnauthenticatedError(
        "unknown session token (the session ended or the daemon restarted)");
  }
  if (admin && !session->spec.admin) {
    return absl::PermissionDeniedError("admin call from a session without the admin role");
  }
  return session;
}

bool KvPoolService::BeginCall() {
  absl::MutexLock lock(&calls_mu_);
  if (stopping_) return false;
  ++calls_;
  return true;
}

void KvPoolService::EndCall() {
  absl::MutexLock lock(&calls_mu_);
  --calls_;
}

bool KvPoolService::Stopping() {
  absl::MutexLock lock(&calls_mu_);
  return stopping_;
}

void KvPoolService::Stop() {
  absl::MutexLock lock(&calls_mu_);
  stopping_ = true;
}

bool KvPoolService::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&calls_mu_);
  return calls_mu_.AwaitWithDeadline(absl::Condition(
                                         +[](int64_t* calls) { return *calls == 0; }, &calls_),
                                     deadline);
}

KvPoolService::Unary* KvPoolService::Allocate(Context* c, const v1::AllocateRequest* q,
                                              v1::AllocateResponse* r) {
  Unary* reactor = Run(c, false, [&](const Session& s) -> absl::Status {
    const std::vector<AllocateRequest> items = FromProto(*q);
    absl::StatusOr<Tables> tables = engine_->Allocate(s, items, GrpcCallContext(c, clock_));
    if (!tables.ok()) return tables.status();
    ToProto(*tables, r->mutable_sequences());
    return absl::OkStatus();
  });
  NotifyEvents();  // room may have been made by evicting cached blocks
  return reactor;
}

KvPoolService::Unary* KvPoolService::Grow(Context* c, const v1::GrowRequest* q,
                                          v1::GrowResponse* r) {
  Unary* reactor = Run(c, false, [&](const Session& s) -> absl::Status {
    absl::StatusOr<std::vector<GrowRequest>> items = FromProto(*q);
    if (!items.ok()) return items.status();
    absl::StatusOr<Tables> tables = engine_->Grow(s, *items, GrpcCallContext(c, clock_));
    if (!tables.ok()) return tables.status();
    ToProto(*tables, r);
    return absl::OkStatus();
  });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::Truncate(Context* c, const v1::TruncateRequest* q,
                                              v1::TruncateResponse*) {
  return Run(c, false, [&](const Session& s) {
    return engine_->Truncate(s, SequenceId(q->sequence_id()), q->num_tokens(),
                             GrpcCallContext(c, clock_));
  });
}

KvPoolService::Unary* KvPoolService::Fork(Context* c, const v1::ForkRequest* q,
                                          v1::ForkResponse* r) {
  Unary* reactor = Run(c, false, [&](const Session& s) -> absl::Status {
    absl::StatusOr<Tables> child =
        engine_->Fork(s, SequenceId(q->sequence_id()), GrpcCallContext(c, clock_));
    if (!child.ok()) return child.status();
    ToProto(*child, 0, 0, r->mutable_sequence());
    return absl::OkStatus();
  });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::Commit(Context* c, const v1::CommitRequest* q,
                                            v1::CommitResponse*) {
  Unary* reactor = Run(c, false, [&](const Session& s) {
    return engine_->Commit(s, SequenceId(q->sequence_id()), q->num_tokens(),
                           Tokens(q->new_tokens()), GrpcCallContext(c, clock_));
  });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::Free(Context* c, const v1::FreeRequest* q, v1::FreeResponse*) {
  Unary* reactor = Run(c, false, [&](const Session& s) {
    std::vector<SequenceId> ids;
    ids.reserve(static_cast<size_t>(q->sequence_ids_size()));
    for (uint64_t id : q->sequence_ids()) ids.push_back(SequenceId(id));
    return engine_->Free(s, ids, q->commit() ? OnFree::kCommit : OnFree::kDiscard,
                         GrpcCallContext(c, clock_));
  });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::MatchPrefix(Context* c, const v1::MatchPrefixRequest* q,
                                                 v1::MatchPrefixResponse* r) {
  return Run(c, false, [&](const Session& s) -> absl::Status {
    absl::StatusOr<int64_t> matched = engine_->MatchPrefix(s, Tokens(q->tokens()));
    if (!matched.ok()) return matched.status();
    r->set_matched_tokens(*matched);
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Ping(Context* c, const v1::PingRequest*, v1::PingResponse*) {
  return Run(c, false, [](const Session&) { return absl::OkStatus(); });
}

}  // namespace kvpool::daemon
