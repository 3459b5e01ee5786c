// Decode through kvpoold beside the same model decoding in this process, in the same run, against
// real daemon processes started for the run.
//
//   build/release/bench/model_bench --benchmark_repetitions=3
//
// On a shared machine, add --benchmark_enable_random_interleaving=true (and more repetitions) so
// both sides of a ratio see the same background load; the best repetition of each counts.
//
// - BM_InProcessDecode / BM_DaemonDecode / BM_DaemonDecodeRpc at batch 1 and 8: one decode step
//   of every sequence of the batch per iteration (in-process: LocalEngine::Decode; daemon: one
//   Decode from one session, through its decode doorbell, or as a Decode RPC for ...Rpc). Both run
//   the daemon's default model (tiny, seed 1, blocks of 16, bf16 KV) over equal pools, on the same
//   prompts and the same schedule of context lengths: 64-token prompts, and every sequence starts
//   over (outside the timing) once it holds kRestartAt tokens. Before the daemon is timed, its
//   greedy tokens for one prompt must equal this process's. Counters: tokens/s; context (mean
//   tokens per sequence); model_ms (the daemon's own time in Model::Step per step, from GetStats:
//   the rest of the daemon's time is the round trip).
// - BM_DecodeInterleaved at batch 1 and 8: the same two decodes in one benchmark, alternating
//   runs of 32 steps on each side so that both see the same seconds of a shared machine, whose
//   background load otherwise moves the ratio by more than the round trip; counters
//   inprocess_ns and daemon_ns (per step) give the ratio, and model_ns is the daemon's own time
//   in Model::Step per step (GetStats), so daemon_ns - model_ns is what the round trip costs.
// - BM_InProcessPrefill/reused/new: one prefill step of `new` prompt tokens after `reused` ones
//   the prefix cache holds (published once, outside the timing), through LocalEngine::Prefill;
//   each iteration's new tokens are drawn afresh (a prefill publishes its blocks), and its
//   sequence is freed outside the timing. tokens/s counts the new tokens. 200 over 1400 is a
//   typical later turn of the main job's conversations.
// - BM_HostGemm/impl/m: the host model's prefill-sized product, y[m][2816] = x[m][512] · Wᵀ (the
//   tiny model's gate/up projection), impl 0 through internal/gemm.h on this processor's vector
//   code, impl 1 through OpenBLAS's cblas_sgemm (what Gemm falls back to without AVX2, and what
//   the model used before). Counter: GFLOP/s.
// - BM_DaemonEightClients{Gathered,Separate}: eight sessions (one thread and one Client each)
//   decoding one sequence each; an iteration is one Decode per thread, and the time per
//   iteration is per token over all eight. Gathered runs with the default gather window (one
//   model step serves all eight), Separate with `disable_batching` (a step per call): their
//   ratio is what cross-client batching gains. step_seqs: mean sequences per model step.

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "client/client.h"
#include "kernels/cpu_isa.h"
#include "kernels/thread_pool.h"
#include "kvpool/util/mutex_mode.h"
#include "model/internal/gemm.h"
#include "model/local_engine.h"
#include "model/weights.h"
#include "tests/integration/harness.h"

namespace kvpool {
namespace {

constexpr int64_t kPoolBytes = int64_t{64} << 20;  // each side's KV pool
constexpr size_t kPromptTokens = 64;
constexpr int64_t kRestartAt = 512;  // tokens in a sequence when the batch starts over
constexpr int kCheckTokens = 16;     // greedy tokens compared between daemon and this process
constexpr int kClients = 8;

// Prompt `i` of the run: the same tokens on both sides.
std::vector<int32_t> Prompt(int i) {
  std::mt19937 rng(static_cast<uint32_t>(i) + 1);
  std::vector<int32_t> out(kPromptTokens);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % 8192);  // the tiny model's vocabulary
  return out;
}

enum class Gathering { kOn, kOff };

// What the run shares: the in-process engine and one daemon per gathering mode, each made on
// first use and dropped by Reset() at the end of main(). Thread-safe.
class Shared final {
 public:
  static Shared& Get() {
    static Shared* shared = new Shared();
    return *shared;
  }

