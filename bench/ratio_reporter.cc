#include "bench/ratio_reporter.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

#include "benchmark/benchmark.h"
#include "kvpool/util/mutex_mode.h"

namespace kvpool::bench {
namespace {

// One repetition of one benchmark.
struct Rep {
  double ns = 0;                // real time per iteration
  double bytes_per_second = 0;  // 0 unless the benchmark sets it
  std::map<std::string, double> counters;
};

class RecordingReporter final : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      Rep rep;
      rep.ns = run.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(run.time_unit) * 1e9;
      if (auto bps = run.counters.find("bytes_per_second"); bps != run.counters.end()) {
        rep.bytes_per_second = bps->second.value;
      }
      for (const auto& [name, counter] : run.counters) rep.counters[name] = counter.value;
      reps_[run.benchmark_name()][std::max<int64_t>(run.repetition_index, 0)] = rep;
    }
  }

  // Per benchmark, its repetitions by index.
  const std::map<std::string, std::map<int64_t, Rep>>& reps() const { return reps_; }

 private:
  std::map<std::string, std::map<int64_t, Rep>> reps_;
};

// The throughput ratio of `ours` to `base` (higher is better for ours).
double Ratio(const Rep& ours, const Rep& base, RatioPair::Compare compare) {
  return compare == RatioPair::Compare::kBandwidth ? ours.bytes_per_second / base.bytes_per_second
                                                   : base.ns / ours.ns;
}

// A side's repetitions with the time per iteration taken from `counter` when it is set (a
// repetition without that counter is dropped).
std::map<int64_t, Rep> Side(const std::map<int64_t, Rep>& reps, const std::string& counter) {
  if (counter.empty()) return reps;
  std::map<int64_t, Rep> out;
  for (const auto& [index, rep] : reps) {
    auto c = rep.counters.find(counter);
    if (c == rep.counters.end()) continue;
    out[index] = Rep{.ns = c->second};
  }
  return out;
}

// The best repetition: least time (most bytes/s for bandwidth pairs).
Rep Best(const std::map<int64_t, Rep>& reps) {
  Rep best = reps.begin()->second;
  for (const auto& [index, rep] : reps) {
    best.ns = std::min(best.ns, rep.ns);
    best.bytes_per_second = std::max(best.bytes_per_second, rep.bytes_per_second);
  }
  return best;
}

}  // namespace

int RunWithRatios(int argc, char** argv, const std::vector<RatioPair>& pairs) {
  const bool filtered = std::any_of(argv, argv + argc, [](const char* a) {
    return std::string(a).rfind("--benchmark_filter", 0) == 0;
  });
  // What kvpoold runs with: a release benchmark timed with absl's deadlock detection on would
  // time a lock-order graph update on every Mutex acquisition that the daemon does not make.
  SetProgramDeadlockDetection();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RecordingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const auto& reps = reporter.reps();
  bool missing = false;
  std::printf("\n%-44s %12s %12s %10s %20s %8s\n", "ratio (same run)", "ours ns/op", "base ns/op",
              "base/ours", "per rep min/med/max", "target");
  for (const RatioPair& pair : pairs) {
    auto ours_it = reps.find(pair.ours);
    auto base_it = reps.find(pair.baseline);
    std::map<int64_t, Rep> ours, base;
    if (ours_it != reps.end()) ours = Side(ours_it->second, pair.ours_counter);
    if (base_it != reps.end()) base = Side(base_it->second, pair.baseline_counter);
    if (ours.empty() || base.empty()) {
      // Filtered out with --benchmark_filter: say so rather than invent a number.
      std::printf("%-44s %12s %12s %10s\n", pair.label.c_str(), "-", "-", "not run");
      missing = true;
      continue;
    }
    const Rep best_ours = Best(ours), best_base = Best(base);
    if (pair.compare == RatioPair::Compare::kBandwidth &&
        (best_ours.bytes_per_second <= 0 || best_base.bytes_per_second <= 0)) {
      std::printf("%-44s %12s %12s %10s\n", pair.label.c_str(), "-", "-", "no bytes/s");
      missing = true;
      continue;
    }
    const double ratio = Ratio(best_ours, best_base, pair.compare);
    // Repetition i of ours against repetition i of the baseline.
    std::vector<double> per_rep;
    for (const auto& [index, rep] : ours) {
      auto other = base.find(index);
      if (other != base.end()) per_rep.push_back(Ratio(rep, other->second, pair.compare));
    }
    std::sort(per_rep.begin(), per_rep.end());
    char spread[48] = "-";
    if (per_rep.size() > 1) {
      std::snprintf(spread, sizeof(spread), "%.3f/%.3f/%.3f", per_rep.front(),
                    per_rep[per_rep.size() / 2], per_rep.back());
    }
    char target[32] = "-";
    if (pair.target > 0) {
      std::snprintf(target, sizeof(target), ">=%.2f%s", pair.target,
                    ratio >= pair.target ? "" : " MISS");
    }
    std::printf("%-44s %12.2f %12.2f %10.3f %20s %8s\n", pair.label.c_str(), best_ours.ns,
                best_base.ns, ratio, spread, target);
  }
  return missing && !filtered ? 1 : 0;
}

}  // namespace kvpool::bench
