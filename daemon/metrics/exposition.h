#pragma once

// The stats tables (stats_table.h) as Prometheus metric families, read from the engine at each
// scrape: every pool's pool and tenant rows (labelled pool=, tenant=), then the daemon rows once.
// Nothing is counted twice: the engine's own counters are read, so serving /metrics adds no work
// to any call, only to the scrape (one Engine::Stats per pool under the engine's reader lock).

#include <memory>
#include <vector>

#include "daemon/engine/engine.h"
#include "daemon/metrics/edge_counters.h"
#include "daemon/metrics/rpc_counters.h"
#include "daemon/metrics/stats_table.h"
#include "daemon/metrics/stream_counters.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace kvpool::daemon {

// The families of every pool of `engine`; `attach` and `rpcs` may be null.
// `streams` and `zmq` may be null too (their rows are then absent).
std::vector<prometheus::MetricFamily> CollectFamilies(const Engine& engine,
                                                      const AttachCounters* attach,
                                                      const RpcCounters* rpcs = nullptr,
                                                      const EventStreamCounters* streams = nullptr,
                                                      const ZmqEventCounters* zmq = nullptr);

// The families of one source (one pool's figures, with the daemon rows): what CollectFamilies
// makes of each pool, for a caller that has the stats already (tests).
std::vector<prometheus::MetricFamily> CollectFamilies(const StatsSource& source);

// CollectFamilies as a prometheus::Collectable (what prometheus::Exposer serves). Thread-safe;
// what it is given must outlive it.
class StatsCollector final : public prometheus::Collectable {
 public:
  StatsCollector(const Engine* engine, const AttachCounters* attach, const RpcCounters* rpcs,
                 const EventStreamCounters* streams = nullptr,
                 const ZmqEventCounters* zmq = nullptr)
      : engine_(engine), attach_(attach), rpcs_(rpcs), streams_(streams), zmq_(zmq) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    return CollectFamilies(*engine_, attach_, rpcs_, streams_, zmq_);
  }

 private:
  const Engine* const engine_;
  const AttachCounters* const attach_;
  const RpcCounters* const rpcs_;
  const EventStreamCounters* const streams_;
  const ZmqEventCounters* const zmq_;
};

}  // namespace kvpool::daemon
