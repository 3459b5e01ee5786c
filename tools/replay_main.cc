// kvpool-replay: replays a Mooncake-format request trace through kvpool's prefix cache and
// reports the prefix hit rate in the trace's 512-token blocks (comparable with the reference
// rates in ../shared/traces/README.md), beside plain LRU's measured in the same run.
//
//   kvpool-replay --trace=../shared/traces/mooncake/conversation_trace.jsonl
//                 --capacity_blocks=1000 --policy=reuse+admit
//   kvpool-replay --sweep   # both traces x 1k/2k/5k/10k blocks x every policy
//   kvpool-replay --tiers   # both traces: the device pool alone vs with a host tier below it
//   kvpool-replay --trace=... --capacity_blocks=1000 --layers=bamba-9b   # a hybrid model:
//                 kvpool's layout (checkpoints) vs vLLM's one-page-size layout, same bytes
//   kvpool-replay --layers_sweep --layers=bamba-9b   # both traces x 1k/2k/5k blocks

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kvpool/util/mutex_mode.h"
#include "kvpool/util/version.h"
#include "model/weights.h"
#include "tools/hybrid_replay.h"
#include "tools/replay.h"

ABSL_FLAG(std::string, trace, "",
          "Mooncake-format JSONL trace to replay (required unless --sweep)");
ABSL_FLAG(int32_t, block_size, 512, "pool block size in tokens (must divide 512)");
ABSL_FLAG(int64_t, capacity_blocks, 0, "cache capacity in 512-token blocks; 0 = unlimited");
ABSL_FLAG(std::string, policy, "default",
          "eviction spec: lru | reuse, then +admit and/or +notail; default = lru+admit+notail");
ABSL_FLAG(int32_t, trace_depth, 0, "per-block operation trace depth (0 or a power of 2)");
ABSL_FLAG(bool, cache_events, false,
          "record KV events and evicted hashes as the daemon does (costs time, and memory up to "
          "the event ring's size)");
ABSL_FLAG(bool, sweep, false,
          "replay both traces of --traces_dir at 1k/2k/5k/10k blocks with every policy and "
          "print the table");
ABSL_FLAG(std::string, traces_dir, "../shared/traces/mooncake", "where --sweep finds the traces");
ABSL_FLAG(int32_t, threads, 1, "--sweep: replay this many capacities at a time");
ABSL_FLAG(int32_t, passes, 1,
          "replay the trace this many times, each on a fresh cache, and report requests/s over "
          "all of them (a longer timed window on a noisy machine; every pass must give the same "
          "hits)");
ABSL_FLAG(bool, memory_floor, false,
          "also serve every request to the memory floor (ReplayOptions::memory_floor): the copies "
          "and compares of an exact-token prefix cache alone, side by side; prints "
          "floor_requests_per_s and kvpool's share of it");
ABSL_FLAG(int64_t, max_requests, 0, "replay only the trace's first N requests (0: all)");
ABSL_FLAG(int64_t, host_blocks, 0,
          "a host tier of this many 512-token blocks below the pool (write-through, promoted on "
          "a miss, as kvpoold's); 0: none");
ABSL_FLAG(bool, tiers, false,
          "replay both traces of --traces_dir at 1k and 2k device blocks, alone and with a host "
          "tier of 4x the device blocks, with --policy, and print the table");

ABSL_FLAG(std::string, layers, "",
          "a hybrid model's layers: a preset (bamba-9b, nemotron-h-8b, falcon-h1-0.5b), a kvpool "
          "model name with "
          "state-space layers (tiny-hybrid), or a pattern (A/F attention, M/S state space, X "
          "neither: 'SSFS', 'M,M,A,M'); replays kvpool's layout against vLLM's one-page-size "
          "layout at the same bytes (--capacity_blocks 512-token blocks of attention K/V)");
ABSL_FLAG(int64_t, kv_bytes_per_token, 0,
          "--layers: K+V bytes of one token in one attention layer (0: the preset's, else 4096 "
          "= 8 KV heads of 128 in bf16)");
