// The RPC floor rpc_bench compares kvpoold with: a minimal synchronous gRPC C++ server (the sync
// API, default options) that answers kvpool.v1.KvPool/Ping with an empty reply and nothing else,
// on a Unix socket, in a process of its own like the daemon.
//
//   bare_grpc_server SOCKET_PATH [callback]   # prints "ready" once serving; exits on SIGTERM
//
// With `callback` it answers through the callback API instead (kvpoold's), to tell what the API
// costs from what kvpoold adds.

#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace {

class BarePing final : public kvpool::v1::KvPool::Service {
  grpc::Status Ping(grpc::ServerContext*, const kvpool::v1::PingRequest*,
                    kvpool::v1::PingResponse*) override {
    return grpc::Status::OK;
  }
};

class BareCallbackPing final : public kvpool::v1::KvPool::CallbackService {
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* context,
                                 const kvpool::v1::PingRequest*,
                                 kvpool::v1::PingResponse*) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

}  // namespace

int main(int argc, char** argv) {
  // A bare gRPC server at its best, as kvpoold runs: absl's deadlock detection (on by default in
  // Debian's debug build of absl) would tax every one of gRPC's own locks.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const bool callback = argc == 3 && std::string(argv[2]) == "callback";
  if (argc != 2 && !callback) {
    std::fprintf(stderr, "usage: bare_grpc_server SOCKET_PATH [callback]\n");
    return 2;
  }
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before gRPC starts its threads

  BarePing sync_service;
  BareCallbackPing callback_service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(std::string("unix:") + argv[1], grpc::InsecureServerCredentials());
  if (callback) {
    builder.RegisterService(&callback_service);
  } else {
    builder.RegisterService(&sync_service);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "bare_grpc_server: cannot listen on %s\n", argv[1]);
    return 1;
  }
  std::printf("ready\n");
  std::fflush(stdout);
  int signal = 0;
  sigwait(&stop, &signal);
  server->Shutdown();
  return 0;
}
