// The RPC floor rpc_bench compares kvpoold with: a minimal synchronous gRPC C++ server (the sync
// API, default options) that answers kvpool.v1.KvPool/Ping with an empty reply and nothing else,
// on a Unix socket, in a process of its own like the daemon.
//
//   bare_grpc_server SOCKET_PATH     # prints "ready" once serving; exits on SIGTERM or SIGINT

#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace {

class BarePing final : public kvpool::v1::KvPool::Service {
  grpc::Status Ping(grpc::ServerContext*, const kvpool::v1::PingRequest*,
                    kvpool::v1::PingResponse*) override {
    return grpc::Status::OK;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: bare_grpc_server SOCKET_PATH\n");
    return 2;
  }
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before gRPC starts its threads

  BarePing service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(std::string("unix:") + argv[1], grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
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
