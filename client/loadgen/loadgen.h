#pragma once

// kvpool-loadgen: several client processes, each a serving frontend, driving kvpoold with a real
// workload.
//
// The parent forks `workers` processes (before it touches gRPC). Each attaches (one session per
// tenant it serves) and serves the requests it owns in one of two modes:
//
// Model (the default): the frontend runs no model; the daemon's does. Prefill the prompt (the
// conversation so far, as the model generated it, plus a new user message), Decode the reply one
// token at a time, free with commit so the next turn reuses it. Reports tokens/s, time to first
// token and inter-token latency.
//
// KV: the frontend is an engine that computes KV itself and uses the daemon as its KV manager:
// allocate the prompt with prefix match; check that every reused token's KV, read through its own
// mapping of the pool, is exactly what computing those tokens would have written (KV is simulated
// as a function of the token prefix, as causal attention makes it); write the rest; commit the
// prompt; decode the reply one token at a time (Grow by one, write its KV); commit the reply and
// free. The parent aggregates progress from pipes and prints a summary.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvpool::loadgen {

enum class Mode : uint8_t { kModel, kKv };

struct Options {
  std::string runtime_dir;  // empty: the default runtime directory
  Mode mode = Mode::kModel;
  int32_t workers = 4;
  // Generated workload (the default).
  uint64_t seed = 1;
  int32_t tenants = 3;
  int32_t conversations = 24;
  int32_t turns = 4;
  // Or a Mooncake trace: prompts and replies cut to fit the pool.
  std::string trace;
  int64_t max_requests = 0;  // 0: all
  // Prompts are cut to this (0: to the model's context and a share of the pool per worker).
  int64_t max_prompt_tokens = 0;
  int64_t max_reply_tokens = 256;
  // Model mode: Decode through each session's decode doorbell (else the Decode RPC).
  bool decode_doorbell = true;
  bool progress = true;  // a live line on stderr when it is a terminal
};

struct Summary {
  int64_t requests = 0;
  int64_t completed = 0;
  int64_t rejected = 0;  // RESOURCE_EXHAUSTED (the pool or a quota was full)
  int64_t errors = 0;    // any other failure
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;
  int64_t decoded_tokens = 0;
  int64_t kv_mismatches = 0;  // KV mode: reused KV that was not what it should be (must be 0)
  // Model mode.
  double tokens_per_second = 0;             // generated tokens over the run's wall time
  double ttft_p50_ms = 0, ttft_p99_ms = 0;  // Prefill latency
  double itl_p50_ms = 0, itl_p99_ms = 0;    // Decode latency
  double seconds = 0;
  std::string report;  // the printed summary
};

// Runs the workload against a live kvpoold and returns the summary (also printed on stdout).
// Errors: UNAVAILABLE (no daemon), INVALID_ARGUMENT (bad options or trace), INTERNAL (a worker
// crashed).
absl::StatusOr<Summary> Run(const Options& options);

}  // namespace kvpool::loadgen
