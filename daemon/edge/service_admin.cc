// KvPoolService's admin calls, and the WatchEvents stream (service.h).

#include <optional>

#include "daemon/edge/service.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {

// A WatchEvents stream: first a snapshot when asked for one (or when the events wanted were
// already dropped from the replay ring), then events in order; with `follow`, it waits for more.
// Deletes itself when gRPC is done with it.
class EventWriter final : public grpc::ServerWriteReactor<v1::WatchEventsResponse> {
 public:
  EventWriter(KvPoolService* service, int32_t pool, const v1::WatchEventsRequest& request)
      : service_(service),
        engine_(service->engine_),
        counters_(service->streams_),
        pool_(pool),
        follow_(request.follow()) {
    const uint64_t head = engine_->next_event_seq(pool_);
    next_ = request.from_seq() == 0 ? head : request.from_seq();
    // Past the head is no position in this log (another epoch's, from before a restart): like
    // one the log dropped, it cannot be followed from, and waiting there would skip every event
    // up to it unseen.
    std::vector<KvEvent> probe;
    if (request.snapshot() || next_ > head || !engine_->ReadEvents(pool_, next_, 0, &probe)) {
      SendSnapshot(/*requested=*/request.snapshot());
    }
    if (follow_) counters_->FollowerOpened();
    service->Register(this);
    Pump();
  }

