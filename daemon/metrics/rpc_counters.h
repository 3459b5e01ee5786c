#pragma once

// RpcCounters: the KvPool service's calls, by method and status code, counted by a gRPC server
// interceptor as each call sends its status (so refusals before a handler runs, such as
// UNAUTHENTICATED, count too). Calls of other services (health, reflection) are not counted.
// Thread-safe: relaxed atomic counters; a snapshot may be a few calls behind a concurrent one.

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "grpcpp/support/server_interceptor.h"

namespace kvpool::daemon {

class RpcCounters final {
 public:
  static constexpr int kNumCodes = 17;  // grpc::StatusCode OK .. UNAUTHENTICATED

  RpcCounters();  // one row per method of kvpool.v1.KvPool

  // The index of `method` ("/kvpool.v1.KvPool/Allocate"); -1 for another service's.
  int MethodIndex(std::string_view method) const;
  void Count(int method, int code) {
    if (method < 0 || code < 0 || code >= kNumCodes) return;
    counts_[static_cast<size_t>(method)][static_cast<size_t>(code)].fetch_add(
        1, std::memory_order_relaxed);
  }

  struct Entry {
    std::string_view method;  // "Allocate"
    std::string_view code;    // "OK", "NOT_FOUND", ...
    uint64_t calls = 0;
  };
  // Every (method, code) with at least one call, by method then code.
  std::vector<Entry> Snapshot() const;

  // The interceptor factory to give grpc::ServerBuilder; `counters` must outlive the server.
  static std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Interceptor(
      RpcCounters* counters);

 private:
  std::vector<std::string> names_;               // method names, by index
  absl::flat_hash_map<std::string, int> index_;  // "/kvpool.v1.KvPool/<name>" -> index
  std::vector<std::array<std::atomic<uint64_t>, kNumCodes>> counts_;  // [method][code]
};

}  // namespace kvpool::daemon