ABSL_FLAG(int64_t, state_bytes, 0,
          "--layers: bytes of one state-space layer's state (0: the preset's, else Bamba-9B's "
          "2,147,840)");
ABSL_FLAG(int32_t, kv_dtype_bytes, 2,
          "--layers=<kvpool model>: bytes of one K/V element (2: bf16, as vLLM holds them)");
ABSL_FLAG(std::string, state_shares, "0.25",
          "--layers: the shares of the memory kvpool's layout gives to state slots, one row each");
ABSL_FLAG(std::string, checkpoint_intervals, "auto",
          "--layers: kvpool's checkpoint intervals in blocks, one row each with every state "
          "share (auto: kvpoold's, three times the break-even interval, where a prefix's "
          "checkpoints take a third of the bytes of its K/V; 0: branch points, the prefill's last "
          "block boundary and each prompt's end only; 32 blocks of 16 = 512 tokens)");
ABSL_FLAG(int32_t, layers_block_size, 16, "--layers: kvpool's block size in tokens");
ABSL_FLAG(bool, unresumable_first, true,
          "--layers: kvpool evicts first the blocks past a path's last checkpoint, which no prompt "
          "can resume at (false: its eviction policy orders them with the rest)");
ABSL_FLAG(std::string, checkpoint_evictions, "expected_tokens_saved",
          "--layers: the orders kvpool evicts cached checkpoints in, one row each with every "
          "interval and share (expected_tokens_saved, row 'kvpool': by the tokens each saves "
          "over the next one up its path, weighed by how often its kind is resumed from; "
          "tokens_saved, row 'kvpool-gds': unweighed, GreedyDual-Size; lru, row 'kvpool-lru': "
          "least recently used)");
ABSL_FLAG(bool, checkpoint_kinds, false,
          "--layers: after each kvpool row, the resumes per checkpoint kept by why it was taken "
          "(interval, branch point, prefill end, sequence end, ...; the weights "
          "expected_tokens_saved orders by)");
ABSL_FLAG(bool, layers_sweep, false,
          "replay both traces of --traces_dir at 1k/2k/5k blocks with --layers (default "
          "bamba-9b) and print the table");

namespace {

namespace tools = kvpool::tools;

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvpool-replay: %s\n", message.c_str());
  return 1;
}

int RunSweep() {
  std::printf("%-26s %8s %-20s %9s %8s %10s %11s\n", "trace", "blocks", "policy", "hit_rate",
              "vs_lru", "req_per_s", "evictions");
  for (std::string_view name : tools::kSweepTraces) {
    const std::string path = absl::GetFlag(FLAGS_traces_dir) + "/" + std::string(name);
    const auto trace = kvpool::workload::ReadMooncakeTrace(path);
    if (!trace.ok()) return Fail(std::string(trace.status().message()));
    const auto rows = tools::Sweep(*trace, name, tools::kSweepCapacities, tools::kSweepPolicies);
    if (!rows.ok()) return Fail(rows.status().ToString());
    for (const tools::SweepRow& row : *rows) {
      std::printf(
          "%-26s %8lld %-20s %9.4f %7.2fx %10.0f %11llu\n", row.trace.c_str(),
          static_cast<long long>(row.capacity_blocks), row.policy.c_str(), row.result.hit_rate(),
          row.lru_hit_rate > 0 ? row.result.hit_rate() / row.lru_hit_rate : 0.0,
          row.result.requests_per_second(), static_cast<unsigned long long>(row.result.evictions));
      std::fflush(stdout);
    }
  }
  return 0;
}