  // The daemon's default model over a pool of the same size as the daemons'.
  // Errors: LocalEngine::Create's.
  absl::StatusOr<model::LocalEngine*> Engine() {
    absl::MutexLock lock(&mu_);
    if (engine_ == nullptr) {
      const model::LocalEngine::Options options{
          .block_size = 16, .dtype = kernels::DType::kBF16, .pool_bytes = kPoolBytes, .threads = 0};
      absl::StatusOr<std::unique_ptr<model::LocalEngine>> e = model::LocalEngine::Create(
          model::SyntheticWeights(*model::NamedConfig("tiny"), 1), options);
      if (!e.ok()) return e.status();
      engine_ = *std::move(e);
    }
    return engine_.get();
  }

  // Errors: DaemonProcess::Start's.
  absl::StatusOr<const testing::DaemonProcess*> Daemon(Gathering g) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<testing::DaemonProcess>& d = g == Gathering::kOn ? gathered_ : separate_;
    if (d == nullptr) {
      const std::string model = g == Gathering::kOn ? "model { gather_window_us: 2000 }"
                                                    : "model { disable_batching: true }";
      absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> started =
          testing::DaemonProcess::Start(absl::StrCat("pool_bytes: ", kPoolBytes, "\n", model));
      if (!started.ok()) return started.status();
      d = *std::move(started);
    }
    return d.get();
  }

  // Whether the gathering daemon's tokens were already checked against the engine's.
  bool checked() {
    absl::MutexLock lock(&mu_);
    return checked_;
  }
  void set_checked() {
    absl::MutexLock lock(&mu_);
    checked_ = true;
  }

  // Stops the daemons (clients must be gone) and drops the engine.
  void Reset() {
    absl::MutexLock lock(&mu_);
    gathered_.reset();
    separate_.reset();
    engine_.reset();
  }

 private:
  absl::Mutex mu_;
  std::unique_ptr<model::LocalEngine> engine_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<testing::DaemonProcess> gathered_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<testing::DaemonProcess> separate_ ABSL_GUARDED_BY(mu_);
  bool checked_ ABSL_GUARDED_BY(mu_) = false;
};

// `doorbell`: Decode through the session's decode doorbell (the client's default), else the RPC.
absl::StatusOr<std::unique_ptr<client::Client>> Connect(Gathering g, bool doorbell = true) {
  absl::StatusOr<const testing::DaemonProcess*> d = Shared::Get().Daemon(g);
  if (!d.ok()) return d.status();
  return client::Client::Connect(
      {.runtime_dir = (*d)->dir(), .client_name = "model_bench", .decode_doorbell = doorbell});
}

// Sequences decoding in lockstep in this process: each step feeds every sequence the token the
// previous step produced for it.
class InProcessBatch final {
 public:
  explicit InProcessBatch(model::LocalEngine* engine) : engine_(engine) {}

  // Prefills prompts [first, first + n) as new sequences.
  absl::Status Start(int first, int n) {
    for (int i = first; i < first + n; ++i) {
      const std::vector<int32_t> prompt = Prompt(i);
      absl::StatusOr<model::LocalEngine::PrefillResult> r = engine_->Prefill(SequenceId(0), prompt);
      if (!r.ok()) return r.status();
      inputs_.push_back({r->sequence, r->result.next_token});
    }
    length_ = static_cast<int64_t>(kPromptTokens);
    return absl::OkStatus();
  }

  absl::Status Step() {
    absl::StatusOr<std::vector<model::ItemResult>> r = engine_->Decode(inputs_);
    if (!r.ok()) return r.status();
    for (size_t i = 0; i < inputs_.size(); ++i) inputs_[i].token = (*r)[i].next_token;
    ++length_;
    return absl::OkStatus();
  }

  absl::Status Free() {
    absl::Status status;
    for (const model::DecodeInput& in : inputs_) status.Update(engine_->Free(in.sequence, false));
    inputs_.clear();
    return status;
  }

  int64_t length() const { return length_; }  // tokens with K/V in the pool, per sequence
  int32_t token(size_t i) const { return inputs_[i].token; }  // sequence i's pending token

 private:
  model::LocalEngine* const engine_;
  std::vector<model::DecodeInput> inputs_;
  int64_t length_ = 0;
};

