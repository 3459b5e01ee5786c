#pragma once

// Runs the registered Google Benchmarks and then prints, for each declared pair, our time beside
// a baseline measured in the same run and the throughput ratio (baseline time / our time). With
// --benchmark_repetitions=N the best repetition of each counts (the least disturbed on a shared
// machine), and the spread of the ratio is printed beside it: min / median / max over the
// repetitions, each repetition of ours paired with the same repetition of the baseline (with
// --benchmark_enable_random_interleaving=true the two ran in the same round, close in time).

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"

namespace kvpool::bench {

struct RatioPair {
  enum class Compare : uint8_t {
    kTime,       // baseline time per iteration / ours (same work on both sides)
    kBandwidth,  // ours bytes/s / baseline bytes/s (both set SetBytesProcessed)
  };
  std::string label;     // what is compared, e.g. "allocate+free one block"
  std::string ours;      // benchmark name, e.g. "BM_PoolAllocateFree"
  std::string baseline;  // benchmark name of the baseline
  double target = 0;     // minimum acceptable ratio; 0 when the issue sets none
  Compare compare = Compare::kTime;
  // kTime only: when set, each side's time per iteration is this counter of its benchmark
  // (ns per iteration) instead of the benchmark's real time. One benchmark that runs both sides
  // alternately, call by call, reports each side's time in a counter of its own, and so both
  // sides of the ratio see the same machine (see kernels_bench's BM_PagedVsDense).
  std::string ours_counter;
  std::string baseline_counter;
};

// Call from main() instead of BENCHMARK_MAIN(). Returns the process exit code: non-zero when
// flags are bad or a pair's benchmark did not run (a ratio below its target is reported, not
// failed: the machine is shared and timings are not tests).
int RunWithRatios(int argc, char** argv, const std::vector<RatioPair>& pairs);

// The two sides of a counter pair in one benchmark: each iteration runs `prepare()` (untimed,
// housekeeping), then `a()` and `b()` once each, the one that goes first alternating, and times
// each into a counter of its own (`a_counter`, `b_counter`: ns per iteration) for a RatioPair's
// ours_counter / baseline_counter. So both sides see the same moment of a noisy machine, which
// two separate benchmarks, seconds apart, do not.
template <typename A, typename B, typename Prepare>
void Interleave(benchmark::State& state, A&& a, const char* a_counter, B&& b, const char* b_counter,
                Prepare&& prepare) {
  using Clock = std::chrono::steady_clock;
  Clock::duration a_time{}, b_time{};
  const auto timed = [](auto& side, Clock::duration* total) {
    const Clock::time_point start = Clock::now();
    side();
    *total += Clock::now() - start;
  };
  bool a_first = true;
  for (auto _ : state) {
    prepare();
    if (a_first) {
      timed(a, &a_time);
      timed(b, &b_time);
    } else {
      timed(b, &b_time);
      timed(a, &a_time);
    }
    a_first = !a_first;
  }
  const auto per_iteration = [](Clock::duration d) {
    return benchmark::Counter(static_cast<double>(std::chrono::nanoseconds(d).count()),
                              benchmark::Counter::kAvgIterations);
  };
  state.counters[a_counter] = per_iteration(a_time);
  state.counters[b_counter] = per_iteration(b_time);
}
template <typename A, typename B>
void Interleave(benchmark::State& state, A&& a, const char* a_counter, B&& b,
                const char* b_counter) {
  Interleave(state, a, a_counter, b, b_counter, [] {});
}

}  // namespace kvpool::bench
