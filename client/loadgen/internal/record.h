#pragma once

// What a kvpool-loadgen worker process tells the parent, one fixed-size record at a time (pipe
// writes of this size are atomic).

#include <cstdint>

namespace kvpool::loadgen::internal {

enum class Op : uint8_t { kAllocate, kGrow, kCommit, kFree, kPrefill, kDecode, kCount };
inline constexpr const char* kOpNames[] = {"allocate", "grow",    "commit",
                                           "free",     "prefill", "decode"};

struct Record {
  enum class Kind : uint8_t { kRequest, kLatency, kError } kind;
  Op op = Op::kAllocate;
  bool rejected = false;
  int64_t a = 0;  // request: prompt tokens; latency: nanoseconds
  int64_t b = 0;  // request: reused (prefix-hit) tokens
  int64_t c = 0;  // request: decoded (generated) tokens
  int64_t d = 0;  // request: KV mismatches
};

}  // namespace kvpool::loadgen::internal