// The daemon's own time in model steps over a batch's decode steps (its GetStats, read outside
// the timing): what the round trip adds is the rest. Only meaningful while one session decodes.
struct ModelTally {
  int64_t busy_us = 0;
  int64_t steps = 0;
};

// The same through kvpoold: one Decode call per step for the whole batch.
class DaemonBatch final {
 public:
  // `tally` (optional, not owned) collects the daemon's model time between Start and Free.
  explicit DaemonBatch(const client::Client* client, ModelTally* tally = nullptr)
      : client_(client), tally_(tally) {}

  absl::Status Start(int first, int n) {
    for (int i = first; i < first + n; ++i) {
      const std::vector<int32_t> prompt = Prompt(i);
      absl::StatusOr<v1::PrefillResponse> r = client_->Prefill(0, prompt);
      if (!r.ok()) return r.status();
      items_.push_back({r->sequence_id(), r->next_token()});
    }
    length_ = static_cast<int64_t>(kPromptTokens);
    return Read(&started_);
  }

  absl::Status Step() {
    absl::StatusOr<v1::DecodeResponse> r = client_->Decode(items_);
    if (!r.ok()) return r.status();
    if (r->next_tokens_size() != static_cast<int>(items_.size())) {
      return absl::InternalError("decode: one next token per item expected");
    }
    for (size_t i = 0; i < items_.size(); ++i) {
      items_[i].token = r->next_tokens(static_cast<int>(i));
    }
    step_sequences_ += r->step_sequences();
    ++length_;
    return absl::OkStatus();
  }

  absl::Status Free() {
    if (items_.empty()) return absl::OkStatus();
    ModelTally now;
    absl::Status status = Read(&now);
    if (status.ok() && tally_ != nullptr) {
      tally_->busy_us += now.busy_us - started_.busy_us;
      tally_->steps += now.steps - started_.steps;
    }
    std::vector<uint64_t> ids;
    for (const client::DecodeItem& item : items_) ids.push_back(item.sequence_id);
    items_.clear();
    status.Update(client_->Free(ids));
    return status;
  }

  int64_t length() const { return length_; }
  int32_t token(size_t i) const { return items_[i].token; }
  // Sum over Step() calls of the sequences in the model step that served each.
  int64_t step_sequences() const { return step_sequences_; }

 private:
  // The daemon's totals so far (nothing without a tally).
  absl::Status Read(ModelTally* out) const {
    if (tally_ == nullptr) return absl::OkStatus();
    absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
    if (!stats.ok()) return stats.status();
    out->busy_us = static_cast<int64_t>(stats->model_busy_us());
    out->steps = static_cast<int64_t>(stats->model_steps());
    return absl::OkStatus();
  }

  const client::Client* const client_;
  ModelTally* const tally_;
  std::vector<client::DecodeItem> items_;
  int64_t length_ = 0;
  int64_t step_sequences_ = 0;
  ModelTally started_;  // the daemon's totals after Start
};

// Greedy decoding of prompt 0 through the daemon must give this process's tokens exactly (same
// weights, same kernels, same thread count). Errors: INTERNAL naming the first difference, or a
// failed call's.
absl::Status CheckAgainstInProcess(const client::Client& client) {
  absl::StatusOr<model::LocalEngine*> engine = Shared::Get().Engine();
  if (!engine.ok()) return engine.status();
  InProcessBatch local(*engine);
  DaemonBatch remote(&client);
  absl::Status status = local.Start(0, 1);
  if (status.ok()) status = remote.Start(0, 1);
  for (int i = 0; status.ok() && i < kCheckTokens; ++i) {
    if (local.token(0) != remote.token(0)) {
      status = absl::InternalError(absl::StrCat("daemon token ", i, " is ", remote.token(0),
                                                ", in-process ", local.token(0)));
      break;
    }
    status = local.Step();
    if (status.ok()) status = remote.Step();
  }
  status.Update(local.Free());
  status.Update(remote.Free());
  return status;
}

