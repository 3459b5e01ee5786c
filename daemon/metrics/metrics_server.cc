#include "daemon/metrics/metrics_server.h"

#include <exception>

#include "fmt/format.h"
#include "prometheus/exposer.h"

namespace kvpool::daemon {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    std::string_view listen, const Engine* engine, const AttachCounters* attach,
    const RpcCounters* rpcs, const EventStreamCounters* streams, const ZmqEventCounters* zmq) {
  absl::StatusOr<std::string> address = MetricsBindAddress(listen);
  if (!address.ok()) return address.status();
  auto collector = std::make_shared<StatsCollector>(engine, attach, rpcs, streams, zmq);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {  // civetweb reports a failed bind by throwing; nothing of ours throws
    exposer = std::make_unique<prometheus::Exposer>(*address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        fmt::format("metrics: cannot listen on {}: {}", *address, e.what()));
  }
  exposer->RegisterCollectable(collector);
  const std::vector<int> ports = exposer->GetListeningPorts();
  const int port = ports.empty() ? 0 : ports.front();
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(collector), std::move(exposer), port));
}

MetricsServer::MetricsServer(std::shared_ptr<StatsCollector> collector,
                             std::unique_ptr<prometheus::Exposer> exposer, int port)
    : collector_(std::move(collector)), exposer_(std::move(exposer)), port_(port) {}

MetricsServer::~MetricsServer() = default;  // the Exposer stops its threads first

}  // namespace kvpool::daemon