int RunTiers() {
  std::printf("%-26s %8s %8s %12s %12s %8s %12s\n", "trace", "device", "host", "device_only",
              "with_host", "ratio", "from_host_%");
  const std::string policy = absl::GetFlag(FLAGS_policy);
  for (std::string_view name : tools::kSweepTraces) {
    const std::string path = absl::GetFlag(FLAGS_traces_dir) + "/" + std::string(name);
    auto trace = kvpool::workload::ReadMooncakeTrace(path);
    if (!trace.ok()) return Fail(std::string(trace.status().message()));
    const int64_t max_requests = absl::GetFlag(FLAGS_max_requests);
    if (max_requests > 0 && static_cast<int64_t>(trace->size()) > max_requests) {
      trace->resize(static_cast<size_t>(max_requests));
    }
    for (int64_t device : {int64_t{1000}, int64_t{2000}}) {
      const std::vector<tools::ReplayOptions> configs = {
          {.capacity_blocks = device, .policy = policy},
          {.capacity_blocks = device, .policy = policy, .host_blocks = 4 * device}};
      const auto results = tools::ReplayAll(*trace, configs);
      if (!results.ok()) return Fail(results.status().ToString());
      const tools::ReplayResult& alone = (*results)[0];
      const tools::ReplayResult& tiered = (*results)[1];
      std::printf("%-26s %8lld %8lld %12.4f %12.4f %7.2fx %12.1f\n", std::string(name).c_str(),
                  static_cast<long long>(device), static_cast<long long>(4 * device),
                  alone.hit_rate(), tiered.hit_rate(),
                  alone.hit_rate() > 0 ? tiered.hit_rate() / alone.hit_rate() : 0.0,
                  tiered.hit_blocks > 0 ? 100.0 * static_cast<double>(tiered.host_hit_blocks) /
                                              static_cast<double>(tiered.hit_blocks)
                                        : 0.0);
      std::fflush(stdout);
    }
  }
  return 0;
}

// --layers: the layout, from a preset, a pattern, or a kvpool model's config.
absl::StatusOr<tools::LayerLayout> Layers() {
  std::string spec = absl::GetFlag(FLAGS_layers);
  if (spec.empty()) spec = "bamba-9b";
  const int64_t kv = absl::GetFlag(FLAGS_kv_bytes_per_token);
  const int64_t state = absl::GetFlag(FLAGS_state_bytes);
  const absl::StatusOr<kvpool::model::ModelConfig> config = kvpool::model::NamedConfig(spec);
  if (!config.ok() || config->num_state_layers() == 0) return tools::ParseLayers(spec, kv, state);
  // A kvpool model: its K/V at --kv_dtype_bytes, its state as the model holds it (f32).
  const int32_t dtype = absl::GetFlag(FLAGS_kv_dtype_bytes);
  if (dtype <= 0) return absl::InvalidArgumentError("--kv_dtype_bytes must be positive");
  return tools::LayerLayout{
      .name = spec,
      .attention_layers = config->num_kv_layers(),
      .state_layers = config->num_state_layers(),
      .kv_bytes_per_token =
          kv > 0 ? kv : int64_t{2} * config->num_kv_heads * config->head_dim * dtype,
      .state_bytes = state > 0 ? state : config->state_bytes() / config->num_state_layers()};
}

// kvpool's variants: every checkpoint eviction order with every interval and state share.
struct Variant {
  double share = 0;
  int32_t interval = 0;
  kvpool::KvCacheOptions::CheckpointEviction eviction =
      kvpool::KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved;
};

absl::StatusOr<std::vector<Variant>> Variants() {
  using Eviction = kvpool::KvCacheOptions::CheckpointEviction;
  std::vector<Variant> variants;
  for (absl::string_view order : absl::StrSplit(absl::GetFlag(FLAGS_checkpoint_evictions), ',')) {
    const std::optional<Eviction> eviction =
        kvpool::ParseCheckpointEviction(std::string_view(order.data(), order.size()));
    if (!eviction) {
      return absl::InvalidArgumentError(
          absl::StrCat("--checkpoint_evictions: '", order,
                       "' is none of expected_tokens_saved, tokens_saved and lru"));
    }
    for (absl::string_view ivl : absl::StrSplit(absl::GetFlag(FLAGS_checkpoint_intervals), ',')) {
      int32_t interval = tools::kDefaultInterval;
      if (ivl != "auto" && (!absl::SimpleAtoi(ivl, &interval) || interval < 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--checkpoint_intervals: '", ivl, "' is neither auto nor a number of blocks >= 0"));
      }
      for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_state_shares), ',')) {
        double share = 0;
        if (!absl::SimpleAtod(part, &share) || !(share >= 0 && share < 1)) {
          return absl::InvalidArgumentError(
              absl::StrCat("--state_shares: '", part, "' is not a share in [0, 1)"));
        }
        variants.push_back({share, interval, *eviction});
      }
    }
  }
  return variants;
}

