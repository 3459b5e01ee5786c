// KvPoolService: authentication, the call life cycle and the control calls (compute calls in
// service_compute.cc, admin calls in service_admin.cc).

#include "daemon/edge/service.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/algorithm/container.h"
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

void KvPoolService::Stop() {
  absl::MutexLock lock(&calls_mu_);
  stopping_ = true;
}

bool KvPoolService::WaitIdle(int64_t deadline_ns) {
  absl::MutexLock lock(&calls_mu_);
  return clock_->AwaitUntil(calls_mu_,
                            absl::Condition(
                                +[](int64_t* calls) { return *calls == 0; }, &calls_),
                            deadline_ns);
}

KvPoolService::Unary* KvPoolService::Allocate(Context* c, const v1::AllocateRequest* q,
                                              v1::AllocateResponse* r) {
  return Run(c, false, [&](const Session& s) -> absl::Status {
    const std::vector<AllocateRequest> items = FromProto(*q);
    std::vector<std::string> salts;  // none, or one per item
    if (absl::c_any_of(q->items(), [](const auto& item) { return !item.cache_salt().empty(); })) {
      for (const v1::AllocateItem& item : q->items()) salts.push_back(item.cache_salt());
    }
    absl::StatusOr<Tables> tables = engine_->Allocate(s, items, GrpcCallContext(c, clock_), salts);
    if (!tables.ok()) return tables.status();
    ToProto(*tables, r->mutable_sequences());
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Grow(Context* c, const v1::GrowRequest* q,
                                          v1::GrowResponse* r) {
  return Run(c, false, [&](const Session& s) -> absl::Status {
    absl::StatusOr<std::vector<GrowRequest>> items = FromProto(*q);
    if (!items.ok()) return items.status();
    absl::StatusOr<Tables> tables = engine_->Grow(s, *items, GrpcCallContext(c, clock_));
    if (!tables.ok()) return tables.status();
    ToProto(*tables, r);
    return absl::OkStatus();
  });
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
  return Run(c, false, [&](const Session& s) -> absl::Status {
    absl::StatusOr<Tables> child =
        engine_->Fork(s, SequenceId(q->sequence_id()), GrpcCallContext(c, clock_));
    if (!child.ok()) return child.status();
    ToProto(*child, 0, 0, r->mutable_sequence());
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Commit(Context* c, const v1::CommitRequest* q,
                                            v1::CommitResponse*) {
  return Run(c, false, [&](const Session& s) {
    return engine_->Commit(s, SequenceId(q->sequence_id()), q->num_tokens(),
                           Tokens(q->new_tokens()), GrpcCallContext(c, clock_));
  });
}

KvPoolService::Unary* KvPoolService::Free(Context* c, const v1::FreeRequest* q, v1::FreeResponse*) {
  return Run(c, false, [&](const Session& s) {
    std::vector<SequenceId> ids;
    ids.reserve(static_cast<size_t>(q->sequence_ids_size()));
    for (uint64_t id : q->sequence_ids()) ids.push_back(SequenceId(id));
    return engine_->Free(s, ids, q->commit() ? OnFree::kCommit : OnFree::kDiscard,
                         GrpcCallContext(c, clock_));
  });
}

KvPoolService::Unary* KvPoolService::MatchPrefix(Context* c, const v1::MatchPrefixRequest* q,
                                                 v1::MatchPrefixResponse* r) {
  return Run(c, false, [&](const Session& s) -> absl::Status {
    absl::StatusOr<int64_t> matched = engine_->MatchPrefix(s, Tokens(q->tokens()), q->cache_salt());
    if (!matched.ok()) return matched.status();
    r->set_matched_tokens(*matched);
    return absl::OkStatus();
  });
}

namespace {

// ttl_ms as nanoseconds; past int64 it saturates, which the manager refuses as too long.
int64_t TtlNanos(int64_t ttl_ms) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 1'000'000;
  if (ttl_ms > kMax) return std::numeric_limits<int64_t>::max();
  if (ttl_ms < -kMax) return std::numeric_limits<int64_t>::min();
  return ttl_ms * 1'000'000;
}

// A pin as the protocol shows it, at clock reading `now`.
void PinToProto(const PinInfo& pin, const std::string& pool, int64_t now, v1::PinInfo* out) {
  out->set_pin_id(pin.id.value());
  out->set_session_id(pin.session.value());
  out->set_sequence_id(pin.sequence.value());
  out->set_priority(pin.priority);
  out->set_tokens(pin.tokens);
  out->set_blocks(pin.blocks);
  out->set_expires_in_ms(std::max<int64_t>(0, pin.expires_ns - now) / 1'000'000);
  out->set_pool(pool);
}

}  // namespace

KvPoolService::Unary* KvPoolService::Pin(Context* c, const v1::PinRequest* q, v1::PinResponse* r) {
  return Run(c, false, [&](const Session& s) -> absl::Status {
    const bool by_sequence = q->sequence_id() != 0;
    if (by_sequence == !q->tokens().empty()) {
      return absl::InvalidArgumentError(
          "a pin names exactly one of tokens (a cached prefix) and sequence_id");
    }
    absl::StatusOr<PinInfo> pin =
        by_sequence ? engine_->PinSequence(s, SequenceId(q->sequence_id()), TtlNanos(q->ttl_ms()),
                                           q->priority())
                    : engine_->PinPrefix(s, Tokens(q->tokens()), TtlNanos(q->ttl_ms()),
                                         q->priority(), q->cache_salt());
    if (!pin.ok()) return pin.status();
    PinToProto(*pin, engine_->pool_name(s.pool), clock_->NowNanos(), r->mutable_pin());
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::RenewPin(Context* c, const v1::RenewPinRequest* q,
                                              v1::RenewPinResponse* r) {
  return Run(c, false, [&](const Session& s) -> absl::Status {
    absl::StatusOr<PinInfo> pin = engine_->RenewPin(s, PinId(q->pin_id()), TtlNanos(q->ttl_ms()));
    if (!pin.ok()) return pin.status();
    PinToProto(*pin, engine_->pool_name(s.pool), clock_->NowNanos(), r->mutable_pin());
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Unpin(Context* c, const v1::UnpinRequest* q,
                                           v1::UnpinResponse*) {
  return Run(c, false, [&](const Session& s) { return engine_->Unpin(s, PinId(q->pin_id())); });
}

KvPoolService::Unary* KvPoolService::ListPins(Context* c, const v1::ListPinsRequest* q,
                                              v1::ListPinsResponse* r) {
  return Run(c, false, [&](const Session& s) -> absl::Status {
    if (q->all_sessions() && !s.spec.admin) {
      return absl::PermissionDeniedError("every session's pins: admin sessions only");
    }
    for (const Engine::PinListing& l : engine_->ListPins(q->all_sessions() ? kNoSession : s.id)) {
      PinToProto(l.info, engine_->pool_name(l.pool), clock_->NowNanos(), r->add_pins());
    }
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Ping(Context* c, const v1::PingRequest*, v1::PingResponse*) {
  return Run(c, false, [](const Session&) { return absl::OkStatus(); });
}

}  // namespace kvpool::daemon
