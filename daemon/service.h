#pragma once

// KvPoolService: the gRPC face of the daemon (proto/kvpool/v1/kvpool.proto), on the callback
// API. Each unary call authenticates its session from the "kvpool-session-token" metadata, checks
// the admin role where needed, runs on DaemonPool and maps the result with ToGrpcStatus(). Calls
// are short (in-memory bookkeeping plus, at most, a wait for a small device plan), so they run
// inline on gRPC's callback threads. WatchEvents streams cache events; followers are woken by
// NotifyEvents() after every call that can produce events.
//
// Thread-safe.

#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/pool.h"
#include "daemon/sessions.h"
#include "daemon/step_runner.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace kvpool::daemon {

// The one mapping from absl::Status to grpc::Status (STYLE.md): same code and message; a
// RESOURCE_EXHAUSTED that carries a shortfall also sets the trailing metadata
// "kvpool-shortfall" = "<resource>:<blocks>" when `context` is given.
grpc::Status ToGrpcStatus(const absl::Status& status, grpc::ServerContextBase* context = nullptr);

class EventWriter;

class KvPoolService final : public v1::KvPool::CallbackService {
 public:
  // None is owned; all outlive the service. `runner` is null when the daemon runs no model (the
  // compute RPCs then fail with FAILED_PRECONDITION).
  KvPoolService(DaemonPool* pool, SessionRegistry* sessions, StepRunner* runner = nullptr);
  ~KvPoolService() override;

  using Context = grpc::CallbackServerContext;
  using Unary = grpc::ServerUnaryReactor;

  Unary* Allocate(Context* c, const v1::AllocateRequest* q, v1::AllocateResponse* r) override;
  Unary* Grow(Context* c, const v1::GrowRequest* q, v1::GrowResponse* r) override;
  Unary* Truncate(Context* c, const v1::TruncateRequest* q, v1::TruncateResponse* r) override;
  Unary* Fork(Context* c, const v1::ForkRequest* q, v1::ForkResponse* r) override;
  Unary* Commit(Context* c, const v1::CommitRequest* q, v1::CommitResponse* r) override;
  Unary* Free(Context* c, const v1::FreeRequest* q, v1::FreeResponse* r) override;
  Unary* MatchPrefix(Context* c, const v1::MatchPrefixRequest* q,
                     v1::MatchPrefixResponse* r) override;
  Unary* Ping(Context* c, const v1::PingRequest* q, v1::PingResponse* r) override;
  // Compute calls (service_compute.cc): they complete when their model step has run.
  Unary* Prefill(Context* c, const v1::PrefillRequest* q, v1::PrefillResponse* r) override;
  Unary* Decode(Context* c, const v1::DecodeRequest* q, v1::DecodeResponse* r) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(Context* c,
                                                           const v1::GenerateRequest* q) override;
  Unary* GetStats(Context* c, const v1::GetStatsRequest* q, v1::GetStatsResponse* r) override;
  Unary* ListSessions(Context* c, const v1::ListSessionsRequest* q,
                      v1::ListSessionsResponse* r) override;
  Unary* ListSequences(Context* c, const v1::ListSequencesRequest* q,
                       v1::ListSequencesResponse* r) override;
  Unary* DumpBlockTrace(Context* c, const v1::DumpBlockTraceRequest* q,
                        v1::DumpBlockTraceResponse* r) override;
  grpc::ServerWriteReactor<v1::WatchEventsResponse>* WatchEvents(
      Context* c, const v1::WatchEventsRequest* q) override;
  Unary* ExplainMatch(Context* c, const v1::ExplainMatchRequest* q,
                      v1::ExplainMatchResponse* r) override;
  Unary* Evict(Context* c, const v1::EvictRequest* q, v1::EvictResponse* r) override;
  Unary* CheckInvariants(Context* c, const v1::CheckInvariantsRequest* q,
                         v1::CheckInvariantsResponse* r) override;
  Unary* SetLogLevel(Context* c, const v1::SetLogLevelRequest* q,
                     v1::SetLogLevelResponse* r) override;
  Unary* Drain(Context* c, const v1::DrainRequest* q, v1::DrainResponse* r) override;

  // Wakes every following WatchEvents stream to send what is new.
  void NotifyEvents();
  // Ends every WatchEvents stream (UNAVAILABLE), so the server can shut down.
  void EndStreams();
  // From now on every call fails with UNAVAILABLE ("shutting down").
  void Stop();
  // Waits until no unary call is running, at most until `deadline`. Returns whether it got there.
  // (gRPC's own graceful shutdown waits for every idle client to answer a PING, which a client
  // with no call in flight may take its 5 s backup-poll period to do: the daemon drains its calls
  // itself and then shuts the server down at once.)
  bool WaitIdle(absl::Time deadline);

 private:
  friend class EventWriter;
  friend class GenerateWriter;

  template <typename Fn>
  Unary* Run(Context* context, bool admin, Fn&& fn);
  std::shared_ptr<const Session> Authenticate(Context* context, grpc::Status* error) const;
  // Starts a compute call: checks the service is up, the session and the model, then submits
  // `call`; `finish` fills the response from the outcome before the reactor finishes.
  Unary* Compute(Context* context, std::unique_ptr<ComputeCall> call,
                 std::function<void(ComputeCall&)> finish);
  // Counts a call that completes asynchronously; false when the service is stopping.
  bool BeginCall();
  void EndCall();
  bool Stopping();
  void Register(EventWriter* writer);
  void Unregister(EventWriter* writer);

  DaemonPool* const pool_;
  SessionRegistry* const sessions_;
  StepRunner* const runner_;
  absl::Mutex calls_mu_;
  int64_t calls_ ABSL_GUARDED_BY(calls_mu_) = 0;  // unary calls running
  bool stopping_ ABSL_GUARDED_BY(calls_mu_) = false;
  absl::Mutex writers_mu_;
  absl::flat_hash_set<EventWriter*> writers_ ABSL_GUARDED_BY(writers_mu_);
  bool ended_ ABSL_GUARDED_BY(writers_mu_) = false;
};

}  // namespace kvpool::daemon