void PrintLayersHeader(const tools::LayerLayout& layers, const tools::HashChainLayout& chain) {
  std::printf(
      "layers %s: %d attention layers x %lld B/token, %d state layers x %lld B/state\n"
      "hash-chain (vLLM): B = 16 * ceil(%lld / (16 * %lld)) = %d tokens, page %lld B, groups of "
      "%d layers (%d attention, %d state), %lld B per cached block\n",
      layers.name.c_str(), layers.attention_layers,
      static_cast<long long>(layers.kv_bytes_per_token), layers.state_layers,
      static_cast<long long>(layers.state_bytes), static_cast<long long>(layers.state_bytes),
      static_cast<long long>(layers.kv_bytes_per_token), chain.block_size,
      static_cast<long long>(chain.page_bytes), chain.group_size, chain.attention_groups,
      chain.state_groups, static_cast<long long>(chain.block_bytes()));
  std::printf("%-26s %6s %-10s %5s %4s %5s %7s %9s %9s %8s %9s %9s %9s %7s %7s %7s %7s\n", "trace",
              "blocks", "layout", "B", "ivl", "share", "slots", "hit_rate", "tok_hit", "vs_base",
              "kvB/tok", "stB/tok", "B/tok", "kept", "evict", "resumed", "skipped");
}

void PrintLayout(std::string_view trace, int64_t capacity, const char* name, Variant v,
                 const tools::LayoutResult& r, double base_hit) {
  const double tokens = std::max(r.mean_cached_tokens, 1.0);
  // The ratio to the baseline: "inf" when only this layout hit, "-" when neither did.
  const std::string ratio = base_hit > 0 ? absl::StrFormat("%.2fx", r.replay.hit_rate() / base_hit)
                            : r.replay.hit_rate() > 0 ? "inf"
                                                      : "-";
  std::printf(
      "%-26s %6lld %-10s %5d %4d %5.2f %7lld %9.4f %9.4f %8s %9.0f %9.0f %9.0f %7lld %7lld "
      "%7lld %7lld\n",
      std::string(trace).c_str(), static_cast<long long>(capacity), name, r.block_size,
      r.checkpoint_interval, v.share, static_cast<long long>(r.state_slots), r.replay.hit_rate(),
      r.token_hit_rate(), ratio.c_str(), r.mean_kv_bytes / tokens, r.mean_state_bytes / tokens,
      r.bytes_per_cached_token(), static_cast<long long>(r.checkpoints_kept),
      static_cast<long long>(r.checkpoints_evicted), static_cast<long long>(r.checkpoints_resumed),
      static_cast<long long>(r.replay.skipped));
  if (!absl::GetFlag(FLAGS_checkpoint_kinds) || r.state_slots == 0) return;
  std::string kinds;
  for (size_t k = 0; k < r.resume_rate.size(); ++k) {
    absl::StrAppendFormat(&kinds, " %s=%.4f",
                          kvpool::CheckpointKindName(static_cast<kvpool::CheckpointKind>(k)),
                          r.resume_rate[k]);
  }
  std::printf("%-26s resumes per checkpoint kept:%s\n", "", kinds.c_str());
}

