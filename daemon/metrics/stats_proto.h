#pragma once

// GetStatsResponse from the stats tables (stats_table.h): every present row as a Stat, and the
// fields GetStatsResponse had before the table, filled from the rows that name them.

#include "daemon/metrics/stats_table.h"
#include "kvpool/v1/kvpool.pb.h"

namespace kvpool::daemon {

// Appends `source`'s pool, tenant and daemon rows to out->stats and adds each row's value (times
// its proto_scale) into the field it names.
void FillStats(const StatsSource& source, v1::GetStatsResponse* out);

}  // namespace kvpool::daemon
