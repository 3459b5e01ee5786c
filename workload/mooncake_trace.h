#pragma once

// Mooncake-format request traces (kvcache-ai/Mooncake FAST'25 traces, one JSON object per line:
// timestamp, input_length, output_length, hash_ids) and their expansion into token ids.
//
// Each hash id names one 512-token block of the prompt; ids are chained, so two requests share a
// prefix exactly as far as their leading ids agree. Expansion turns id `h` into 512 tokens
// deterministically (token j = a hash of (h, j) reduced to the vocabulary) and cuts the last block
// to input_length, so equal ids give equal tokens and different ids (almost surely) differ from
// the first token on.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvpool::workload {

inline constexpr int32_t kTraceBlockTokens = 512;
inline constexpr int32_t kDefaultVocab = 128000;

struct TraceRequest {
  int64_t timestamp_ms = 0;
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<int64_t> hash_ids;
};

// Reads a whole trace. Errors: NOT_FOUND (no such file), INVALID_ARGUMENT naming the line of the
// first malformed record (bad JSON, missing field, or hash_ids that do not cover input_length).
absl::StatusOr<std::vector<TraceRequest>> ReadMooncakeTrace(const std::string& path);

// The request's prompt as token ids (input_length of them).
std::vector<int32_t> ExpandTokens(const TraceRequest& request, int32_t vocab = kDefaultVocab);

}  // namespace kvpool::workload