// The bound no layout passes: the same bytes all K/V at kvpool's block size, every token a
// resumable point (as if states cost nothing), least recently used.
void PrintBound(std::string_view trace, int64_t capacity, const tools::ReplayResult& r,
                double base_hit) {
  const double tokens = r.prompt_tokens > 0 ? static_cast<double>(r.prompt_tokens) : 1.0;
  const std::string ratio = base_hit > 0 ? absl::StrFormat("%.2fx", r.hit_rate() / base_hit) : "-";
  std::printf("%-26s %6lld %-10s %5d %4s %5s %7s %9.4f %9.4f %8s\n", std::string(trace).c_str(),
              static_cast<long long>(capacity), "no-states", absl::GetFlag(FLAGS_layers_block_size),
              "-", "-", "-", r.hit_rate(), static_cast<double>(r.hit_tokens) / tokens,
              ratio.c_str());
}

// Replays `trace` with kvpool's layout at every state share and the hash-chain layout, at each
// capacity, and prints the rows, then the bound (PrintBound); false (after printing why) on an
// error. Sets *worst to the
// lowest hybrid/baseline ratio seen.
bool RunLayersOn(const std::vector<kvpool::workload::TraceRequest>& trace, std::string_view name,
                 const tools::LayerLayout& layers, std::span<const int64_t> capacities,
                 std::span<const Variant> variants, double* worst) {
  for (int64_t capacity : capacities) {
    std::vector<tools::HybridReplayOptions> configs;
    for (const Variant& v : variants) {
      configs.push_back({.layers = layers,
                         .capacity_blocks = capacity,
                         .block_size = absl::GetFlag(FLAGS_layers_block_size),
                         .state_share = v.share,
                         .checkpoint_interval = v.interval,
                         .checkpoint_eviction = v.eviction,
                         .evict_unresumable_first = absl::GetFlag(FLAGS_unresumable_first)});
    }
    const auto results = tools::ReplayHybrid(trace, configs);
    if (!results.ok()) {
      Fail(results.status().ToString());
      return false;
    }
    const tools::LayoutResult& base = (*results)[0].baseline;
    PrintLayout(name, capacity, "hash-chain", Variant{}, base, base.replay.hit_rate());
    for (size_t i = 0; i < results->size(); ++i) {
      const tools::LayoutResult& h = (*results)[i].hybrid;
      using Eviction = kvpool::KvCacheOptions::CheckpointEviction;
      PrintLayout(name, capacity,
                  variants[i].eviction == Eviction::kByExpectedTokensSaved ? "kvpool"
                  : variants[i].eviction == Eviction::kByTokensSaved       ? "kvpool-gds"
                                                                           : "kvpool-lru",
                  variants[i], h, base.replay.hit_rate());
      const double ratio = base.replay.hit_rate() > 0 ? h.replay.hit_rate() / base.replay.hit_rate()
                           : h.replay.hit_rate() > 0  ? 1e9
                                                      : 1.0;
      *worst = std::min(*worst, ratio);
    }
    const auto bound = tools::Replay(trace, {.block_size = absl::GetFlag(FLAGS_layers_block_size),
                                             .capacity_blocks = capacity,
                                             .policy = "lru"});
    if (!bound.ok()) {
      Fail(bound.status().ToString());
      return false;
    }
    PrintBound(name, capacity, *bound, base.replay.hit_rate());
    std::fflush(stdout);
  }
  return true;
}

int RunLayers(const std::vector<std::string>& paths, std::span<const int64_t> capacities) {
  const absl::StatusOr<tools::LayerLayout> layers = Layers();
  if (!layers.ok()) return Fail(std::string(layers.status().message()));
  const absl::StatusOr<std::vector<Variant>> variants = Variants();
  if (!variants.ok()) return Fail(std::string(variants.status().message()));
  PrintLayersHeader(*layers, tools::HashChain(*layers));
  double worst = 1e18;
  for (const std::string& path : paths) {
    auto trace = kvpool::workload::ReadMooncakeTrace(path);
    if (!trace.ok()) return Fail(std::string(trace.status().message()));
    const int64_t max_requests = absl::GetFlag(FLAGS_max_requests);
    if (max_requests > 0 && static_cast<int64_t>(trace->size()) > max_requests) {
      trace->resize(static_cast<size_t>(max_requests));
    }
    const std::string name = path.substr(path.find_last_of('/') + 1);
    if (!RunLayersOn(*trace, name, *layers, capacities, *variants, &worst)) return 1;
  }
  std::printf("lowest kvpool/hash-chain hit-rate ratio %s (target: >= 3x, never below 1x)\n",
              worst >= 1e9 ? "inf" : absl::StrFormat("%.2fx", worst).c_str());
  return 0;
}

