// client_rtt: round trips of the C++ client against a running kvpoold, the baseline that
// bench/python_client_bench.py sets the Python client beside (same daemon, same run).
//
//   build/release/bench/client_rtt --socket_dir=DIR --calls=2000
//
// Attaches with KV access, warms up, then times `calls` Pings, then `calls` pairs of Allocate (a
// 32-token prompt: two blocks, no prefix hit) and Free. Prints one JSON line of per-call
// latencies in microseconds: {"ping_p50_us": ..., "ping_mean_us": ..., "allocate_p50_us": ...,
// "free_p50_us": ..., ...}. Exits 1 on any failed call.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "client/client.h"
#include "kvpool/util/mutex_mode.h"

ABSL_FLAG(std::string, socket_dir, "", "kvpoold's runtime directory (default: the standard one)");
ABSL_FLAG(int32_t, calls, 2000, "timed calls of each kind");

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double p50 = 0, mean = 0;
};

Stats Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], std::accumulate(us.begin(), us.end(), 0.0) / us.size()};
}

double Since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "client_rtt: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  kvpool::SetProgramDeadlockDetection();  // what the client library used to do for the process
  absl::ParseCommandLine(argc, argv);
  const int calls = std::max(1, absl::GetFlag(FLAGS_calls));
  absl::StatusOr<std::unique_ptr<kvpool::client::Client>> connected =
      kvpool::client::Client::Connect({.runtime_dir = absl::GetFlag(FLAGS_socket_dir),
                                       .client_name = "client_rtt",
                                       .kv_access = true});
  if (!connected.ok()) return Fail(connected.status());
  const kvpool::client::Client& c = **connected;
  std::vector<int32_t> prompt(32);
  std::vector<double> ping, allocate, free;
  for (int i = 0; i < calls + calls / 10; ++i) {  // the first tenth warms up
    const bool timed = i >= calls / 10;
    Clock::time_point start = Clock::now();
    if (absl::Status s = c.Ping(); !s.ok()) return Fail(s);
    if (timed) ping.push_back(Since(start));
  }
  for (int i = 0; i < calls + calls / 10; ++i) {
    const bool timed = i >= calls / 10;
    for (size_t t = 0; t < prompt.size(); ++t) prompt[t] = static_cast<int32_t>(i * 64 + t);
    Clock::time_point start = Clock::now();
    absl::StatusOr<kvpool::v1::SequenceInfo> seq = c.Allocate(prompt);
    if (!seq.ok()) return Fail(seq.status());
    if (timed) allocate.push_back(Since(start));
    start = Clock::now();
    if (absl::Status s = c.Free({seq->sequence_id()}); !s.ok()) return Fail(s);
    if (timed) free.push_back(Since(start));
  }
  const Stats p = Summarize(ping), a = Summarize(allocate), f = Summarize(free);
  std::printf(
      "{\"calls\": %d, \"ping_p50_us\": %.2f, \"ping_mean_us\": %.2f, \"allocate_p50_us\": %.2f, "
      "\"allocate_mean_us\": %.2f, \"free_p50_us\": %.2f, \"free_mean_us\": %.2f}\n",
      calls, p.p50, p.mean, a.p50, a.mean, f.p50, f.mean);
  return 0;
}