// Decodes prompts [first, first + n) in lockstep, one step per iteration. Sequences start over
// outside the timing once they hold kRestartAt tokens, so every run sees the same context lengths.
template <typename Batch>
void DecodeLoop(benchmark::State& state, Batch& batch, int first, int n) {
  absl::Status status = batch.Start(first, n);
  if (!status.ok()) state.SkipWithError(status.ToString().c_str());
  int64_t context = 0;
  for (auto _ : state) {
    if (batch.length() >= kRestartAt) {
      state.PauseTiming();
      status = batch.Free();
      if (status.ok()) status = batch.Start(first, n);
      state.ResumeTiming();
    }
    if (status.ok()) {
      context += batch.length();
      status = batch.Step();
    }
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  if (absl::Status freed = batch.Free(); !freed.ok() && status.ok()) {
    state.SkipWithError(freed.ToString().c_str());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * n), benchmark::Counter::kIsRate);
  // Mean tokens in each sequence's context, to compare runs by.
  state.counters["context"] =
      benchmark::Counter(static_cast<double>(context), benchmark::Counter::kAvgIterations);
}

void BM_InProcessDecode(benchmark::State& state) {
  absl::StatusOr<model::LocalEngine*> engine = Shared::Get().Engine();
  if (!engine.ok()) {
    state.SkipWithError(engine.status().ToString().c_str());
    return;
  }
  InProcessBatch batch(*engine);
  DecodeLoop(state, batch, 0, static_cast<int>(state.range(0)));
}
BENCHMARK(BM_InProcessDecode)
    ->ArgName("batch")
    ->Arg(1)
    ->Arg(8)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void DaemonDecode(benchmark::State& state, bool doorbell) {
  absl::StatusOr<std::unique_ptr<client::Client>> c = Connect(Gathering::kOn, doorbell);
  if (!c.ok()) {
    state.SkipWithError(c.status().ToString().c_str());
    return;
  }
  if (!Shared::Get().checked()) {
    if (absl::Status s = CheckAgainstInProcess(**c); !s.ok()) {
      state.SkipWithError(absl::StrCat("daemon differs from in-process: ", s.ToString()).c_str());
      return;
    }
    Shared::Get().set_checked();
  }
  ModelTally tally;
  DaemonBatch batch(c->get(), &tally);
  DecodeLoop(state, batch, 0, static_cast<int>(state.range(0)));
  // The daemon's model time per step, beside the round trip the benchmark times.
  if (tally.steps > 0) {
    state.counters["model_ms"] = static_cast<double>(tally.busy_us) / 1e3 / tally.steps;
  }
}

void BM_DaemonDecode(benchmark::State& state) { DaemonDecode(state, /*doorbell=*/true); }
BENCHMARK(BM_DaemonDecode)
    ->ArgName("batch")
    ->Arg(1)
    ->Arg(8)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_DaemonDecodeRpc(benchmark::State& state) { DaemonDecode(state, /*doorbell=*/false); }
BENCHMARK(BM_DaemonDecodeRpc)
    ->ArgName("batch")
    ->Arg(1)
    ->Arg(8)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The in-process and the daemon decode of the two above in one benchmark, in alternating runs of
// kInterleavedSteps steps (each run timed as a whole, which side goes first alternating), so that
// both sides see the same seconds of a shared machine: two benchmarks seconds apart do not, and
// their spread here (several per cent between repetitions) is larger than the round trip being
// measured. Runs, not single steps: a step right after the other process ran is 15-30 % slower on
// both sides (threads asleep, caches taken), which is not the steady decode being compared.
// Counters: inprocess_ns and daemon_ns, each side's time per step; model_ns, the daemon's time in
// Model::Step per step (read between runs, outside the timing).
constexpr int64_t kInterleavedSteps = 32;
static_assert((kRestartAt - static_cast<int64_t>(kPromptTokens)) % kInterleavedSteps == 0,
              "a run of steps never straddles a restart");

