#include "daemon/daemon.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstring>

#include "daemon/edge/attach_server.h"
#include "daemon/edge/config.h"
#include "daemon/edge/convert.h"
#include "daemon/edge/service.h"
#include "daemon/edge/zmq_event_publisher.h"
#include "daemon/metrics/metrics_server.h"
#include "fmt/format.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"
#include "kvpool/v1/runtime_dir.h"
#include "kvpool/v1/wire.h"
#include "model/weights.h"

namespace kvpool::daemon {
namespace {

spdlog::logger& Log() { return Logger("daemon"); }

// True when something answers on `path` (another kvpoold is live there).
bool SomeoneListens(const std::string& path) {
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  return connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
}

uint64_t NewEpoch() {
  const std::string token = NewToken();  // 128 random bits
  return std::stoull(token.substr(0, 16), nullptr, 16) | 1;
}

AttachPolicy::Options PolicyOptions(const v1::DaemonConfig& c) {
  AttachPolicy::Options o{.allowed_uids = {c.allowed_uids().begin(), c.allowed_uids().end()},
                          .allowed_gids = {c.allowed_gids().begin(), c.allowed_gids().end()},
                          .admin_uids = {c.admin_uids().begin(), c.admin_uids().end()},
                          .protocol_version = wire::kProtocolVersion};
  for (const v1::TenantSpec& t : c.tenants()) {
    o.tenants[t.name()] = {.uids = {t.uids().begin(), t.uids().end()},
                           .gids = {t.gids().begin(), t.gids().end()},
                           .kv_access = t.kv_access()};
  }
  return o;
}

// The configured model on `device` for `layout`; null for "none", or when the device's backend
// cannot run a model (UNAVAILABLE: a GPU host without cuBLAS), which is logged: the pool still
// serves everything but the compute RPCs.
absl::StatusOr<std::unique_ptr<model::StepModel>> LoadModel(const v1::ModelSpec& spec,
                                                            const kernels::PoolLayout& layout,
                                                            kernels::Device* device) {
  if (spec.checkpoint().empty() && spec.name() == "none") return nullptr;
  const std::string name = spec.checkpoint().empty() ? spec.name() : spec.checkpoint();
  const absl::Time start = absl::Now();
  absl::StatusOr<model::ModelWeights> weights;
  if (spec.checkpoint().empty()) {
    KVPOOL_ASSIGN_OR_RETURN(model::ModelConfig named, model::NamedConfig(spec.name()));
    weights = model::SyntheticWeights(named, spec.seed());
  } else {
    weights = model::LoadCheckpoint(spec.checkpoint());
  }
  if (!weights.ok()) return weights.status();
  const model::ModelConfig mc = weights->config;
  absl::StatusOr<std::unique_ptr<model::StepModel>> created =
      model::CreateStepModel(*std::move(weights), layout, device, spec.threads());
  if (created.status().code() == absl::StatusCode::kUnavailable) {
    Log().error("model {}: {}; Prefill/Decode/Generate are off", name, created.status().message());
    return nullptr;
  }
  if (!created.ok()) return created.status();
  Log().info("model {} on {}: {} layers, hidden {}, vocab {}, {:.1f} MiB of weights, loaded in {}",
             name, (*created)->where(), mc.num_layers, mc.hidden_size, mc.vocab_size,
             static_cast<double>((*created)->weight_bytes()) / (1 << 20),
             absl::FormatDuration(absl::Now() - start));
  return created;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(const v1::DaemonConfig& config,
                                                       const Clock* clock) {
  KVPOOL_ASSIGN_OR_RETURN(EngineOptions options, MakeEngineOptions(config, NewEpoch()));
  options.clock = clock;
  KVPOOL_ASSIGN_OR_RETURN(kernels::BackendKind backend, kernels::ParseBackend(config.backend()));
  absl::StatusOr<std::unique_ptr<kernels::Device>> device =
      kernels::CreateDevice({.kind = backend,
                             .device_ordinal = config.device_ordinal(),
                             .cpu_threads = config.cpu_threads()});
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        fmt::format("device: {}", device.status().message()));
  }
  absl::StatusOr<std::unique_ptr<model::StepModel>> model =
      LoadModel(config.model(), options.pools[0].layout, device->get());
  if (!model.ok()) {
    return absl::Status(model.status().code(), fmt::format("model: {}", model.status().message()));
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(options, device->get(), model->get());
  if (!engine.ok()) {
    return absl::Status(engine.status().code(), fmt::format("pool: {}", engine.status().message()));
  }
  for (const PoolOptions& pool : options.pools) {
    Log().info("pool {}: {} on {}", pool.name, pool.layout.ToString(), (*device)->name());
  }
  return std::unique_ptr<Daemon>(
      new Daemon(config, clock, *std::move(device), *std::move(model), *std::move(engine)));
}

Daemon::Daemon(v1::DaemonConfig config, const Clock* clock, std::unique_ptr<kernels::Device> device,
               std::unique_ptr<model::StepModel> model, std::unique_ptr<Engine> engine)
    : config_(std::move(config)),
      clock_(clock),
      policy_(PolicyOptions(config_)),
      device_(std::move(device)),
      model_(std::move(model)),
      engine_(std::move(engine)) {}

Daemon::~Daemon() { Shutdown(); }

absl::Status Daemon::Start() {
  const std::string& dir = config_.runtime_dir();
  KVPOOL_RETURN_IF_ERROR(wire::PrepareRuntimeDir(dir, config_.runtime_dir_mode()));
  if (SomeoneListens(dir + "/" + wire::kAttachSocket)) {
    return absl::FailedPreconditionError(
        fmt::format("another kvpoold is already running in {}", dir));
  }
  KVPOOL_RETURN_IF_ERROR(StartEventPublisher());
  KVPOOL_RETURN_IF_ERROR(StartGrpc());
  KVPOOL_RETURN_IF_ERROR(StartAttach());
  started_ = true;  // from here on Shutdown() stops what Start() started
  KVPOOL_RETURN_IF_ERROR(StartMetrics());
  SetServing(true);
  sd_notifyf(0, "READY=1\nSTATUS=serving %d blocks on %s\nMAINPID=%d", engine_->layout().num_blocks,
             device_->name().c_str(), getpid());
  Log().info("kvpoold ready in {} (epoch {:016x})", dir, engine_->epoch());
  return absl::OkStatus();
}

absl::Status Daemon::StartMetrics() {
  if (config_.metrics().listen().empty()) return absl::OkStatus();
  KVPOOL_ASSIGN_OR_RETURN(
      metrics_, MetricsServer::Start(config_.metrics().listen(), engine_.get(), &attach_counters_,
                                     &rpc_counters_, &stream_counters_, ZmqCounters()));
  Log().info("serving /metrics on {} (port {})", config_.metrics().listen(), metrics_->port());
  return absl::OkStatus();
}

const ZmqEventCounters* Daemon::ZmqCounters() const {
  return config_.zmq_events().endpoint().empty() ? nullptr : &zmq_counters_;
}

int Daemon::metrics_port() const { return metrics_ ? metrics_->port() : 0; }

absl::Status Daemon::StartGrpc() {
  const std::string path = config_.runtime_dir() + "/" + wire::kGrpcSocket;
  unlink(path.c_str());  // stale, from a daemon that died
  service_ = std::make_unique<KvPoolService>(engine_.get(), clock_, &attach_counters_,
                                             &rpc_counters_, &stream_counters_, ZmqCounters());
  engine_->AddEventListener(service_.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.RegisterService(service_.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> counting;
  counting.push_back(RpcCounters::Interceptor(&rpc_counters_));
  builder.experimental().SetInterceptorCreators(std::move(counting));
  {
    // gRPC binds the socket inside BuildAndStart; no other thread creates files meanwhile.
    wire::ScopedUmask umask(config_.socket_mode());
    server_ = builder.BuildAndStart();
  }
  if (server_ == nullptr) return absl::InternalError(fmt::format("cannot serve gRPC on {}", path));
  return absl::OkStatus();
}

absl::Status Daemon::StartEventPublisher() {
  const v1::ZmqEventsSpec& z = config_.zmq_events();
  if (z.endpoint().empty()) return absl::OkStatus();
  ZmqEventOptions options{.endpoint = z.endpoint(),
                          .replay_endpoint = z.replay_endpoint(),
                          .topic = z.topic(),
                          .data_parallel_rank = z.data_parallel_rank(),
                          .counters = &zmq_counters_};
  if (!z.pool().empty()) {
    KVPOOL_ASSIGN_OR_RETURN(options.pool, engine_->FindPool(z.pool()));
  }
  if (z.replay_batches() > 0) options.replay_batches = static_cast<size_t>(z.replay_batches());
  if (z.queued_bytes() > 0) options.queued_bytes = z.queued_bytes();
  KVPOOL_ASSIGN_OR_RETURN(event_publisher_,
                          ZmqEventPublisher::Start(options, engine_.get(), clock_));
  engine_->AddEventListener(event_publisher_.get());
  return absl::OkStatus();
}

absl::Status Daemon::AddDoorbell(const std::shared_ptr<const Session>& session, uid_t uid,
                                 AttachReply* reply) {
  // A doorbell is a thread of the daemon's: a uid gets limits.doorbells_per_uid of them; past
  // that its sessions decode over gRPC (the client falls back when none is granted).
  if (doorbells_.live_for_uid(uid) >= config_.limits().doorbells_per_uid()) {
    attach_counters_.doorbells_refused.fetch_add(1, std::memory_order_relaxed);
    Log().warn("session {}: no decode doorbell: uid {} has {} already (limits.doorbells_per_uid)",
               session->id.value(), uid, config_.limits().doorbells_per_uid());
    return absl::OkStatus();
  }
  UniqueFd client_fd;
  absl::StatusOr<std::unique_ptr<DecodeDoorbell>> doorbell = DecodeDoorbell::Start(
      session,
      // The doorbell's thread only waits for the answer: when the model is idle, it runs the step.
      [this](std::unique_ptr<ComputeCall> call) { engine_->SubmitOrRun(std::move(call)); },
      {.counted =
           [this] { attach_counters_.doorbell_calls.fetch_add(1, std::memory_order_relaxed); }},
      &client_fd, clock_);
  if (!doorbell.ok()) {
    engine_->EndSession(session->id, SessionEnd::kConnectionLost);
    return doorbell.status();
  }
  doorbells_.Add(session->id, *std::move(doorbell));
  reply->fds.push_back(std::move(client_fd));
  reply->response.add_fds(v1::FD_ROLE_DOORBELL);
  reply->response.set_decode_doorbell(true);
  return absl::OkStatus();
}

absl::Status Daemon::StartAttach() {
  auto attach = [this](const PeerCredentials& peer,
                       const v1::AttachRequest& request) -> absl::StatusOr<AttachReply> {
    absl::StatusOr<SessionSpec> spec =
        policy_.Decide(peer,
                       {.protocol_version = request.protocol_version(),
                        .client_name = request.client_name(),
                        .tenant = request.tenant(),
                        .model = request.model(),
                        .kv_access = request.kv_access()},
                       engine_->draining());
    if (!spec.ok()) {
      Log().warn("attach refused: pid {} uid {} gid {}: {}", peer.pid, peer.uid, peer.gid,
                 spec.status().message());
      return spec.status();
    }
    absl::StatusOr<std::shared_ptr<const Session>> opened = engine_->OpenSession(*spec);
    if (!opened.ok()) {
      Log().warn("attach refused: pid {} uid {} gid {}, tenant {}: {}", peer.pid, peer.uid,
                 peer.gid, spec->tenant, opened.status().message());
      return opened.status();
    }
    const std::shared_ptr<const Session> session = *std::move(opened);
    absl::StatusOr<PoolGrant> grant = engine_->Grant(session);
    if (!grant.ok()) {
      engine_->EndSession(session->id, SessionEnd::kConnectionLost);
      return grant.status();
    }
    AttachReply reply{.session = session->id};
    ToProto(*grant, &reply.response);
    if (grant->arena && grant->arena->fd.valid()) reply.fds.push_back(std::move(grant->arena->fd));
    if (grant->generation_table.valid()) reply.fds.push_back(std::move(grant->generation_table));
    if (request.decode_doorbell() && engine_->has_model()) {
      KVPOOL_RETURN_IF_ERROR(AddDoorbell(session, peer.uid, &reply));
    }
    Log().info("session {} attached: {} (pid {}, uid {}, tenant {}, model {}, pool {}, {}{}{})",
               session->id.value(), session->spec.client_name, peer.pid, peer.uid,
               session->spec.tenant, session->spec.model, grant->pool,
               session->spec.kv_access ? "KV access" : "compute-only",
               session->spec.admin ? ", admin" : "",
               reply.response.decode_doorbell() ? ", decode doorbell" : "");
    return reply;
  };
  auto closed = [this](SessionId id, SessionEnd how) {
    doorbells_.Remove(id);  // cancels its call in flight; joined later
    const int64_t released = engine_->EndSession(id, how);
    Log().info("session {} ended ({}); released {} sequence(s)", id.value(), SessionEndName(how),
               released);
  };
  // At accept, from the peer's credentials alone: anyone else is refused before a byte is read.
  auto admit = [this](const PeerCredentials& peer) { return policy_.Admit(peer); };
  const v1::Limits& l = config_.limits();
  const AttachLimits limits{.handshake_timeout = absl::Milliseconds(l.attach_timeout_ms()),
                            .max_pending = l.attach_pending(),
                            .max_pending_per_uid = l.attach_pending_per_uid()};
  KVPOOL_ASSIGN_OR_RETURN(
      attach_,
      AttachServer::Start(config_.runtime_dir() + "/" + wire::kAttachSocket, config_.socket_mode(),
                          limits, admit, attach, closed, &attach_counters_, clock_));
  return absl::OkStatus();
}

void Daemon::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", serving);
  health->SetServingStatus(kServiceName, serving);
}

void Daemon::Wait() {
  absl::Duration ping = absl::Seconds(5);
  uint64_t watchdog_usec = 0;
  if (config_.watchdog_ms() > 0) {
    ping = absl::Milliseconds(config_.watchdog_ms());
  } else if (sd_watchdog_enabled(0, &watchdog_usec) > 0) {
    ping = absl::Microseconds(watchdog_usec / 2);
  }
  // Health is looked at more often than the watchdog is pinged.
  const int64_t tick_ns = absl::ToInt64Nanoseconds(std::min(ping, absl::Milliseconds(500)));
  const int64_t ping_ns = absl::ToInt64Nanoseconds(ping);
  int64_t next_ping_ns = clock_->NowNanos();
  bool serving = true;
  for (;;) {
    {
      absl::MutexLock lock(&shutdown_mu_);
      if (clock_->AwaitUntil(shutdown_mu_, absl::Condition(&shutdown_requested_),
                             clock_->NowNanos() + tick_ns)) {
        return;
      }
    }
    if (serving && !engine_->health().ok()) {
      serving = false;
      SetServing(false);
      Log().critical("health NOT_SERVING: {}", engine_->health().ToString());
    }
    if (clock_->NowNanos() >= next_ping_ns) {
      sd_notify(0, "WATCHDOG=1");
      next_ping_ns = clock_->NowNanos() + ping_ns;
    }
  }
}

void Daemon::Shutdown() {
  if (stopped_) return;
  stopped_ = true;
  metrics_.reset();  // no scrape reads the engine from here on
  if (started_) {
    sd_notify(0, "STOPPING=1");
    SetServing(false);
    attach_->StopAccepting();
    engine_->Drain();
    service_->Stop();
    service_->EndStreams();
    if (!service_->WaitIdle(clock_->NowNanos() + int64_t{config_.drain_timeout_ms()} * 1'000'000)) {
      Log().warn("calls still running after {} ms: cancelling them", config_.drain_timeout_ms());
    }
  }
  engine_->StopCompute();  // fails what is still queued; the step in progress finishes
  doorbells_.StopAll();    // their calls have completed or will with that step
  if (started_) {
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
    server_->Wait();
    attach_->CloseAll();  // ends every remaining session
    attach_.reset();
    unlink((config_.runtime_dir() + "/" + wire::kGrpcSocket).c_str());
  }
  if (service_) engine_->RemoveEventListener(service_.get());
  if (event_publisher_) {
    engine_->RemoveEventListener(event_publisher_.get());
    event_publisher_.reset();  // sends what the log holds, then stops
  }
  engine_.reset();  // waits for the device, releases the pool
  model_.reset();
  Log().info("kvpoold stopped");
}

}  // namespace kvpool::daemon
