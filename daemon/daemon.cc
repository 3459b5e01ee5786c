#include "daemon/daemon.h"

#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/attach_server.h"
#include "daemon/config.h"
#include "daemon/pool.h"
#include "daemon/service.h"
#include "daemon/sessions.h"
#include "daemon/step_runner.h"
#include "fmt/format.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/v1/wire.h"
#include "model/step_model.h"
#include "model/weights.h"

namespace kvpool::daemon {
namespace {

spdlog::logger& Log() { return Logger("daemon"); }

// True when something answers on `path` (another kvpoold is live there).
bool SomeoneListens(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool live = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return live;
}

bool Allowed(const v1::DaemonConfig& config, const PeerCredentials& peer) {
  return std::find(config.allowed_uids().begin(), config.allowed_uids().end(), peer.uid) !=
             config.allowed_uids().end() ||
         std::find(config.allowed_gids().begin(), config.allowed_gids().end(), peer.gid) !=
             config.allowed_gids().end();
}

uint64_t NewEpoch() {
  const std::string token = NewToken();  // 128 random bits
  return std::stoull(token.substr(0, 16), nullptr, 16) | 1;
}

// Loads the configured model onto the pool's device and starts its step runner; leaves both null
// for "none", or when the device's backend cannot run a model (UNAVAILABLE: a GPU host without
// cuBLAS), which is logged: the pool still serves everything but the compute RPCs.
absl::Status StartModel(const v1::DaemonConfig& config, kernels::Device* device, DaemonPool* pool,
                        std::unique_ptr<model::StepModel>* model,
                        std::unique_ptr<StepRunner>* runner) {
  const v1::ModelSpec& spec = config.model();
  if (spec.checkpoint().empty() && spec.name() == "none") return absl::OkStatus();
  const std::string name = spec.checkpoint().empty() ? spec.name() : spec.checkpoint();
  const absl::Time start = absl::Now();
  absl::StatusOr<model::ModelWeights> weights;
  if (spec.checkpoint().empty()) {
    absl::StatusOr<model::ModelConfig> named = model::NamedConfig(spec.name());
    if (!named.ok()) return named.status();
    weights = model::SyntheticWeights(*named, spec.seed());
  } else {
    weights = model::LoadCheckpoint(spec.checkpoint());
  }
  if (!weights.ok()) return weights.status();
  const model::ModelConfig mc = weights->config;
  absl::StatusOr<std::unique_ptr<model::StepModel>> created =
      model::CreateStepModel(std::move(*weights), pool->layout(), device, spec.threads());
  if (created.status().code() == absl::StatusCode::kUnavailable) {
    Log().error("model {}: {}; Prefill/Decode/Generate are off", name, created.status().message());
    return absl::OkStatus();
  }
  if (!created.ok()) return created.status();
  *model = std::move(*created);
  *runner = std::make_unique<StepRunner>(
      pool, model->get(),
      StepRunner::Options{.gather_window = absl::Microseconds(spec.gather_window_us()),
                          .batching = !spec.disable_batching(),
                          .max_step_tokens = spec.max_step_tokens()});
  pool->set_model(name, mc.vocab_size, mc.max_position);
  Log().info("model {} on {}: {} layers, hidden {}, vocab {}, {:.1f} MiB of weights, loaded in {}",
             name, (*model)->where(), mc.num_layers, mc.hidden_size, mc.vocab_size,
             static_cast<double>((*model)->weight_bytes()) / (1 << 20),
             absl::FormatDuration(absl::Now() - start));
  return absl::OkStatus();
}

// The sigwait thread's id, for ForwardSignal.
std::atomic<pid_t> g_signal_thread{0};

// Runs on a thread that does not block SIGTERM/SIGINT (a library's): hands the signal to the
// sigwait thread, which blocks it, so it waits there for sigwait. tgkill is a plain system call
// (async-signal-safe).
extern "C" void ForwardSignal(int sig) {
  const pid_t tid = g_signal_thread.load();
  if (tid != 0) syscall(SYS_tgkill, getpid(), tid, sig);
}

}  // namespace

int Run(const RunOptions& options) {
  // Debian's Abseil is built with mutex deadlock detection on, which costs on every lock; the
  // daemon's lock order is fixed (pool, then writers) and checked by its tests.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Signals go to the sigwait thread only: block them before any thread of ours starts. Threads
  // libraries started before main() (OpenBLAS starts its pool in a constructor) do not block
  // them, so a handler forwards what lands there to the sigwait thread.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  absl::Notification shutdown;
  std::atomic<int> received{0};
  absl::Notification listening;
  std::thread signal_thread([&] {
    g_signal_thread.store(static_cast<pid_t>(syscall(SYS_gettid)));
    listening.Notify();
    for (;;) {
      int sig = 0;
      if (sigwait(&signals, &sig) != 0) continue;
      if (received.fetch_add(1) == 0) {
        Log().info("signal {}: shutting down (send it again to force)", sig);
        shutdown.Notify();
      } else {
        std::fprintf(stderr, "kvpoold: second signal: exiting now\n");
        _exit(1);
      }
    }
  });
  signal_thread.detach();  // lives until the process exits (it may force that exit)
  listening.WaitForNotification();
  struct sigaction forward = {};
  forward.sa_handler = ForwardSignal;
  sigaction(SIGTERM, &forward, nullptr);
  sigaction(SIGINT, &forward, nullptr);

  absl::StatusOr<v1::DaemonConfig> loaded = LoadConfig(options.config_path);
  if (!loaded.ok()) {
    std::fprintf(stderr, "kvpoold: invalid configuration:\n%s\n",
                 std::string(loaded.status().message()).c_str());
    return 2;
  }
  v1::DaemonConfig config = *std::move(loaded);
  if (!options.listen.empty()) config.set_runtime_dir(options.listen);
  if (!options.backend.empty()) config.set_backend(options.backend);
  if (!options.log_level.empty()) config.set_log_level(options.log_level);
  if (std::vector<std::string> problems = ValidateConfig(config); !problems.empty()) {
    std::fprintf(stderr, "kvpoold: invalid configuration:\n");
    for (const std::string& p : problems) std::fprintf(stderr, "flag: %s\n", p.c_str());
    return 2;
  }
  if (absl::Status s = SetLogLevel(config.log_level()); !s.ok()) {
    std::fprintf(stderr, "kvpoold: %s\n", s.ToString().c_str());
    return 2;
  }

  const std::string dir = config.runtime_dir();
  const std::string grpc_path = dir + "/" + wire::kGrpcSocket;
  const std::string attach_path = dir + "/" + wire::kAttachSocket;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    Log().critical("cannot create runtime directory {}: {}", dir, ec.message());
    return 1;
  }
  if (SomeoneListens(attach_path)) {
    Log().critical("another kvpoold is already running in {}", dir);
    return 1;
  }
  unlink(grpc_path.c_str());  // stale, from a daemon that died