void BM_DecodeInterleaved(benchmark::State& state) {
  absl::StatusOr<model::LocalEngine*> engine = Shared::Get().Engine();
  if (!engine.ok()) {
    state.SkipWithError(engine.status().ToString().c_str());
    return;
  }
  absl::StatusOr<std::unique_ptr<client::Client>> c = Connect(Gathering::kOn);
  if (!c.ok()) {
    state.SkipWithError(c.status().ToString().c_str());
    return;
  }
  const int n = static_cast<int>(state.range(0));
  InProcessBatch local(*engine);
  ModelTally tally;
  DaemonBatch remote(c->get(), &tally);
  absl::Status status = local.Start(0, n);
  if (status.ok()) status = remote.Start(0, n);
  using Clock = std::chrono::steady_clock;
  Clock::duration local_time{}, remote_time{};
  int64_t steps = 0;
  // A run of steps on one side, timed; sequences start over (untimed) before it if they are full.
  // Not bench::Interleave, whose one `prepare` runs before both sides: built on it, with both
  // restarts there, the ratio read ~1 % lower in 6 of 6 alternating A/B runs against this loop,
  // which restarts each side right before its own run (the cause is not pinned down).
  const auto run = [&status, n](auto& batch, Clock::duration* total) {
    if (status.ok() && batch.length() >= kRestartAt) {
      status = batch.Free();
      if (status.ok()) status = batch.Start(0, n);
    }
    const Clock::time_point start = Clock::now();
    for (int64_t i = 0; status.ok() && i < kInterleavedSteps; ++i) status = batch.Step();
    *total += Clock::now() - start;
  };
  bool local_first = true;
  for (auto _ : state) {
    if (local_first) {
      run(local, &local_time);
      run(remote, &remote_time);
    } else {
      run(remote, &remote_time);
      run(local, &local_time);
    }
    local_first = !local_first;
    steps += kInterleavedSteps;
    if (!status.ok()) break;
  }
  status.Update(local.Free());
  status.Update(remote.Free());
  if (!status.ok()) {
    state.SkipWithError(status.ToString().c_str());
    return;
  }
  const auto per_step = [steps](Clock::duration d) {
    return static_cast<double>(std::chrono::nanoseconds(d).count()) / static_cast<double>(steps);
  };
  state.counters["inprocess_ns"] = per_step(local_time);
  state.counters["daemon_ns"] = per_step(remote_time);
  if (tally.steps > 0) {
    state.counters["model_ns"] = static_cast<double>(tally.busy_us) * 1e3 / tally.steps;
  }
}
BENCHMARK(BM_DecodeInterleaved)
    ->ArgName("batch")
    ->Arg(1)
    ->Arg(8)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_InProcessPrefill(benchmark::State& state) {
  absl::StatusOr<model::LocalEngine*> engine = Shared::Get().Engine();
  if (!engine.ok()) {
    state.SkipWithError(engine.status().ToString().c_str());
    return;
  }
  const auto reused = static_cast<size_t>(state.range(0));
  const auto fresh = static_cast<size_t>(state.range(1));
  // The prefix is the same in every run (and repetition); new tokens never repeat across them.
  static uint32_t runs = 0;
  std::mt19937 rng(static_cast<uint32_t>(reused * 7919 + fresh));
  std::vector<int32_t> prompt(reused + fresh);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % 8192);
  rng.seed(static_cast<uint32_t>(reused * 7919 + fresh) + 104729 * ++runs);
  absl::Status status;
  if (reused > 0) {  // publish the prefix
    auto first = (*engine)->Prefill(SequenceId(0), std::span(prompt).first(reused));
    status = first.ok() ? (*engine)->Free(first->sequence, /*commit=*/true) : first.status();
  }
  int64_t got_reused = 0;
  for (auto _ : state) {
    if (!status.ok()) break;
    state.PauseTiming();
    for (size_t i = reused; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(rng() % 8192);
    state.ResumeTiming();
    absl::StatusOr<model::LocalEngine::PrefillResult> r = (*engine)->Prefill(SequenceId(0), prompt);
    if (!r.ok()) {
      status = r.status();
      break;
    }
    got_reused = r->reused;
    state.PauseTiming();
    status = (*engine)->Free(r->sequence, /*commit=*/false);
    state.ResumeTiming();
  }
  if (!status.ok()) {
    state.SkipWithError(status.ToString().c_str());
    return;
  }
  if (got_reused != static_cast<int64_t>(reused)) {
    state.SkipWithError(absl::StrCat("reused ", got_reused, " tokens, not ", reused).c_str());
    return;
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations() * fresh),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_InProcessPrefill)
    ->ArgNames({"reused", "new"})
    ->Args({1400, 200})
    ->Args({1000, 500})
    ->Args({0, 500})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_HostGemm(benchmark::State& state) {
  constexpr int32_t kOut = 2816, kIn = 512;
  const bool openblas = state.range(0) == 1;
  const auto m = static_cast<int32_t>(state.range(1));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(static_cast<size_t>(m) * kIn), w(static_cast<size_t>(kOut) * kIn);
  for (float& v : x) v = u(rng);
  for (float& v : w) v = u(rng);
  std::vector<float> y(static_cast<size_t>(m) * kOut);
  std::vector<float> scratch(static_cast<size_t>(model::internal::GemmScratchFloats(m, kIn)));
  static kernels::ThreadPool threads(0);
  kernels::cpu::LimitKernelIsaForTesting(openblas ? kernels::cpu::Isa::kPortable
                                                  : kernels::cpu::Isa::kAvx512);
  for (auto _ : state) {
    model::internal::Gemm(x.data(), m, w.data(), kOut, kIn, y.data(), false, scratch.data(),
                          &threads);
  }
  kernels::cpu::LimitKernelIsaForTesting(kernels::cpu::Isa::kAvx512);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * m * kOut * kIn * static_cast<double>(state.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_HostGemm)
    ->ArgNames({"openblas", "m"})
    ->ArgsProduct({{0, 1}, {64, 200, 500}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// One of kClients threads, each its own session decoding prompt thread_index(). Every thread
// goes through the loop (zero iterations after an error) so the start barrier is kept.
void EightClients(benchmark::State& state, Gathering g) {
  absl::StatusOr<std::unique_ptr<client::Client>> c = Connect(g);
  if (!c.ok()) {
    state.SkipWithError(c.status().ToString().c_str());
    for (auto _ : state) {
    }
    return;
  }
  DaemonBatch batch(c->get());
  DecodeLoop(state, batch, state.thread_index(), 1);
  // Mean sequences per model step as the calls saw it: kClients when gathering works, 1 without.
  state.counters["step_seqs"] = benchmark::Counter(static_cast<double>(batch.step_sequences()),
                                                   benchmark::Counter::kAvgIterations);
}

void BM_DaemonEightClientsGathered(benchmark::State& state) { EightClients(state, Gathering::kOn); }
BENCHMARK(BM_DaemonEightClientsGathered)
    ->Threads(kClients)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_DaemonEightClientsSeparate(benchmark::State& state) {
  EightClients(state, Gathering::kOff);
}
BENCHMARK(BM_DaemonEightClientsSeparate)
    ->Threads(kClients)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  kvpool::SetProgramDeadlockDetection();  // what the client library used to do for the process
  const int rc = kvpool::bench::RunWithRatios(
      argc, argv,
      {
          {"decode batch 1: daemon vs in-process", "BM_DaemonDecode/batch:1/real_time",
           "BM_InProcessDecode/batch:1/real_time", 0.95},
          // The same two in one benchmark, alternating runs of 32 steps: both sides see the same
          // seconds of a noisy machine.
          {.label = "decode batch 1, interleaved: daemon vs in-process",
           .ours = "BM_DecodeInterleaved/batch:1/real_time",
           .baseline = "BM_DecodeInterleaved/batch:1/real_time",
           .target = 0.95,
           .ours_counter = "daemon_ns",
           .baseline_counter = "inprocess_ns"},
          {.label = "decode batch 8, interleaved: daemon vs in-process",
           .ours = "BM_DecodeInterleaved/batch:8/real_time",
           .baseline = "BM_DecodeInterleaved/batch:8/real_time",
           .target = 0.9,
           .ours_counter = "daemon_ns",
           .baseline_counter = "inprocess_ns"},
          {"decode batch 1: doorbell vs Decode RPC", "BM_DaemonDecode/batch:1/real_time",
           "BM_DaemonDecodeRpc/batch:1/real_time", 0},
          {"decode batch 8: daemon vs in-process", "BM_DaemonDecode/batch:8/real_time",
           "BM_InProcessDecode/batch:8/real_time", 0.9},
          {"host gemm m=200: ours vs OpenBLAS", "BM_HostGemm/openblas:0/m:200/real_time",
           "BM_HostGemm/openblas:1/m:200/real_time", 0},
          // Both report time per token over all eight clients.
          {"gathering gain (8 clients x batch 1)",
           "BM_DaemonEightClientsGathered/real_time/threads:8",
           "BM_DaemonEightClientsSeparate/real_time/threads:8", 0},
      });
  kvpool::Shared::Get().Reset();
  return rc;
}
