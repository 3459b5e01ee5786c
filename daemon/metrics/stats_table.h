#pragma once

// The daemon's stats, declared once. Each row of a table names a figure (its name, kind, unit,
// help and labels) and says where its value comes from; GetStats (stats_proto.h), `kvpoolctl
// stats` (which prints GetStatsResponse.stats) and /metrics (exposition.h) are all made from
// these rows, so adding a figure is one row plus the code that counts it. A row may also name
// the GetStatsResponse field that carried the figure before the table existed: GetStats keeps
// filling it (wire compatibility), and rows naming the same field add up into it (the
// eviction reasons sum to `evictions`). The name is a path below GetStatsResponse
// ("tiers.lookups"); through a repeated message ("tiers.stores.hits") it picks the element
// whose field named like the row's label holds the label's value (medium="disk").
//
// Four tables: pool rows (one value per pool: blocks, cache, model steps, and the tiers':
// tier_stat_rows.h), daemon rows
// (one value for the whole daemon: sessions, calls, the attach socket), tenant rows (one value
// per pool and tenant, the tenants bounded by TenantCounterTable) and rpc rows (one value per
// gRPC method and status code that occurred: at most 26 x 17).
//
// Names: snake_case; /metrics shows a row as kvpool_<name> (counters with _total), except rows
// named with a "vllm:" prefix, which keep vLLM's names (and get vLLM's model_name label) for the
// dashboards and autoscalers that already query them. Thread-safe: the tables are constants.

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "daemon/engine/engine.h"
#include "daemon/metrics/edge_counters.h"
#include "daemon/metrics/rpc_counters.h"
#include "daemon/metrics/stream_counters.h"
#include "kvpool/util/histogram.h"

namespace kvpool::daemon {

enum class StatKind : uint8_t {
  kCounter,    // only grows while the daemon runs
  kGauge,      // a level
  kHistogram,  // observations in buckets
};
std::string_view StatKindName(StatKind kind);  // "counter", "gauge", "histogram"

// What the rows read: one pool's figures (with the daemon's), the attach socket's counters, the
// gRPC service's, and the event streams' (WatchEvents, the ZeroMQ publisher).
struct StatsSource {
  const EngineStats* engine = nullptr;        // never null
  const AttachCounters* attach = nullptr;     // null: no attach socket (its rows read 0)
  const RpcCounters* rpcs = nullptr;          // null: no calls counted (no rpc rows)
  const EventStreamStats* streams = nullptr;  // null: no WatchEvents figures (their rows absent)
  const ZmqEventCounters* zmq = nullptr;      // null: no ZeroMQ publisher (its rows absent)
};

// A label a row sets to a fixed value: rows of one name differ by it (reason="capacity").
struct StatLabel {
  std::string_view name;
  std::string_view value;
};

template <typename Source>
struct StatRow {
  std::string_view name;
  StatKind kind;
  std::string_view unit;
  std::string_view help;
  StatLabel label;               // name empty: none
  std::string_view proto_field;  // GetStatsResponse field (path) it also fills; empty: none
  double proto_scale = 1;        // that field holds value * proto_scale (model_busy_us)
  // Exactly one of these, by kind: the value of a counter or gauge, or the histogram.
  double (*value)(const Source&) = nullptr;
  const Histogram* (*histogram)(const Source&) = nullptr;
  // Whether the figure exists for this source (the model's rows without a model, a tier's
  // without that tier); null: always. An absent row is neither sent nor exported.
  bool (*present)(const Source&) = nullptr;
};

using PoolRow = StatRow<StatsSource>;
using TenantRow = StatRow<TenantCounters>;
using RpcRow = StatRow<RpcCounters::Entry>;

std::span<const PoolRow> PoolStatRows();
std::span<const PoolRow> DaemonStatRows();
std::span<const TenantRow> TenantStatRows();
std::span<const RpcRow> RpcStatRows();

// One value of one row, as every output sees it: the row and its label values (pool, tenant,
// model_name and the row's own label, in that order, those that apply).
struct StatSample {
  std::string_view name;
  StatKind kind;
  std::string_view unit;
  std::string_view help;
  std::vector<std::pair<std::string_view, std::string_view>> labels;
  double value = 0;
  const Histogram* histogram = nullptr;  // kHistogram; valid while the source is
  StatLabel label;                       // the row's own label (name empty: none)
  std::string_view proto_field;
  double proto_scale = 1;
};

// Calls `fn` for every present row of `source`: the pool rows and tenant rows of its pool,
// then, when `daemon_rows`, the daemon rows and rpc rows (once per scrape, not once per pool).
void ForEachStat(const StatsSource& source, bool daemon_rows,
                 const std::function<void(const StatSample&)>& fn);

// The name /metrics gives a row: kvpool_<name>, or the name itself with a "vllm:" prefix; a
// counter's ends in _total.
std::string ExportedName(std::string_view name, StatKind kind);

}  // namespace kvpool::daemon