  // Sends what is new, unless a write is in flight (OnWriteDone pumps again).
  void Pump() {
    absl::MutexLock lock(&mu_);
    if (writing_ || done_) return;
    std::vector<KvEvent> events;
    if (!engine_->ReadEvents(pool_, next_, 256, &events)) {
      SendSnapshotLocked(/*requested=*/false);  // fell behind the ring while following
      return;
    }
    if (events.empty()) {
      if (!follow_) Close(grpc::Status::OK);
      return;
    }
    response_.Clear();
    next_ = events.back().seq + 1;
    const uint64_t head = engine_->next_event_seq(pool_);
    counters_->BatchSent(head > next_ ? head - next_ : 0);
    for (const KvEvent& e : events) *response_.add_events() = ToProto(e);
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
      if (cancelled_) return Close(grpc::Status::CANCELLED);
      if (end_status_) return Close(*end_status_);
    }
    Pump();
  }

  // The client cancelled or its deadline passed. A follower of an idle pool has no write in
  // flight and no event coming to wake it: it finishes now; otherwise OnWriteDone does.
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (!writing_) Close(grpc::Status::CANCELLED);
  }

  int32_t pool() const { return pool_; }

  void OnDone() override {
    if (follow_) counters_->FollowerClosed();
    service_->Unregister(this);
    service_->EndCall();
    delete this;
  }

 private:
  // `requested`: the caller asked for it; otherwise the stream's next event had left the log.
  void SendSnapshot(bool requested) {
    absl::MutexLock lock(&mu_);
    SendSnapshotLocked(requested);
  }
  void SendSnapshotLocked(bool requested) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    counters_->SnapshotSent(requested);
    uint64_t resume = 0;
    response_.Clear();
    response_.set_snapshot(true);
    for (const KvEvent& e : engine_->SnapshotEvents(pool_, &resume)) {
      *response_.add_events() = ToProto(e);
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
  Engine* const engine_;
  EventStreamCounters* const counters_;
  const int32_t pool_;
  const bool follow_;
  absl::Mutex mu_;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;       // Finish() called
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // OnCancel() ran
  std::optional<grpc::Status> end_status_ ABSL_GUARDED_BY(mu_);
  v1::WatchEventsResponse response_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerWriteReactor<v1::WatchEventsResponse>* KvPoolService::WatchEvents(
    Context* c, const v1::WatchEventsRequest* q) {
  if (!BeginCall()) {
    return new Refusal<v1::WatchEventsResponse>(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
  }
  absl::StatusOr<std::shared_ptr<const Session>> s = Authenticate(c, true);
  absl::StatusOr<int32_t> pool = s.ok() ? PoolOf(**s, q->pool()) : s.status();
  if (!pool.ok()) {
    EndCall();
    return new Refusal<v1::WatchEventsResponse>(ToGrpcStatus(pool.status()));
  }
  return new EventWriter(this, *pool, *q);
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

void KvPoolService::OnEvents(int32_t pool, uint64_t) {
  absl::MutexLock lock(&writers_mu_);
  for (EventWriter* writer : writers_) {
    if (writer->pool() == pool) writer->Pump();
  }
}

void KvPoolService::EndStreams() {
  absl::MutexLock lock(&writers_mu_);
  ended_ = true;
  for (EventWriter* writer : writers_) {
    writer->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
  }
}

absl::StatusOr<int32_t> KvPoolService::PoolOf(const Session& s, const std::string& name) const {
  return name.empty() ? s.pool : engine_->FindPool(name);
}

KvPoolService::Unary* KvPoolService::GetStats(Context* c, const v1::GetStatsRequest* q,
                                              v1::GetStatsResponse* r) {
  return Run(c, true, [&](const Session& s) -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(const int32_t pool, PoolOf(s, q->pool()));
    const EventStreamStats streams = streams_->Read();
    ToProto(engine_->Stats(pool), attach_, rpcs_, r, &streams, zmq_);
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::ListSessions(Context* c, const v1::ListSessionsRequest*,
                                                  v1::ListSessionsResponse* r) {
  return Run(c, true, [&](const Session&) {
    const int64_t now = clock_->NowNanos();
    for (const SessionListing& l : engine_->ListSessions()) {
      v1::SessionInfo* info = r->add_sessions();
      ToProto(l, now, info);
      info->set_pool(engine_->pool_name(l.session->pool));
    }
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::ListSequences(Context* c, const v1::ListSequencesRequest* q,
                                                   v1::ListSequencesResponse* r) {
  return Run(c, true, [&](const Session&) -> absl::Status {
    std::optional<int32_t> pool;
    if (!q->pool().empty()) {
      KVPOOL_ASSIGN_OR_RETURN(pool, engine_->FindPool(q->pool()));
    }
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    const Tables tables = engine_->ListSequences(pool, SessionId(q->session_id()), &owners, &pools);
    ToProto(tables, r->mutable_sequences());
    for (SessionId owner : owners) r->add_session_ids(owner.value());
    for (int32_t p : pools) r->add_pools(engine_->pool_name(p));
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::DumpBlockTrace(Context* c, const v1::DumpBlockTraceRequest* q,
                                                    v1::DumpBlockTraceResponse* r) {
  return Run(c, true, [&](const Session& s) -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(const int32_t pool, PoolOf(s, q->pool()));
    const std::optional<BlockId> block =
        q->all() ? std::nullopt : std::optional<BlockId>(BlockId(q->block_id()));
    absl::StatusOr<std::vector<BlockTraceEntry>> entries = engine_->BlockTrace(pool, block);
    if (!entries.ok()) return entries.status();
    for (const BlockTraceEntry& e : *entries) ToProto(e, r->add_entries());
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::ExplainMatch(Context* c, const v1::ExplainMatchRequest* q,
                                                  v1::ExplainMatchResponse* r) {
  return Run(c, true, [&](const Session& s) -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(const int32_t pool, PoolOf(s, q->pool()));
    const NamespaceId ns = q->namespace_id() != 0 ? NamespaceId(q->namespace_id()) : s.ns;
    const MatchExplanation e = engine_->Explain(pool, ns, Tokens(q->tokens()));
    r->set_matched_tokens(e.matched_tokens);
    r->set_stop(std::string(StopName(e.stop)));
    r->set_explanation(e.ToString());
    if (e.resumable_tokens >= 0) r->set_resumable_tokens(e.resumable_tokens);
    if (engine_->layout(pool).num_window_layers > 0) {
      r->set_window_evicted_tokens(e.window_evicted_tokens);
    }
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Evict(Context* c, const v1::EvictRequest* q,
                                           v1::EvictResponse* r) {
  return Run(c, true, [&](const Session& s) -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(const int32_t pool, PoolOf(s, q->pool()));
    absl::StatusOr<int64_t> evicted = engine_->Evict(pool, q->blocks(), q->all());
    if (!evicted.ok()) return evicted.status();
    r->set_evicted(*evicted);
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::Invalidate(Context* c, const v1::InvalidateRequest* q,
                                                v1::InvalidateResponse* r) {
  return Run(c, true, [&](const Session&) -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(const Engine::Invalidation done,
                            engine_->Invalidate(q->tenant(), q->model()));
    r->set_generation(done.generation);
    r->set_sessions(done.sessions);
    r->set_namespaces(done.namespaces);
    r->set_tier_blocks(done.tier_blocks);
    return absl::OkStatus();
  });
}

KvPoolService::Unary* KvPoolService::CheckInvariants(Context* c, const v1::CheckInvariantsRequest*,
                                                     v1::CheckInvariantsResponse* r) {
  return Run(c, true, [&](const Session&) {
    const absl::Status status = engine_->CheckInvariants();
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
    r->set_sequences(engine_->Drain());
    Logger("daemon").info("draining: {} sequences still live", r->sequences());
    return absl::OkStatus();
  });
}

}  // namespace kvpool::daemon
