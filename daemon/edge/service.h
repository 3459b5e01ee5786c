#pragma once

// KvPoolService: the gRPC face of the daemon (proto/kvpool/v1/kvpool.proto), on the callback API.
// It authenticates each call's session from the "kvpool-session-token" metadata, checks the admin
// role where needed, translates the request into the engine's core types, calls the Engine and
// translates the answer back (convert.h). It decides nothing itself.
//
// Control calls are short (bookkeeping plus, at most, a wait for a small device plan) and run
// inline on gRPC's callback threads. Compute calls complete when their model step has run.
// WatchEvents streams cache events; the service is the engine's EventListener, so followers are
// woken whenever the engine appended events, whatever made them (a call, a step, a tier writer).
// Whoever builds the service adds it to the engine (Engine::AddEventListener) and removes it
// before either goes.
//
// Lock order: (Engine::listeners_mu_, as reader) -> writers_mu_ -> EventWriter::mu_ -> the
// engine's lock.
//
// Thread-safe.

#include <memory>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/edge/attach_server.h"
#include "daemon/edge/convert.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/event_listener.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace kvpool::daemon {

struct LockOrderPeer;

class EventWriter;
class GenerateWriter;

// A streaming call refused before it started: it only reports `status`. Deletes itself.
template <typename Response>
class Refusal final : public grpc::ServerWriteReactor<Response> {
 public:
  explicit Refusal(const grpc::Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

class KvPoolService final : public v1::KvPool::CallbackService, public EventListener {
 public:
  // Neither is owned; both outlive the service.
  // `attach` and `rpcs` (not owned; may be null) hold the attach socket's and the calls'
  // counters for GetStats; the WatchEvents streams count into `streams` (not owned; null: the
  // service's own), and `zmq` (may be null) is the ZeroMQ publisher's.
  KvPoolService(Engine* engine, const Clock* clock, const AttachCounters* attach = nullptr,
                const RpcCounters* rpcs = nullptr, EventStreamCounters* streams = nullptr,
                const ZmqEventCounters* zmq = nullptr)
      : engine_(engine),
        clock_(clock),
        attach_(attach),
        rpcs_(rpcs),
        streams_(streams != nullptr ? streams : &own_streams_),
        zmq_(zmq) {}
  ~KvPoolService() override = default;

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
  Unary* Pin(Context* c, const v1::PinRequest* q, v1::PinResponse* r) override;
  Unary* RenewPin(Context* c, const v1::RenewPinRequest* q, v1::RenewPinResponse* r) override;
  Unary* Unpin(Context* c, const v1::UnpinRequest* q, v1::UnpinResponse* r) override;
  Unary* ListPins(Context* c, const v1::ListPinsRequest* q, v1::ListPinsResponse* r) override;
  Unary* Ping(Context* c, const v1::PingRequest* q, v1::PingResponse* r) override;
  // Compute calls (service_compute.cc): they complete when their model step has run.
  Unary* Prefill(Context* c, const v1::PrefillRequest* q, v1::PrefillResponse* r) override;
  Unary* Decode(Context* c, const v1::DecodeRequest* q, v1::DecodeResponse* r) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(Context* c,
                                                           const v1::GenerateRequest* q) override;
  // Admin calls (service_admin.cc): sessions with the admin role only.
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
  Unary* Invalidate(Context* c, const v1::InvalidateRequest* q, v1::InvalidateResponse* r) override;
  Unary* CheckInvariants(Context* c, const v1::CheckInvariantsRequest* q,
                         v1::CheckInvariantsResponse* r) override;
  Unary* SetLogLevel(Context* c, const v1::SetLogLevelRequest* q,
                     v1::SetLogLevelResponse* r) override;
  Unary* Drain(Context* c, const v1::DrainRequest* q, v1::DrainResponse* r) override;

  // EventListener: wakes the WatchEvents streams of `pool` to send what is new.
  void OnEvents(int32_t pool, uint64_t next_seq) override;
  // Ends every WatchEvents stream (UNAVAILABLE), so the server can shut down.
  void EndStreams();
  // From now on every call fails with UNAVAILABLE ("shutting down").
  void Stop();
  // Waits until no call is running, at most until `deadline`. Returns whether it got there.
  // (gRPC's own graceful shutdown waits for every idle client to answer a PING, which a client
  // with no call in flight may take its 5 s backup-poll period to do: the daemon drains its calls
  // itself and then shuts the server down at once.)
  // `deadline_ns` on the service's clock.
  bool WaitIdle(int64_t deadline_ns);

 private:
  friend struct LockOrderPeer;  // tests/daemon/lock_order_test.cc takes the locks in order
  friend class EventWriter;
  friend class GenerateWriter;

  // Authenticates (and, with `admin`, authorizes) the call, runs `fn(session)` and finishes the
  // call with its status.
  template <typename Fn>
  Unary* Run(Context* context, bool admin, Fn&& fn);
  // The session the call's token names. Errors: UNAUTHENTICATED (no or unknown token),
  // PERMISSION_DENIED (`admin` and the session lacks the role).
  absl::StatusOr<std::shared_ptr<const Session>> Authenticate(const Context* context,
                                                              bool admin) const;
  // Starts a compute call: authenticates, then `build` checks the request and makes it (its
  // error refuses the call), then submits; `finish` fills the response from the outcome before
  // the reactor finishes. Nothing of the request is built before its caller is known.
  Unary* Compute(Context* context, absl::FunctionRef<absl::StatusOr<ComputeRequest>()> build,
                 std::function<void(const ComputeResult&)> finish);
  // The pool an admin call names (empty: the caller's). Errors: NOT_FOUND.
  absl::StatusOr<int32_t> PoolOf(const Session& s, const std::string& name) const;
  // Counts a call that completes asynchronously; false when the service is stopping.
  bool BeginCall();
  void EndCall();
  void Register(EventWriter* writer);
  void Unregister(EventWriter* writer);

  Engine* const engine_;
  const Clock* const clock_;
  const AttachCounters* const attach_;
  const RpcCounters* const rpcs_;
  EventStreamCounters own_streams_;
  EventStreamCounters* const streams_;  // streams given, or own_streams_
  const ZmqEventCounters* const zmq_;
  absl::Mutex calls_mu_;
  int64_t calls_ ABSL_GUARDED_BY(calls_mu_) = 0;  // calls running
  bool stopping_ ABSL_GUARDED_BY(calls_mu_) = false;
  absl::Mutex writers_mu_;
  absl::flat_hash_set<EventWriter*> writers_ ABSL_GUARDED_BY(writers_mu_);
  bool ended_ ABSL_GUARDED_BY(writers_mu_) = false;
};

template <typename Fn>
KvPoolService::Unary* KvPoolService::Run(Context* context, bool admin, Fn&& fn) {
  Unary* reactor = context->DefaultReactor();
  if (!BeginCall()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<const Session>> session = Authenticate(context, admin);
  reactor->Finish(ToGrpcStatus(session.ok() ? fn(**session) : session.status(), context));
  EndCall();
  return reactor;
}

}  // namespace kvpool::daemon