// Replays `trace` `more` times again and folds their time into `results` (the first pass's), so
// that requests/s counts every pass. Each pass must repeat the first one's outcome exactly: the
// replay is deterministic (trace time, not wall time, drives the policies).
absl::Status ReplayAgain(const std::vector<kvpool::workload::TraceRequest>& trace,
                         std::span<const tools::ReplayOptions> configs, int32_t more,
                         std::vector<tools::ReplayResult>* results) {
  std::vector<double> seconds;
  for (const tools::ReplayResult& r : *results) seconds.push_back(r.seconds);
  for (int32_t pass = 0; pass < more; ++pass) {
    absl::StatusOr<std::vector<tools::ReplayResult>> again = tools::ReplayAll(trace, configs);
    if (!again.ok()) return again.status();
    for (size_t i = 0; i < again->size(); ++i) {
      const tools::ReplayResult& a = (*again)[i];
      const tools::ReplayResult& first = (*results)[i];
      if (a.hit_blocks != first.hit_blocks || a.hit_tokens != first.hit_tokens ||
          a.evictions != first.evictions) {
        return absl::InternalError(
            absl::StrCat("pass ", pass + 2, " of the replay differs from the first"));
      }
      seconds[i] += a.seconds;
    }
  }
  for (size_t i = 0; i < results->size(); ++i) {
    (*results)[i].seconds = seconds[i] / (more + 1);  // the mean pass
  }
  return absl::OkStatus();
}

