#include "daemon/service.h"

#include <utility>

#include "fmt/format.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/v1/wire.h"

namespace kvpool::daemon {

grpc::Status ToGrpcStatus(const absl::Status& status, grpc::ServerContextBase* context) {
  if (status.ok()) return grpc::Status::OK;
  if (context != nullptr) {
    if (std::optional<Shortfall> shortfall = GetShortfall(status)) {
      context->AddTrailingMetadata(
          wire::kShortfallKey,
          fmt::format("{}:{}", ResourceName(shortfall->resource), shortfall->blocks));
    }
  }
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// A WatchEvents stream: first a snapshot when asked for one (or when the events wanted were
// already dropped from the replay ring), then events in order; with `follow`, it waits for more.
// Deletes itself when gRPC is done with it.
class EventWriter final : public grpc::ServerWriteReactor<v1::WatchEventsResponse> {
 public:
  EventWriter(KvPoolService* service, const v1::WatchEventsRequest& request)
      : service_(service), follow_(request.follow()) {
    DaemonPool* pool = service->pool_;
    next_ = request.from_seq() == 0 ? pool->next_event_seq() : request.from_seq();
    std::vector<v1::KvEvent> probe;
    if (request.snapshot() || !pool->ReadEvents(next_, 0, &probe)) SendSnapshot();
    service->Register(this);
    Pump();
  }

  // Sends what is new, unless a write is in flight (OnWriteDone pumps again).
  void Pump() {
    absl::MutexLock lock(&mu_);
    if (writing_ || done_) return;
    response_.Clear();
    std::vector<v1::KvEvent> events;
    if (!service_->pool_->ReadEvents(next_, 256, &events)) {
      SendSnapshotLocked();  // fell behind the ring while following
      return;
    }
    if (events.empty()) {
      if (!follow_) Close(grpc::Status::OK);
      return;
    }
    next_ = events.back().seq() + 1;
    for (v1::KvEvent& e : events) *response_.add_events() = std::move(e);
    writing_ = true;
    StartWrite(&response_);
  }

  void End(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (!writing_) {
      Close(status);
    } else {
      end_status_ = status;  // after the write in flight
    }
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) return Close(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
      if (end_status_) return Close(*end_status_);
    }
    Pump();
  }

  void OnDone() override {
    service_->Unregister(this);
    delete this;
  }

 private:
  void SendSnapshot() {
    absl::MutexLock lock(&mu_);
    SendSnapshotLocked();
  }
  void SendSnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint64_t resume = 0;
    response_.Clear();
    response_.set_snapshot(true);
    for (v1::KvEvent& e : service_->pool_->SnapshotEvents(&resume)) {
      *response_.add_events() = std::move(e);
    }
    response_.set_resume_seq(resume);
    next_ = resume;
    writing_ = true;
    StartWrite(&response_);
  }
  void Close(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (done_) return;
    done_ = true;
    Finish(status);
  }

  KvPoolService* const service_;
  const bool follow_;
  absl::Mutex mu_;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> end_status_ ABSL_GUARDED_BY(mu_);
  v1::WatchEventsResponse response_ ABSL_GUARDED_BY(mu_);
};

KvPoolService::KvPoolService(DaemonPool* pool, SessionRegistry* sessions, StepRunner* runner)
    : pool_(pool), sessions_(sessions), runner_(runner) {}

KvPoolService::~KvPoolService() = default;

std::shared_ptr<const Session> KvPoolService::Authenticate(Context* context,
                                                           grpc::Status* error) const {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(wire::kSessionTokenKey);
  if (it == metadata.end()) {
    *error = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "no kvpool-session-token metadata: attach first");
    return nullptr;
  }
  std::shared_ptr<const Session> session =
      sessions_->FindByToken(std::string_view(it->second.data(), it->second.size()));
  if (session == nullptr) {
    *error = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "unknown session token (the session ended or the daemon restarted)");
  }
  return session;
}

template <typename Fn>
KvPoolService::Unary* KvPoolService::Run(Context* context, bool admin, Fn&& fn) {
  Unary* reactor = context->DefaultReactor();
  {
    absl::MutexLock lock(&calls_mu_);
    if (stopping_) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
      return reactor;
    }
    ++calls_;
  }
  grpc::Status error;
  std::shared_ptr<const Session> session = Authenticate(context, &error);
  if (session == nullptr) {
    reactor->Finish(error);
  } else if (admin && !session->admin) {
    reactor->Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                 "admin call from a session without the admin role"));
  } else {
    reactor->Finish(ToGrpcStatus(fn(*session), context));
  }
  absl::MutexLock lock(&calls_mu_);
  --calls_;
  return reactor;
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
  Unary* reactor = Run(c, false, [&](const Session& s) { return pool_->Allocate(s, *q, r); });
  NotifyEvents();  // room may have been made by evicting cached blocks
  return reactor;
}

