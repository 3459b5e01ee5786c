#include "bench/ratio_reporter.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "benchmark/benchmark.h"

namespace kvpool::bench {
namespace {

class RecordingReporter final : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      const double ns =
          run.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(run.time_unit) * 1e9;
      auto [it, inserted] = best_ns_.emplace(run.benchmark_name(), ns);
      if (!inserted) it->second = std::min(it->second, ns);
      if (auto bps = run.counters.find("bytes_per_second"); bps != run.counters.end()) {
        auto [jt, fresh] = best_bps_.emplace(run.benchmark_name(), bps->second.value);
        if (!fresh) jt->second = std::max(jt->second, static_cast<double>(bps->second.value));
      }
    }
  }

  const std::map<std::string, double>& best_ns() const { return best_ns_; }
  const std::map<std::string, double>& best_bps() const { return best_bps_; }

 private:
  std::map<std::string, double> best_ns_;
  std::map<std::string, double> best_bps_;  // bytes per second, when the benchmark sets it
};

}  // namespace

int RunWithRatios(int argc, char** argv, const std::vector<RatioPair>& pairs) {
  const bool filtered = std::any_of(argv, argv + argc, [](const char* a) {
    return std::string(a).rfind("--benchmark_filter", 0) == 0;
  });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RecordingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const auto& best = reporter.best_ns();
  bool missing = false;
  std::printf("\n%-44s %12s %12s %10s %8s\n", "ratio (same run)", "ours ns/op", "base ns/op",
              "base/ours", "target");
  for (const RatioPair& pair : pairs) {
    auto ours = best.find(pair.ours);
    auto base = best.find(pair.baseline);
    if (ours == best.end() || base == best.end()) {
      // Filtered out with --benchmark_filter: say so rather than invent a number.
      std::printf("%-44s %12s %12s %10s\n", pair.label.c_str(), "-", "-", "not run");
      missing = true;
      continue;
    }
    double ratio = base->second / ours->second;
    if (pair.compare == RatioPair::Compare::kBandwidth) {
      auto ours_bps = reporter.best_bps().find(pair.ours);
      auto base_bps = reporter.best_bps().find(pair.baseline);
      if (ours_bps == reporter.best_bps().end() || base_bps == reporter.best_bps().end()) {
        std::printf("%-44s %12s %12s %10s\n", pair.label.c_str(), "-", "-", "no bytes/s");
        missing = true;
        continue;
      }
      ratio = ours_bps->second / base_bps->second;
    }
    char target[32] = "-";
    if (pair.target > 0) {
      std::snprintf(target, sizeof(target), ">=%.2f%s", pair.target,
                    ratio >= pair.target ? "" : " MISS");
    }
    std::printf("%-44s %12.2f %12.2f %10.3f %8s\n", pair.label.c_str(), ours->second, base->second,
                ratio, target);
  }
  return missing && !filtered ? 1 : 0;
}

}  // namespace kvpool::bench