int RunOne(const std::string& path) {
  auto trace = kvpool::workload::ReadMooncakeTrace(path);
  if (!trace.ok()) return Fail(std::string(trace.status().message()));
  const int64_t max_requests = absl::GetFlag(FLAGS_max_requests);
  if (max_requests > 0 && static_cast<int64_t>(trace->size()) > max_requests) {
    trace->resize(static_cast<size_t>(max_requests));
  }
  std::vector<tools::ReplayOptions> configs = {
      {.block_size = absl::GetFlag(FLAGS_block_size),
       .capacity_blocks = absl::GetFlag(FLAGS_capacity_blocks),
       .policy = absl::GetFlag(FLAGS_policy),
       .trace_depth = absl::GetFlag(FLAGS_trace_depth),
       .cache_events = absl::GetFlag(FLAGS_cache_events),
       .host_blocks = absl::GetFlag(FLAGS_host_blocks)}};
  // Plain LRU beside it, same run (unless it is plain LRU: then it is its own baseline).
  if (configs[0].policy != "lru") {
    configs.push_back(configs[0]);
    configs[1].policy = "lru";
  }
  const bool floor = absl::GetFlag(FLAGS_memory_floor);
  if (floor) {
    configs.push_back(configs[0]);
    configs.back().memory_floor = true;
  }
  const bool tty = isatty(STDERR_FILENO) != 0;
  tools::ReplayProgress progress = [](const tools::ReplayResult& r, int64_t total) {
    std::fprintf(stderr, "\r[kvpool-replay] %lld/%lld requests  hit_rate %.4f",
                 static_cast<long long>(r.requests), static_cast<long long>(total), r.hit_rate());
  };
  const int32_t passes = absl::GetFlag(FLAGS_passes);
  if (passes < 1) return Fail("--passes must be at least 1");
  auto results = tools::ReplayAll(*trace, configs, tty ? progress : tools::ReplayProgress());
  if (tty) std::fprintf(stderr, "\n");
  if (!results.ok()) return Fail(results.status().ToString());
  if (absl::Status s = ReplayAgain(*trace, configs, passes - 1, &*results); !s.ok()) {
    return Fail(s.ToString());
  }
  const tools::ReplayResult& r = (*results)[0];
  const tools::ReplayResult& lru = (*results)[configs[0].policy != "lru" ? 1 : 0];
  std::printf("trace %s\n", path.c_str());
  std::printf("block_size %d capacity_blocks %lld policy %s\n", configs[0].block_size,
              static_cast<long long>(configs[0].capacity_blocks), configs[0].policy.c_str());
  std::printf("requests %lld (skipped %lld)\n", static_cast<long long>(r.requests),
              static_cast<long long>(r.skipped));
  std::printf("prompt_blocks %lld hit_blocks %lld\n", static_cast<long long>(r.prompt_blocks),
              static_cast<long long>(r.hit_blocks));
  std::printf("token_hit_rate %.4f\n",
              r.prompt_tokens == 0 ? 0.0 : static_cast<double>(r.hit_tokens) / r.prompt_tokens);
  std::printf("evictions %llu\n", static_cast<unsigned long long>(r.evictions));
  if (configs[0].host_blocks > 0) {
    std::printf("host_blocks %lld host_hit_blocks %lld\n",
                static_cast<long long>(configs[0].host_blocks),
                static_cast<long long>(r.host_hit_blocks));
  }
  std::printf("policy_state %s\n", r.policy_state.c_str());
  std::printf("requests_per_s %.0f (allocate+commit+free; lru %.0f; over %d passes)\n",
              r.requests_per_second(), lru.requests_per_second(), passes);
  if (floor) {
    const tools::ReplayResult& f = results->back();
    std::printf(
        "floor_requests_per_s %.0f (hit_rate %.4f; kvpool at %.3f of it)\n",
        f.requests_per_second(), f.hit_rate(),
        f.requests_per_second() > 0 ? r.requests_per_second() / f.requests_per_second() : 0.0);
  }
  std::printf("lru_hit_rate %.4f\n", lru.hit_rate());
  std::printf("ratio_to_lru %.3f\n", lru.hit_rate() > 0 ? r.hit_rate() / lru.hit_rate() : 0.0);
  std::printf("hit_rate %.4f\n", r.hit_rate());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  kvpool::SetProgramDeadlockDetection();
  // --help lists this file's flags (absl's default looks for a file named after the binary).
  // --version prints the project's version (CMakeLists.txt project(), the package's version).
  absl::SetFlagsUsageConfig(
      {.contains_help_flags =
           [](absl::string_view file) { return absl::EndsWith(file, "tools/replay_main.cc"); },
       .version_string = [] { return absl::StrCat("kvpool-replay ", kvpool::kVersion, "\n"); }});
  absl::SetProgramUsageMessage("Replays a Mooncake trace through kvpool's prefix cache.");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_sweep)) return RunSweep();
  if (absl::GetFlag(FLAGS_tiers)) return RunTiers();
  if (absl::GetFlag(FLAGS_layers_sweep)) {
    std::vector<std::string> paths;
    for (std::string_view name : tools::kSweepTraces) {
      paths.push_back(absl::GetFlag(FLAGS_traces_dir) + "/" + std::string(name));
    }
    return RunLayers(paths, tools::kLayersCapacities);
  }
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) {
    std::fprintf(stderr, "kvpool-replay: --trace (or --sweep) is required (see --help)\n");
    return 2;
  }
  if (!absl::GetFlag(FLAGS_layers).empty()) {
    const int64_t capacity = absl::GetFlag(FLAGS_capacity_blocks);
    if (capacity <= 0) return Fail("--layers needs --capacity_blocks > 0 (the memory budget)");
    return RunLayers({path}, std::span(&capacity, 1));
  }
  return RunOne(path);
}
