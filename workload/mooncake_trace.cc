#include "workload/mooncake_trace.h"

#include <fstream>

#include "fmt/format.h"
#include "nlohmann/json.hpp"

namespace kvpool::workload {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<std::vector<TraceRequest>> ReadMooncakeTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(fmt::format("cannot open trace {}", path));
  std::vector<TraceRequest> requests;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(fmt::format("{}:{}: {}", path, number, why));
    };
    if (record.is_discarded() || !record.is_object()) return bad("not a JSON object");
    for (const char* field : {"timestamp", "input_length", "output_length", "hash_ids"}) {
      if (!record.contains(field)) return bad(fmt::format("missing field '{}'", field));
    }
    const nlohmann::json& ids = record["hash_ids"];
    if (!record["input_length"].is_number_integer() || !ids.is_array()) {
      return bad("input_length must be an integer and hash_ids an array");
    }
    TraceRequest r;
    r.timestamp_ms = record["timestamp"].get<int64_t>();
    r.input_length = record["input_length"].get<int64_t>();
    r.output_length = record["output_length"].get<int64_t>();
    for (const nlohmann::json& id : ids) {
      if (!id.is_number_integer()) return bad("hash_ids must be integers");
      r.hash_ids.push_back(id.get<int64_t>());
    }
    const int64_t blocks = (r.input_length + kTraceBlockTokens - 1) / kTraceBlockTokens;
    if (r.input_length < 0 || static_cast<int64_t>(r.hash_ids.size()) != blocks) {
      return bad(fmt::format("{} hash_ids for {} input tokens", r.hash_ids.size(), r.input_length));
    }
    requests.push_back(std::move(r));
  }
  return requests;
}

std::vector<int32_t> ExpandTokens(const TraceRequest& request, int32_t vocab) {
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(request.input_length));
  for (size_t b = 0; b < request.hash_ids.size(); ++b) {
    const uint64_t base = SplitMix(static_cast<uint64_t>(request.hash_ids[b]));
    for (int32_t j = 0;
         j < kTraceBlockTokens && static_cast<int64_t>(tokens.size()) < request.input_length; ++j) {
      tokens.push_back(static_cast<int32_t>(SplitMix(base + static_cast<uint64_t>(j)) %
                                            static_cast<uint64_t>(vocab)));
    }
  }
  return tokens;
}

}  // namespace kvpool::workload
