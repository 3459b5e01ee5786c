#pragma once

// Daemon: kvpoold's life cycle, as a server object (Envoy's shape). Create() builds the device,
// the model and the engine from a validated config; Start() binds kvpoold.sock and attach.sock in
// the runtime directory and serves; Wait() returns once a shutdown was requested, pinging the
// systemd watchdog meanwhile and turning health NOT_SERVING if the engine stops serving;
// Shutdown() stops in order: health NOT_SERVING, stop accepting attaches, refuse new sequences,
// let running calls finish (drain_timeout_ms), fail what is still queued, release every session,
// release the pool.
//
// Health (grpc.health.v1) answers for "" and for "kvpool.v1.KvPool".
//
// Thread-safe: RequestShutdown() may be called from any thread (the signal watcher's); the rest
// from the thread that owns the daemon.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/edge/attach_policy.h"
#include "daemon/edge/attach_server.h"
#include "daemon/edge/decode_doorbell.h"
#include "daemon/edge/zmq_event_publisher.h"
#include "daemon/engine/engine.h"
#include "daemon/metrics/rpc_counters.h"
#include "daemon/metrics/stream_counters.h"
#include "kernels/device.h"
#include "kvpool/util/clock.h"
#include "kvpool/v1/config.pb.h"
#include "model/step_model.h"

namespace grpc {
class Server;
}

namespace kvpool::daemon {

class KvPoolService;
class MetricsServer;
class ZmqEventPublisher;

class Daemon final {
 public:
  // The gRPC service name health answers for, beside "".
  static constexpr char kServiceName[] = "kvpool.v1.KvPool";

  // `config` must have passed ValidateConfig. `clock` (not owned; outlives the daemon) is the
  // engine's and every edge's: call deadlines, attach handshakes and back-offs, doorbells, the
  // event publisher's pacing, the drain and the watchdog loop. Errors: those of the device, the
  // model and the engine (the caller logs them and exits 1).
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(const v1::DaemonConfig& config,
                                                        const Clock* clock);
  ~Daemon();  // Shutdown()

  // Errors: FAILED_PRECONDITION (another kvpoold serves this runtime directory), INTERNAL
  // (directory, sockets).
  absl::Status Start();
  void RequestShutdown() {
    absl::MutexLock lock(&shutdown_mu_);
    shutdown_requested_ = true;
  }
  void Wait();
  // Idempotent.
  void Shutdown();

  Engine& engine() { return *engine_; }
  const std::string& runtime_dir() const { return config_.runtime_dir(); }
  // The port /metrics is served on; 0 when it is not.
  int metrics_port() const;

 private:
  Daemon(v1::DaemonConfig config, const Clock* clock, std::unique_ptr<kernels::Device> device,
         std::unique_ptr<model::StepModel> model, std::unique_ptr<Engine> engine);

  absl::Status StartGrpc();
  absl::Status StartAttach();
  // Errors: those of MetricsServer::Start. A no-op without metrics.listen.
  absl::Status StartMetrics();
  // The publisher's counters when the config asks for a publisher (zmq_events); else null.
  const ZmqEventCounters* ZmqCounters() const;
  // The ZeroMQ publisher of cache events, when the config asks for one (zmq_events).
  absl::Status StartEventPublisher();
  // Gives an attaching session a decode doorbell when its uid has room for one (counted when
  // not). Errors: those of DecodeDoorbell::Start, after which the session has been ended.
  absl::Status AddDoorbell(const std::shared_ptr<const Session>& session, uid_t uid,
                           AttachReply* reply);
  void SetServing(bool serving);

  const v1::DaemonConfig config_;
  const Clock* const clock_;
  const AttachPolicy policy_;
  std::unique_ptr<kernels::Device> device_;
  std::unique_ptr<model::StepModel> model_;
  std::unique_ptr<Engine> engine_;
  AttachCounters attach_counters_;       // outlives attach_ and service_
  RpcCounters rpc_counters_;             // outlives server_ (its interceptor) and service_
  EventStreamCounters stream_counters_;  // WatchEvents': outlives service_ and metrics_
  ZmqEventCounters zmq_counters_;        // the publisher's: outlives it and metrics_
  std::unique_ptr<KvPoolService> service_;
  std::unique_ptr<ZmqEventPublisher> event_publisher_;  // null: none configured
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<AttachServer> attach_;
  std::unique_ptr<MetricsServer> metrics_;  // null: no /metrics (config metrics.listen empty)
  Doorbells doorbells_;                     // by session; each stopped when its session ends
  absl::Mutex shutdown_mu_;
  bool shutdown_requested_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace kvpool::daemon
