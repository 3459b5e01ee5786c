#include "daemon/metrics/exposition.h"

#include <limits>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "daemon/metrics/stats_table.h"

namespace kvpool::daemon {
namespace {

prometheus::MetricType TypeOf(StatKind kind) {
  switch (kind) {
    case StatKind::kCounter:
      return prometheus::MetricType::Counter;
    case StatKind::kGauge:
      return prometheus::MetricType::Gauge;
    case StatKind::kHistogram:
      return prometheus::MetricType::Histogram;
  }
  return prometheus::MetricType::Untyped;
}

// Prometheus's buckets are cumulative and end with +Inf; Histogram's are not and do too.
prometheus::ClientMetric::Histogram ToPrometheus(const Histogram& h) {
  prometheus::ClientMetric::Histogram out;
  out.sample_count = h.count();
  out.sample_sum = h.sum();
  uint64_t below = 0;
  for (size_t i = 0; i < h.counts().size(); ++i) {
    below += h.counts()[i];
    out.bucket.push_back({.cumulative_count = below,
                          .upper_bound = i < h.bounds().size()
                                             ? h.bounds()[i]
                                             : std::numeric_limits<double>::infinity()});
  }
  return out;
}

// Families by exported name, in the order their first rows come.
class FamilySet {
 public:
  void Add(const StatSample& s) {
    const std::string name = ExportedName(s.name, s.kind);
    auto [it, inserted] = index_.try_emplace(name, families_.size());
    if (inserted) {
      families_.push_back(
          {.name = name, .help = std::string(s.help), .type = TypeOf(s.kind), .metric = {}});
    }
    prometheus::ClientMetric& m = families_[it->second].metric.emplace_back();
    for (const auto& [label, value] : s.labels) {
      m.label.push_back({.name = std::string(label), .value = std::string(value)});
    }
    switch (s.kind) {
      case StatKind::kCounter:
        m.counter.value = s.value;
        return;
      case StatKind::kGauge:
        m.gauge.value = s.value;
        return;
      case StatKind::kHistogram:
        m.histogram = ToPrometheus(*s.histogram);
        return;
    }
  }
  std::vector<prometheus::MetricFamily> Take() { return std::move(families_); }

 private:
  absl::flat_hash_map<std::string, size_t> index_;
  std::vector<prometheus::MetricFamily> families_;
};

}  // namespace

std::vector<prometheus::MetricFamily> CollectFamilies(const Engine& engine,
                                                      const AttachCounters* attach,
                                                      const RpcCounters* rpcs,
                                                      const EventStreamCounters* streams,
                                                      const ZmqEventCounters* zmq) {
  FamilySet families;
  std::optional<EventStreamStats> stream_stats;
  if (streams != nullptr) stream_stats = streams->Read();
  for (int32_t pool = 0; pool < engine.num_pools(); ++pool) {
    const EngineStats stats = engine.Stats(pool);
    ForEachStat({.engine = &stats,
                 .attach = attach,
                 .rpcs = rpcs,
                 .streams = stream_stats ? &*stream_stats : nullptr,
                 .zmq = zmq},
                /*daemon_rows=*/pool == 0, [&](const StatSample& s) { families.Add(s); });
  }
  return families.Take();
}

std::vector<prometheus::MetricFamily> CollectFamilies(const StatsSource& source) {
  FamilySet families;
  ForEachStat(source, /*daemon_rows=*/true, [&](const StatSample& s) { families.Add(s); });
  return families.Take();
}

}  // namespace kvpool::daemon