  absl::StatusOr<kernels::BackendKind> backend = kernels::ParseBackend(config.backend());
  absl::StatusOr<std::unique_ptr<kernels::Device>> device =
      kernels::CreateDevice({.kind = *backend,
                             .device_ordinal = config.device_ordinal(),
                             .cpu_threads = config.cpu_threads()});
  if (!device.ok()) {
    Log().critical("device: {}", device.status().ToString());
    return 1;
  }
  const uint64_t epoch = NewEpoch();
  absl::StatusOr<std::unique_ptr<DaemonPool>> pool =
      DaemonPool::Create(config, device->get(), epoch);
  if (!pool.ok()) {
    Log().critical("pool: {}", pool.status().ToString());
    return 1;
  }
  Log().info("pool: {} on {}", (*pool)->layout().ToString(), (*device)->name());

  std::unique_ptr<model::StepModel> model;
  std::unique_ptr<StepRunner> runner;
  if (absl::Status s = StartModel(config, device->get(), pool->get(), &model, &runner); !s.ok()) {
    Log().critical("model: {}", s.message());
    return 1;
  }

  SessionRegistry sessions;
  KvPoolService service(pool->get(), &sessions, runner.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + grpc_path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    Log().critical("cannot serve gRPC on {}", grpc_path);
    return 1;
  }
  chmod(grpc_path.c_str(), config.socket_mode());

