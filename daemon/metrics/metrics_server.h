#pragma once

// MetricsServer: kvpoold's Prometheus endpoint, GET /metrics over HTTP (config.proto
// MetricsSpec), served by prometheus-cpp's Exposer (civetweb) from a StatsCollector. Its threads
// only read the engine's stats; stopping it (destroying it) waits for a scrape in progress.
// The engine and the attach counters must outlive it.

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/metrics_config.h"

namespace prometheus {
class Exposer;
}

namespace kvpool::daemon {

class MetricsServer final {
 public:
  // Serves /metrics on `listen` (MetricsBindAddress; port 0 picks a free one). Errors:
  // INVALID_ARGUMENT (the address), UNAVAILABLE (it could not be bound).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      std::string_view listen, const Engine* engine, const AttachCounters* attach,
      const RpcCounters* rpcs, const EventStreamCounters* streams, const ZmqEventCounters* zmq);
  ~MetricsServer();

  int port() const { return port_; }  // the port bound

 private:
  MetricsServer(std::shared_ptr<StatsCollector> collector,
                std::unique_ptr<prometheus::Exposer> exposer, int port);

  std::shared_ptr<StatsCollector> collector_;  // shared: the Exposer takes a weak_ptr
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace kvpool::daemon