KvPoolService::Unary* KvPoolService::Grow(Context* c, const v1::GrowRequest* q,
                                          v1::GrowResponse* r) {
  Unary* reactor = Run(c, false, [&](const Session& s) { return pool_->Grow(s, *q, r); });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::Truncate(Context* c, const v1::TruncateRequest* q,
                                              v1::TruncateResponse*) {
  return Run(c, false, [&](const Session& s) { return pool_->Truncate(s, *q); });
}

KvPoolService::Unary* KvPoolService::Fork(Context* c, const v1::ForkRequest* q,
                                          v1::ForkResponse* r) {
  Unary* reactor = Run(c, false, [&](const Session& s) { return pool_->Fork(s, *q, r); });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::Commit(Context* c, const v1::CommitRequest* q,
                                            v1::CommitResponse*) {
  Unary* reactor = Run(c, false, [&](const Session& s) { return pool_->Commit(s, *q); });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::Free(Context* c, const v1::FreeRequest* q, v1::FreeResponse*) {
  Unary* reactor = Run(c, false, [&](const Session& s) { return pool_->Free(s, *q); });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::MatchPrefix(Context* c, const v1::MatchPrefixRequest* q,
                                                 v1::MatchPrefixResponse* r) {
  return Run(c, false, [&](const Session& s) {
    r->set_matched_tokens(pool_->MatchPrefix(s, *q));
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Ping(Context* c, const v1::PingRequest*, v1::PingResponse*) {
  return Run(c, false, [](const Session&) { return absl::OkStatus(); });
}

KvPoolService::Unary* KvPoolService::GetStats(Context* c, const v1::GetStatsRequest*,
                                              v1::GetStatsResponse* r) {
  return Run(c, true, [&](const Session&) {
    pool_->Stats(r);
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::ListSessions(Context* c, const v1::ListSessionsRequest*,
                                                  v1::ListSessionsResponse* r) {
  return Run(c, true, [&](const Session&) {
    const absl::Time now = absl::Now();
    for (const std::shared_ptr<const Session>& s : sessions_->List()) {
      v1::SessionInfo* info = r->add_sessions();
      info->set_session_id(s->id.value());
      info->set_client_name(s->client_name);
      info->set_pid(static_cast<uint32_t>(s->pid));
      info->set_uid(s->uid);
      info->set_gid(s->gid);
      info->set_tenant(s->tenant);
      info->set_model(s->model);
      info->set_namespace_id(s->ns.value());
      info->set_admin(s->admin);
      const auto [sequences, refs] = pool_->Usage(s->id);
      info->set_sequences(sequences);
      info->set_block_refs(refs);
      info->set_attached_seconds(absl::ToDoubleSeconds(now - s->attached));
    }
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::ListSequences(Context* c, const v1::ListSequencesRequest* q,
                                                   v1::ListSequencesResponse* r) {
  return Run(c, true, [&](const Session&) {
    pool_->ListSequences(q->session_id(), r);
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::DumpBlockTrace(Context* c, const v1::DumpBlockTraceRequest* q,
                                                    v1::DumpBlockTraceResponse* r) {
  return Run(c, true, [&](const Session&) { return pool_->DumpBlockTrace(*q, r); });
}

grpc::ServerWriteReactor<v1::WatchEventsResponse>* KvPoolService::WatchEvents(
    Context* c, const v1::WatchEventsRequest* q) {
  grpc::Status error;
  std::shared_ptr<const Session> session = Authenticate(c, &error);
  if (session != nullptr && !session->admin) {
    error = grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                         "admin call from a session without the admin role");
    session = nullptr;
  }
  if (session == nullptr) {
    // A reactor that only reports the error.
    class Refusal final : public grpc::ServerWriteReactor<v1::WatchEventsResponse> {
     public:
      explicit Refusal(const grpc::Status& s) { Finish(s); }
      void OnDone() override { delete this; }
    };
    return new Refusal(error);
  }
  return new EventWriter(this, *q);
}

KvPoolService::Unary* KvPoolService::ExplainMatch(Context* c, const v1::ExplainMatchRequest* q,
                                                  v1::ExplainMatchResponse* r) {
  return Run(c, true, [&](const Session& s) {
    pool_->Explain(q->namespace_id() != 0 ? NamespaceId(q->namespace_id()) : s.ns, *q, r);
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Evict(Context* c, const v1::EvictRequest* q,
                                           v1::EvictResponse* r) {
  Unary* reactor = Run(c, true, [&](const Session&) -> absl::Status {
    absl::StatusOr<int64_t> evicted = pool_->Evict(*q);
    if (!evicted.ok()) return evicted.status();
    r->set_evicted(*evicted);
    return absl::OkStatus();
  });
  NotifyEvents();
  return reactor;
}

KvPoolService::Unary* KvPoolService::CheckInvariants(Context* c, const v1::CheckInvariantsRequest*,
                                                     v1::CheckInvariantsResponse* r) {
  return Run(c, true, [&](const Session&) {
    const absl::Status status = pool_->CheckInvariants();
    r->set_ok(status.ok());
    if (!status.ok()) r->set_violation(std::string(status.message()));
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::SetLogLevel(Context* c, const v1::SetLogLevelRequest* q,
                                                 v1::SetLogLevelResponse*) {
  return Run(c, true, [&](const Session&) { return kvpool::SetLogLevel(q->level()); });
}

KvPoolService::Unary* KvPoolService::Drain(Context* c, const v1::DrainRequest*,
                                           v1::DrainResponse* r) {
  return Run(c, true, [&](const Session&) {
    r->set_sequences(pool_->Drain());
    Logger("daemon").info("draining: {} sequences still live", r->sequences());
    return absl::OkStatus();
  });
}

void KvPoolService::Register(EventWriter* writer) {
  absl::MutexLock lock(&writers_mu_);
  writers_.insert(writer);
  if (ended_) writer->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
}

void KvPoolService::Unregister(EventWriter* writer) {
  absl::MutexLock lock(&writers_mu_);
  writers_.erase(writer);
}

void KvPoolService::NotifyEvents() {
  absl::MutexLock lock(&writers_mu_);
  for (EventWriter* writer : writers_) writer->Pump();
}

void KvPoolService::EndStreams() {
  absl::MutexLock lock(&writers_mu_);
  ended_ = true;
  for (EventWriter* writer : writers_) {
    writer->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
  }
}

}  // namespace kvpool::daemon