  DaemonPool* p = pool->get();
  auto attach = [&](const PeerCredentials& peer,
                    const v1::AttachRequest& request) -> absl::StatusOr<AttachGrant> {
    if (!Allowed(config, peer)) {
      Log().warn("attach refused: pid {} uid {} gid {} is not allowed", peer.pid, peer.uid,
                 peer.gid);
      return absl::PermissionDeniedError(
          fmt::format("uid {} gid {} may not attach to this kvpoold", peer.uid, peer.gid));
    }
    if (request.protocol_version() != wire::kProtocolVersion) {
      return absl::InvalidArgumentError(fmt::format("protocol version {} (this daemon speaks {})",
                                                    request.protocol_version(),
                                                    wire::kProtocolVersion));
    }
    if (p->draining()) return absl::UnavailableError("kvpoold is draining");
    const std::string tenant = request.tenant().empty() ? "default" : request.tenant();
    const std::string model = request.model().empty() ? "default" : request.model();
    std::shared_ptr<const Session> session = sessions.Add(Session{
        .client_name = request.client_name(),
        .pid = peer.pid,
        .uid = peer.uid,
        .gid = peer.gid,
        .tenant = tenant,
        .model = model,
        .ns = p->NamespaceOf(tenant, model),
        .admin = std::find(config.admin_uids().begin(), config.admin_uids().end(), peer.uid) !=
                 config.admin_uids().end(),
        .attached = absl::Now()});
    absl::StatusOr<AttachGrant> grant = p->Attach(*session);
    if (!grant.ok()) sessions.Remove(session->id);
    Log().info("session {} attached: {} (pid {}, tenant {}, model {})", session->id.value(),
               request.client_name(), peer.pid, tenant, model);
    return grant;
  };
  auto closed = [&](SessionId id) {
    std::shared_ptr<const Session> session = sessions.Remove(id);
    const int64_t released = p->ReleaseSession(id);
    service.NotifyEvents();
    Log().info("session {} ({}) ended; released {} sequence(s)", id.value(),
               session ? session->client_name : "?", released);
  };
  absl::StatusOr<std::unique_ptr<AttachServer>> attach_server =
      AttachServer::Start(attach_path, config.socket_mode(), attach, closed);
  if (!attach_server.ok()) {
    Log().critical("attach socket: {}", attach_server.status().ToString());
    return 1;
  }

  server->GetHealthCheckService()->SetServingStatus(true);
  sd_notifyf(0, "READY=1\nSTATUS=serving %d blocks on %s\nMAINPID=%d", (*pool)->layout().num_blocks,
             (*device)->name().c_str(), getpid());
  Log().info("kvpoold ready in {} (epoch {:016x})", dir, epoch);

  // Main loop: wait for a signal, pinging the systemd watchdog meanwhile.
  uint64_t watchdog_usec = 0;
  absl::Duration ping = absl::Seconds(5);
  if (config.watchdog_ms() > 0) {
    ping = absl::Milliseconds(config.watchdog_ms());
  } else if (sd_watchdog_enabled(0, &watchdog_usec) > 0) {
    ping = absl::Microseconds(watchdog_usec / 2);
  }
  while (!shutdown.WaitForNotificationWithTimeout(ping)) sd_notify(0, "WATCHDOG=1");

  // Shutdown, in order.
  sd_notify(0, "STOPPING=1");
  server->GetHealthCheckService()->SetServingStatus(false);
  (*attach_server)->StopAccepting();
  p->Drain();
  service.Stop();
  service.EndStreams();
  if (!service.WaitIdle(absl::Now() + absl::Milliseconds(config.drain_timeout_ms()))) {
    Log().warn("calls still running after {} ms: cancelling them", config.drain_timeout_ms());
  }
  if (runner) runner->Stop();  // fails what is still queued; the step in progress finishes
  server->Shutdown(absl::ToChronoTime(absl::Now()));
  server->Wait();
  (*attach_server)->CloseAll();  // releases every remaining session
  attach_server->reset();
  if (absl::Status s = (*device)->SynchronizeAll(); !s.ok()) {
    Log().error("device at shutdown: {}", s.ToString());
  }
  pool->reset();
  unlink(grpc_path.c_str());
  Log().info("kvpoold stopped");
  return 0;
}

}  // namespace kvpool::daemon
