#pragma once

// kvpoolctl's output: aligned human-readable tables, JSON (--json) and the Chrome/Perfetto trace
// export of block traces. Pure functions of the daemon's responses, so they are tested without a
// daemon.
//
// Thread-safe (no shared state).

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "kvpool/v1/kvpool.pb.h"

namespace kvpool::client::ctl {

enum class TraceFormat : uint8_t {
  kText,    // an aligned table, one line per operation
  kJson,    // {"entries": [...]} as in DumpBlockTraceResponse
  kChrome,  // Chrome / Perfetto trace-event JSON (chrome://tracing, ui.perfetto.dev)
};

// "text", "json" or "chrome". Errors: INVALID_ARGUMENT naming the accepted values.
absl::StatusOr<TraceFormat> ParseTraceFormat(std::string_view name);

// Any message as one JSON object on one line: every field under its proto name (defaults
// included), enums by name, 64-bit integers as numbers, bytes as hex and BlockHash as a
// 32-digit hex string ("<hi><lo>").
std::string ToJson(const google::protobuf::Message& message);

// Each returns the complete output, ending in a newline; `json` selects ToJson() (pretty-printed
// for the one-shot commands).
std::string FormatStats(const v1::GetStatsResponse& stats, bool json);
std::string FormatSessions(const v1::ListSessionsResponse& sessions, bool json);
std::string FormatPins(const v1::ListPinsResponse& pins, bool json);
std::string FormatSequences(const v1::ListSequencesResponse& sequences, bool json);
std::string FormatTrace(const v1::DumpBlockTraceResponse& trace, TraceFormat format);
std::string FormatExplain(const v1::ExplainMatchResponse& explain, bool json);
std::string FormatCheck(const v1::CheckInvariantsResponse& check, bool json);
// One stream message: a line per event (and one for a snapshot header), or one JSON line.
std::string FormatEvents(const v1::WatchEventsResponse& events, bool json);

// The Chrome trace-event document for `trace`: one track per block (tid = block id, named
// "block N"), an instant event per operation (name = op; args refs, generation, session,
// sequence, site, op_seq) and a complete event per (block, generation) spanning its operations.
// Timestamps are microseconds (time_ns / 1000).
std::string ChromeTrace(const v1::DumpBlockTraceResponse& trace);

}  // namespace kvpool::client::ctl
