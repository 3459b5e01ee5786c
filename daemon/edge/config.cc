#include "daemon/edge/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "daemon/metrics/metrics_config.h"
#include "fmt/format.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "kernels/plan_executor.h"
#include "kernels/pool_layout.h"
#include "kvpool/eviction_policy.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/status_macros.h"
#include "kvpool/v1/wire.h"
#include "model/weights.h"
#include "tier/disk_tier_options.h"
#include "tier/secret.h"

namespace kvpool::daemon {
namespace {

constexpr int64_t kDefaultPoolBytes = 256ll << 20;
constexpr int32_t kDefaultStateSlots = 64;
// limits.eviction_shares: each share keeps per-block arrays of its own, so not thousands.
constexpr int32_t kMaxEvictionShares = 1024;

// Collects protobuf's parse errors as "file:line:col: message" lines.
class ErrorLines final : public google::protobuf::io::ErrorCollector {
 public:
  explicit ErrorLines(std::string file) : file_(std::move(file)) {}
  void AddError(int line, int column, const std::string& message) override {
    lines_.push_back(fmt::format("{}:{}:{}: {}", file_, line + 1, column + 1, message));
  }
  void AddWarning(int line, int column, const std::string& message) override {
    AddError(line, column, message);
  }
  const std::vector<std::string>& lines() const { return lines_; }

 private:
  std::string file_;
  std::vector<std::string> lines_;
};

std::string Join(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += (out.empty() ? "" : "\n") + l;
  return out;
}

}  // namespace

v1::DaemonConfig DefaultConfig() {
  v1::DaemonConfig config;
  ApplyDefaults(&config);
  return config;
}

void ApplyDefaults(v1::DaemonConfig* c) {
  if (c->runtime_dir().empty()) c->set_runtime_dir(wire::DefaultRuntimeDir());
  if (c->backend().empty()) c->set_backend("cpu");
  if (c->pool_bytes() == 0) c->set_pool_bytes(kDefaultPoolBytes);
  v1::ModelSpec* m = c->mutable_model();
  if (m->name().empty() && m->checkpoint().empty()) m->set_name("tiny");
  if (m->seed() == 0) m->set_seed(1);
  if (m->gather_window_us() == 0) m->set_gather_window_us(2000);
  if (m->max_step_tokens() == 0) m->set_max_step_tokens(512);
  if (m->threads() == 0) m->set_threads(c->cpu_threads());
  if (m->prefill_max_wait_steps() == 0) m->set_prefill_max_wait_steps(4);
  // The pool's shape follows the model's KV geometry unless set (the tiny model's without one).
  absl::StatusOr<model::ModelConfig> geometry = model::NamedConfig("tiny");
  if (!m->checkpoint().empty()) {
    geometry = model::ReadCheckpointConfig(m->checkpoint());  // errors are reported at load
  } else if (absl::StatusOr<model::ModelConfig> named = model::NamedConfig(m->name()); named.ok()) {
    geometry = named;
  }
  v1::PoolShape* s = c->mutable_shape();
  if (s->block_size() == 0) s->set_block_size(16);
  if (geometry.ok()) {
    // (Only attention layers keep K/V: a hybrid's state-space layers have a state slot instead.)
    if (s->num_layers() == 0) s->set_num_layers(geometry->pool_layers());
    if (s->state_slots() == 0 && geometry->num_state_layers() > 0) {
      s->set_state_slots(kDefaultStateSlots);
    }
    if (s->num_kv_heads() == 0) s->set_num_kv_heads(geometry->num_kv_heads);
    if (s->head_dim() == 0) s->set_head_dim(geometry->head_dim);
  }
  if (s->dtype().empty()) s->set_dtype("bf16");
  if (c->max_blocks_per_seq() == 0) c->set_max_blocks_per_seq(4096);
  if (c->fill_policy().empty()) c->set_fill_policy("none");
  if (c->trace_depth() == 0) c->set_trace_depth(8);
  if (c->eviction_policy().empty()) c->set_eviction_policy("default");
  if (c->event_capacity() == 0) c->set_event_capacity(65536);
  if (c->event_capacity_bytes() == 0) c->set_event_capacity_bytes(int64_t{64} << 20);
  if (c->allowed_uids().empty() && c->allowed_gids().empty()) c->add_allowed_uids(getuid());
  if (c->admin_uids().empty()) c->add_admin_uids(getuid());
  if (c->log_level().empty()) c->set_log_level("info");
  if (c->drain_timeout_ms() == 0) c->set_drain_timeout_ms(5000);
  if (c->socket_mode() == 0) c->set_socket_mode(0660);
  if (c->runtime_dir_mode() == 0) c->set_runtime_dir_mode(0700);
  v1::Limits* l = c->mutable_limits();
  if (l->sessions_per_uid() == 0) l->set_sessions_per_uid(64);
  if (l->sequences_per_session() == 0) l->set_sequences_per_session(65536);
  if (l->batch_items() == 0) l->set_batch_items(4096);
  if (l->queued_calls_per_session() == 0) l->set_queued_calls_per_session(64);
  if (l->attach_pending() == 0) l->set_attach_pending(64);
  if (l->attach_pending_per_uid() == 0) l->set_attach_pending_per_uid(8);
  if (l->attach_timeout_ms() == 0) l->set_attach_timeout_ms(500);
  if (l->cache_salts_per_session() == 0) l->set_cache_salts_per_session(4096);
  if (l->cache_salts_per_uid() == 0) l->set_cache_salts_per_uid(16384);
  if (l->block_refs_per_uid() == 0) l->set_block_refs_per_uid(int64_t{1} << 22);
  if (l->doorbells_per_uid() == 0) l->set_doorbells_per_uid(8);
  if (l->eviction_shares() == 0) l->set_eviction_shares(16);
  if (l->stop_tokens() == 0) l->set_stop_tokens(256);
}

namespace {

// Reports a problem: the field, then why. The parse goes on, so every problem is reported.
using Bad = std::function<void(std::string_view, std::string)>;

// `name` as one of `table`'s values; the problem names the valid ones (empty: the first).
template <typename T, size_t N>
std::optional<T> Choose(std::string_view field, const std::string& name,
                        const std::pair<const char*, T> (&table)[N], const Bad& bad) {
  if (name.empty()) return table[0].second;
  std::string valid;
  for (const auto& [text, value] : table) {
    if (name == text) return value;
    valid += fmt::format("{}{}", valid.empty() ? "" : ", ", text);
  }
  bad(field, fmt::format("'{}' is not one of {}", name, valid));
  return std::nullopt;
}

constexpr std::pair<const char*, tier::DiskFsync> kFsyncNames[] = {
    {"none", tier::DiskFsync::kNone},
    {"batch", tier::DiskFsync::kBatch},
    {"periodic", tier::DiskFsync::kPeriodic}};
constexpr std::pair<const char*, tier::KeySlotting> kKeySlottingNames[] = {
    {"namespace", tier::KeySlotting::kNamespace}, {"block", tier::KeySlotting::kBlock}};

// The model section: its name or checkpoint, and the step settings, into `o`.
void ParseModel(const v1::DaemonConfig& c, bool shape_ok, EngineOptions* o, const Bad& bad) {
  const v1::ModelSpec& m = c.model();
  if (m.checkpoint().empty() && m.name() != "none" && shape_ok) {
    if (absl::StatusOr<model::ModelConfig> named = model::NamedConfig(m.name()); !named.ok()) {
      bad("model.name", absl::StrCat(named.status().message(), " (or none)"));
    } else if (named->pool_layers() != c.shape().num_layers() ||
               named->num_kv_heads != c.shape().num_kv_heads() ||
               named->head_dim != c.shape().head_dim()) {
      bad("shape",
          fmt::format("model {} needs num_layers {}, num_kv_heads {}, head_dim {}", m.name(),
                      named->pool_layers(), named->num_kv_heads, named->head_dim));
    }
  }
  if (!m.checkpoint().empty() && m.checkpoint()[0] != '/') {
    bad("model.checkpoint", fmt::format("must be an absolute path (got '{}')", m.checkpoint()));
  }
  if (m.gather_window_us() < 0 || m.gather_window_us() > 1000000) {
    bad("model.gather_window_us", "must be in [0, 1000000]");
  }
  if (m.max_step_tokens() < 1) bad("model.max_step_tokens", "must be >= 1");
  if (m.threads() < 0) bad("model.threads", "must be >= 0 (0: all cores)");
  if (m.prefill_max_wait_steps() < 1) bad("model.prefill_max_wait_steps", "must be >= 1");
  if (m.prefill_share_tokens() < 0 || m.prefill_share_tokens() > m.max_step_tokens()) {
    bad("model.prefill_share_tokens",
        fmt::format("must be in [0, max_step_tokens] (got {})", m.prefill_share_tokens()));
  }
  o->model_name = m.checkpoint().empty() ? m.name() : m.checkpoint();
  o->gather_window_ns = int64_t{m.gather_window_us()} * 1000;
  o->scheduler = {.batching = !m.disable_batching(),
                  .max_step_tokens = m.max_step_tokens(),
                  .prefill_max_wait_steps = m.prefill_max_wait_steps(),
                  .prefill_share = m.prefill_share_tokens()};
}

// Every limit is positive; the decode width fits one step.
void ParseLimits(const v1::DaemonConfig& c, EngineOptions* o, const Bad& bad) {
  const v1::Limits& l = c.limits();
  const std::pair<const char*, int64_t> positive[] = {
      {"limits.sessions_per_uid", l.sessions_per_uid()},
      {"limits.sequences_per_session", l.sequences_per_session()},
      {"limits.batch_items", l.batch_items()},
      {"limits.queued_calls_per_session", l.queued_calls_per_session()},
      {"limits.attach_pending", l.attach_pending()},
      {"limits.attach_pending_per_uid", l.attach_pending_per_uid()},
      {"limits.attach_timeout_ms", l.attach_timeout_ms()},
      {"limits.cache_salts_per_session", l.cache_salts_per_session()},
      {"limits.cache_salts_per_uid", l.cache_salts_per_uid()},
      {"limits.block_refs_per_uid", l.block_refs_per_uid()},
      {"limits.doorbells_per_uid", l.doorbells_per_uid()},
      {"limits.stop_tokens", l.stop_tokens()},
  };
  for (const auto& [field, value] : positive) {
    if (value <= 0) bad(field, fmt::format("must be > 0 (got {})", value));
  }
  if (l.decode_width() < 0 || l.decode_width() > c.model().max_step_tokens()) {
    bad("limits.decode_width",
        fmt::format("must be in [0, model.max_step_tokens] ({}; 0: that), got {}",
                    c.model().max_step_tokens(), l.decode_width()));
  }
  if (l.state_slots_per_uid() < 0) {
    bad("limits.state_slots_per_uid",
        fmt::format("must be >= 0 (0: every state slot), got {}", l.state_slots_per_uid()));
  }
  if (l.eviction_shares() < -1 || l.eviction_shares() > kMaxEvictionShares) {
    bad("limits.eviction_shares", fmt::format("must be in [1, {}], or -1 (off), got {}",
                                              kMaxEvictionShares, l.eviction_shares()));
  }
  if (l.attach_pending_per_uid() > l.attach_pending()) {
    bad("limits.attach_pending_per_uid", "must be at most limits.attach_pending");
  }
  o->limits = {
      .sessions_per_uid = l.sessions_per_uid(),
      .sequences_per_session = l.sequences_per_session(),
      .batch_items = l.batch_items(),
      .queued_calls_per_session = l.queued_calls_per_session(),
      .decode_width = l.decode_width() > 0 ? l.decode_width() : c.model().max_step_tokens(),
      .cache_salts_per_session = l.cache_salts_per_session(),
      .cache_salts_per_uid = l.cache_salts_per_uid(),
      .block_refs_per_uid = l.block_refs_per_uid(),
      .stop_tokens = l.stop_tokens(),
      .state_slots_per_uid = l.state_slots_per_uid() > 0 ? l.state_slots_per_uid() : kUnlimited};
  o->eviction_shares = std::max(l.eviction_shares(), 0);
}

// The pool shape as a layout (num_blocks 0): geometry, `dtype`, then k_dtype / v_dtype, then each
// `layers` entry in order (config.proto: PoolShape). Reports each dtype problem through `bad`
// and clears *dtypes_ok; geometry is ValidateLayout's to check.
kernels::PoolLayout ShapeLayout(const v1::PoolShape& s, const Bad& bad, bool* dtypes_ok) {
  kernels::PoolLayout layout{.block_size = s.block_size(),
                             .num_layers = s.num_layers(),
                             .num_kv_heads = s.num_kv_heads(),
                             .head_dim = s.head_dim()};
  // Parses `name` (empty: not set) into *out, or reports it under `field`.
  auto parse = [&](const std::string& field, const std::string& name,
                   std::optional<kernels::DType>* out) {
    if (name.empty()) return;
    absl::StatusOr<kernels::DType> d = kernels::ParseDType(name);
    if (d.ok()) {
      *out = *d;
    } else {
      bad(field, std::string(d.status().message()));
      *dtypes_ok = false;
    }
  };
  std::optional<kernels::DType> dtype, k, v;
  parse("shape.dtype", s.dtype(), &dtype);
  parse("shape.k_dtype", s.k_dtype(), &k);
  parse("shape.v_dtype", s.v_dtype(), &v);
  layout.dtype = dtype.value_or(kernels::DType::kBF16);
  const bool layers_ok = layout.num_layers > 0 && layout.num_layers <= kernels::kMaxLayers;
  for (int32_t l = 0; layers_ok && l < layout.num_layers; ++l) {
    if (k) layout.SetKvDType(l, kernels::KvSide::kK, *k);
    if (v) layout.SetKvDType(l, kernels::KvSide::kV, *v);
  }
  for (int i = 0; i < s.layers_size(); ++i) {
    const v1::PoolShape::LayerDTypes& e = s.layers(i);
    const std::string field = fmt::format("shape.layers[{}]", i);
    std::optional<kernels::DType> both, ek, ev;
    parse(field + ".dtype", e.dtype(), &both);
    parse(field + ".k_dtype", e.k_dtype(), &ek);
    parse(field + ".v_dtype", e.v_dtype(), &ev);
    if (e.dtype().empty() && e.k_dtype().empty() && e.v_dtype().empty()) {
      bad(field, "sets no dtype (dtype, k_dtype or v_dtype)");
      *dtypes_ok = false;
    }
    if (e.index().empty()) {
      bad(field, "names no layer (index)");
      *dtypes_ok = false;
    }
    for (int j = 0; j < e.index_size() && layers_ok; ++j) {
      const int32_t n = layout.num_layers, index = e.index(j);
      if (index < -n || index >= n) {
        bad(fmt::format("{}.index[{}]", field, j),
            fmt::format("layer {} outside [-{}, {})", index, n, n));
        *dtypes_ok = false;
        continue;
      }
      const int32_t l = index < 0 ? n + index : index;
      if (ek) layout.SetKvDType(l, kernels::KvSide::kK, *ek);
      if (ev) layout.SetKvDType(l, kernels::KvSide::kV, *ev);
      if (both && !ek) layout.SetKvDType(l, kernels::KvSide::kK, *both);
      if (both && !ev) layout.SetKvDType(l, kernels::KvSide::kV, *both);
    }
  }
  return layout;
}

// A name sessions or operators give: printable and short (AttachPolicy's rules).
bool PrintableName(const std::string& name) {
  return !name.empty() && name.size() <= 128 &&
         std::all_of(name.begin(), name.end(),
                     [](unsigned char ch) { return ch >= 0x20 && ch < 0x7f; });
}

// The ZeroMQ event publisher: set fields need an endpoint; a named pool exists. (Whether ZeroMQ
// can bind an endpoint is learned when the daemon starts, which then exits with its reason.)
void ValidateZmqEvents(const v1::DaemonConfig& c, const Bad& bad) {
  const v1::ZmqEventsSpec& z = c.zmq_events();
  if (z.endpoint().empty()) {
    if (z.ByteSizeLong() != 0) bad("zmq_events.endpoint", "must be set for a publisher");
    return;
  }
  if (z.replay_endpoint() == z.endpoint()) {
    bad("zmq_events.replay_endpoint", "must differ from zmq_events.endpoint");
  }
  if (z.replay_batches() < 0 || z.replay_batches() > 1000000) {
    bad("zmq_events.replay_batches", "must be in [0, 1000000] (0: 10000)");
  }
  if (z.queued_bytes() < 0) {
    bad("zmq_events.queued_bytes",
        fmt::format("must be > 0 (got {}; 0: 256 MiB)", z.queued_bytes()));
  }
  if (!z.pool().empty() && c.pools_size() > 0 &&
      std::none_of(c.pools().begin(), c.pools().end(),
                   [&](const v1::PoolSpec& p) { return p.name() == z.pool(); })) {
    bad("zmq_events.pool", fmt::format("no pool named '{}'", z.pool()));
  } else if (!z.pool().empty() && c.pools_size() == 0 && z.pool() != "default") {
    bad("zmq_events.pool", fmt::format("no pool named '{}' (the one pool is 'default')", z.pool()));
  }
}

// The geometry of the model `m` names (NOT_FOUND without one; a checkpoint that does not read is
// reported when it is loaded).
absl::StatusOr<model::ModelConfig> ModelGeometry(const v1::ModelSpec& m) {
  if (!m.checkpoint().empty() && m.checkpoint()[0] == '/') {
    return model::ReadCheckpointConfig(m.checkpoint());
  }
  if (m.checkpoint().empty() && m.name() != "none") return model::NamedConfig(m.name());
  return absl::NotFoundError("no model");
}

// shape.checkpoint_slots unset: each pool sizes its own (CheckpointSlotsByShare).
constexpr int32_t kCheckpointsByShare = -1;

// The state group of the pool shape (docs/hybrid-groups.md §2): shape.state_slots working slots
// of the model's state, rounded up to 64 bytes; none for a model without state-space layers; and
// the checkpoints' interval and order. Returns the checkpoint slots each pool adds to its working
// ones: shape.checkpoint_slots, 0 for none, or kCheckpointsByShare. (A checkpoint that does not
// read is reported when it is loaded.)
int32_t ParseStateGroup(const v1::DaemonConfig& c, kernels::PoolLayout* shape, EngineOptions* o,
                        const Bad& bad) {
  const int32_t slots = c.shape().state_slots();
  if (slots < 0) {
    bad("shape.state_slots", fmt::format("must be >= 0 (got {})", slots));
    return 0;
  }
  const int32_t checkpoints = c.shape().checkpoint_slots();
  if (checkpoints < -1) {
    bad("shape.checkpoint_slots",
        fmt::format("must be >= 0, or -1 for none (got {})", checkpoints));
    return 0;
  }
  const int32_t interval = c.shape().checkpoint_interval();
  if (interval < -1) {
    bad("shape.checkpoint_interval",
        fmt::format("must be >= 0 blocks, or -1 for none (got {})", interval));
    return 0;
  }
  const std::string& eviction = c.shape().checkpoint_eviction();
  const std::optional<KvCacheOptions::CheckpointEviction> order =
      eviction.empty() ? KvCacheOptions{}.checkpoint_eviction : ParseCheckpointEviction(eviction);
  if (!order) {
    bad("shape.checkpoint_eviction",
        fmt::format("must be \"expected_tokens_saved\", \"tokens_saved\" or \"lru\" (got \"{}\")",
                    eviction));
    return 0;
  }
  const absl::StatusOr<model::ModelConfig> geometry = ModelGeometry(c.model());
  const int64_t state_bytes = geometry.ok() ? geometry->state_bytes() : 0;
  if (state_bytes == 0) {
    if (!eviction.empty()) {
      bad("shape.checkpoint_eviction", "the model has no state-space layers (empty: unset)");
    }
    if (slots > 0) bad("shape.state_slots", "the model has no state-space layers (0: none)");
    if (checkpoints > 0) {
      bad("shape.checkpoint_slots", "the model has no state-space layers (0: none)");
    }
    if (interval != 0) {
      bad("shape.checkpoint_interval", "the model has no state-space layers (0: unset)");
    }
    return 0;
  }
  if (slots == 0) {
    bad("shape.state_slots", "a model with state-space layers needs >= 1");
    return 0;
  }
  o->checkpoint_interval = interval;
  o->checkpoint_eviction = *order;
  shape->num_state_slots = slots;
  shape->state_slot_bytes = (state_bytes + 63) / 64 * 64;
  if (c.disable_prefix_cache() || checkpoints == -1) return 0;
  return checkpoints == 0 ? kCheckpointsByShare : checkpoints;
}

// shape.checkpoint_slots unset: a quarter of a pool's `bytes` left after its working states and
// its window group, and at least one. Cached checkpoints then take a third of the bytes of the K/V
// they resume at the default interval, three times the break-even one (docs/hybrid-groups.md §4),
// and the host tier keeps them in that proportion too (HostCheckpoints). `pool` holds the working
// slots.
int64_t CheckpointSlotsByShare(const kernels::PoolLayout& pool, int64_t bytes) {
  const int64_t slot = pool.state_slot_bytes;
  int64_t rest = bytes;
  rest -= pool.num_state_slots <= rest / slot ? pool.num_state_slots * slot : rest;
  if (pool.num_window_layers > 0 && pool.num_window_blocks > 0) {
    const int64_t window = pool.window_block_bytes();
    rest -= pool.num_window_blocks <= rest / window ? pool.num_window_blocks * window : rest;
  }
  return std::clamp<int64_t>(rest / 4 / slot, 1, std::numeric_limits<int32_t>::max());
}

// The window group of the pool shape (docs/hybrid-groups.md §2-§3): the model's sliding layers in
// a region of shape.window_blocks blocks (0: sized per pool by AddPool), unless -1 or every
// attention layer slides (the main blocks keep at least one layer).
void ParseWindowGroup(const v1::DaemonConfig& c, kernels::PoolLayout* shape, EngineOptions* o,
                      const Bad& bad) {
  const int32_t blocks = c.shape().window_blocks();
  if (blocks < -1) {
    return bad("shape.window_blocks", fmt::format("must be >= 0, or -1 for none (got {})", blocks));
  }
  const absl::StatusOr<model::ModelConfig> geometry = ModelGeometry(c.model());
  const int32_t sliding = geometry.ok() ? geometry->num_sliding_layers() : 0;
  if (sliding == 0) {
    if (blocks > 0) bad("shape.window_blocks", "the model has no sliding-window layers (0: none)");
    return;
  }
  if (blocks == -1 || sliding >= shape->num_layers) return;
  shape->num_window_layers = sliding;
  shape->num_window_blocks = blocks;
  o->window_tokens = geometry->sliding_window;
  o->sink_tokens = geometry->sink_tokens;
}

// A pool of `bytes` of `shape` (null: the shape is bad, reported already) into `o`, with
// `checkpoints` slots for state checkpoints beside the shape's working ones (ParseStateGroup).
void AddPool(std::string_view field, std::string name, int64_t bytes,
             const kernels::PoolLayout* shape, int32_t checkpoints, EngineOptions* o,
             const Bad& bad) {
  if (bytes <= 0) return bad(field, fmt::format("must be > 0 (got {})", bytes));
  if (shape == nullptr) return;
  kernels::PoolLayout pool = *shape;
  if (pool.num_window_layers > 0 && pool.num_window_blocks == 0) {
    // A quarter of the pool's bytes, and at least one sequence's window.
    const int64_t bs = pool.block_size;
    const int64_t bound = (o->window_tokens + 2 * bs - 1) / bs + (o->sink_tokens + bs - 1) / bs;
    pool.num_window_blocks = static_cast<int32_t>(std::clamp<int64_t>(
        bytes / 4 / pool.window_block_bytes(), bound, std::numeric_limits<int32_t>::max()));
  }
  const int64_t checkpoint_slots =
      checkpoints == kCheckpointsByShare ? CheckpointSlotsByShare(pool, bytes) : checkpoints;
  if (pool.num_state_slots + checkpoint_slots > std::numeric_limits<int32_t>::max()) {
    return bad("shape.checkpoint_slots", "state_slots + checkpoint_slots overflow");
  }
  pool.num_state_slots += static_cast<int32_t>(checkpoint_slots);
  absl::StatusOr<kernels::PoolLayout> sized = kernels::LayoutForBudget(pool, bytes);
  if (!sized.ok()) return bad(field, std::string(sized.status().message()));
  o->pools.push_back({.name = std::move(name),
                      .layout = *sized,
                      .checkpoint_slots = static_cast<int32_t>(checkpoint_slots)});
}

// The tenants (docs/trust-model.md) into `o`; `pools`: the names of the pools, in order.
void ParseTenants(const v1::DaemonConfig& c, const std::vector<std::string>& pools,
                  EngineOptions* o, const Bad& bad) {
  absl::flat_hash_set<std::string> tenants;
  for (int i = 0; i < c.tenants_size(); ++i) {
    const v1::TenantSpec& t = c.tenants(i);
    const std::string field = fmt::format("tenants[{}]", i);
    if (!PrintableName(t.name())) bad(field + ".name", "must be printable, 1 to 128 bytes");
    if (!tenants.insert(t.name()).second) bad(field + ".name", fmt::format("'{}' twice", t.name()));
    if (t.uids().empty() && t.gids().empty())
      bad(field, "grants no uid or gid: nobody can claim it");
    if (t.quota_blocks() < 0) bad(field + ".quota_blocks", "must be >= 0 (0: unlimited)");
    if (t.has_max_priority() && (t.max_priority() < 0 || t.max_priority() >= kNumPriorities)) {
      bad(field + ".max_priority", fmt::format("must be in [0, {}]", kNumPriorities - 1));
    }
    if (t.max_sessions() < 0) bad(field + ".max_sessions", "must be >= 0 (0: unlimited)");
    if (t.cache_weight() > PrefixCache::kMaxShareWeight) {
      bad(field + ".cache_weight", fmt::format("must be in [1, {}] (0: 1), got {}",
                                               PrefixCache::kMaxShareWeight, t.cache_weight()));
    }
    const auto pool =
        t.pool().empty() ? pools.begin() : std::find(pools.begin(), pools.end(), t.pool());
    if (pool == pools.end()) bad(field + ".pool", fmt::format("no pool '{}'", t.pool()));
    o->tenants[t.name()] = {
        .kv_access = t.kv_access(),
        .quota_blocks = t.quota_blocks(),
        .max_priority = t.has_max_priority() ? t.max_priority() : kNumPriorities - 1,
        .max_sessions = t.max_sessions(),
        .pool = static_cast<int32_t>(pool - pools.begin()),
        .cache_weight = std::max<uint32_t>(t.cache_weight(), 1)};
  }
  if (!c.tenants().empty() && !c.tenant_quota_blocks().empty()) {
    bad("tenant_quota_blocks",
        "is for the zero-configuration mode: with tenants, use their "
        "quota_blocks");
  }
  for (const auto& [tenant, quota] : c.tenant_quota_blocks()) {
    if (quota < 0) bad(fmt::format("tenant_quota_blocks[{}]", tenant), "must be >= 0");
    o->open_quota_blocks[tenant] = quota;
  }
}

// The pools (pools, or one "default" of pool_bytes) and the tenants into `o`; `shape` null when
// it is bad; `checkpoints` as AddPool takes it.
void ParsePoolsAndTenants(const v1::DaemonConfig& c, const kernels::PoolLayout* shape,
                          int32_t checkpoints, EngineOptions* o, const Bad& bad) {
  std::vector<std::string> names;
  if (c.pools().empty()) {
    names.push_back("default");
    AddPool("pool_bytes", "default", c.pool_bytes(), shape, checkpoints, o, bad);
  } else if (c.pool_bytes() <= 0) {  // unused with pools, and still not a size
    bad("pool_bytes", fmt::format("must be > 0 (got {})", c.pool_bytes()));
  }
  for (int i = 0; i < c.pools_size(); ++i) {
    const v1::PoolSpec& p = c.pools(i);
    const std::string field = fmt::format("pools[{}]", i);
    if (!PrintableName(p.name())) bad(field + ".name", "must be printable, 1 to 128 bytes");
    if (std::find(names.begin(), names.end(), p.name()) != names.end()) {
      bad(field + ".name", fmt::format("'{}' twice", p.name()));
    }
    names.push_back(p.name());
    AddPool(field + ".pool_bytes", p.name(), p.pool_bytes(), shape, checkpoints, o, bad);
  }
  ParseTenants(c, names, o, bad);
}

// The disk tier into `o`; `model` names what the stored bytes mean (a tier written for another
// model starts empty).
void ParseDiskTier(const v1::DiskTierSpec& d, const v1::ModelSpec& model, tier::DiskTierOptions* o,
                   const Bad& bad) {
  if (d.directory().empty()) return;
  if (d.directory()[0] != '/') {
    bad("tiers.disk.directory", fmt::format("must be an absolute path (got '{}')", d.directory()));
  }
  if (d.capacity_bytes() <= 0) bad("tiers.disk.capacity_bytes", "must be > 0");
  o->fsync = Choose("tiers.disk.fsync", d.fsync(), kFsyncNames, bad).value_or(o->fsync);
  const std::pair<const char*, int64_t> non_negative[] = {
      {"tiers.disk.fsync_interval_ms", d.fsync_interval_ms()},
      {"tiers.disk.write_queue_blocks", d.write_queue_blocks()},
      {"tiers.disk.write_queue_bytes", d.write_queue_bytes()}};
  for (const auto& [field, value] : non_negative) {
    if (value < 0) bad(field, "must be >= 0 (0: the default)");
  }
  o->directory = d.directory();
  o->capacity_bytes = d.capacity_bytes();
  if (d.fsync_interval_ms() > 0) o->fsync_interval = absl::Milliseconds(d.fsync_interval_ms());
  if (d.write_queue_blocks() > 0) o->write_queue_blocks = d.write_queue_blocks();
  if (d.write_queue_bytes() > 0) o->write_queue_bytes = d.write_queue_bytes();
  o->direct_io = !d.disable_direct_io();
  const std::string identity =
      fmt::format("name {} seed {} checkpoint {}", model.name(), model.seed(), model.checkpoint());
  o->content_fingerprint = tier::ContentFingerprint(identity);
}

// A pool's name as the name of its disk tier directory: letters, digits, '.', '_', '-'.
bool PathSafeName(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

// What a disk tier needs of the rest of the config.
void ValidateDiskTierNeeds(const v1::DaemonConfig& c, const Bad& bad) {
  if (c.tiers().disk().directory().empty()) return;
  // A random secret would make every record useless after a restart (namespace ids and the
  // records' MACs derive from it), and the secret itself is never written to the tier.
  if (c.secret_file().empty()) {
    bad("tiers.disk", "needs secret_file: its records are sealed under the deployment secret");
  }
  for (int i = 0; i < c.pools_size(); ++i) {
    if (!PathSafeName(c.pools(i).name())) {
      bad(fmt::format("pools[{}].name", i),
          "must be letters, digits, '.', '_' and '-' with a disk tier (it names a directory)");
    }
  }
}

// The Redis tier into `o` (absent fields take their defaults).
void ParseRedisTier(const v1::RedisTierSpec& r, tier::RedisTierOptions* o, const Bad& bad) {
  if (!r.enabled()) return;
  const int where = (r.unix_socket().empty() ? 0 : 1) + (r.host().empty() ? 0 : 1) +
                    (r.cluster_seeds().empty() ? 0 : 1);
  if (where != 1) {
    bad("tiers.redis", "name exactly one of unix_socket, host or cluster_seeds");
  }
  if (r.port() < 0 || r.port() > 65535) bad("tiers.redis.port", "must be in [0, 65535]");
  if (!r.password().empty() && !r.password_file().empty()) {
    bad("tiers.redis", "set password or password_file, not both (password_file is preferred)");
  }
  o->key_slotting = Choose("tiers.redis.key_slotting", r.key_slotting(), kKeySlottingNames, bad)
                        .value_or(o->key_slotting);
  const std::pair<const char*, int64_t> non_negative[] = {
      {"tiers.redis.connect_timeout_ms", r.connect_timeout_ms()},
      {"tiers.redis.command_timeout_ms", r.command_timeout_ms()},
      {"tiers.redis.write_queue_blocks", r.write_queue_blocks()},
      {"tiers.redis.write_queue_bytes", r.write_queue_bytes()},
      {"tiers.redis.ttl_seconds", r.ttl_seconds()},
      {"tiers.redis.breaker_failure_threshold", r.breaker_failure_threshold()},
      {"tiers.redis.breaker_backoff_ms", r.breaker_backoff_ms()},
      {"tiers.redis.tenant_write_budget_bytes", r.tenant_write_budget_bytes()}};
  for (const auto& [field, value] : non_negative) {
    if (value < 0) bad(field, "must be >= 0 (0: the default)");
  }
  if (r.tenant_write_budget_bytes() > 0 && r.ttl_seconds() == 0) {
    bad("tiers.redis.tenant_write_budget_bytes",
        "needs tiers.redis.ttl_seconds > 0: the budget counts the bytes written within one TTL");
  }
  o->enabled = true;
  o->unix_socket = r.unix_socket();
  o->host = r.host();
  if (r.port() > 0) o->port = r.port();
  o->cluster_seeds.assign(r.cluster_seeds().begin(), r.cluster_seeds().end());
  o->username = r.username();
  o->password = r.password();
  if (r.connect_timeout_ms() > 0) o->connect_timeout = absl::Milliseconds(r.connect_timeout_ms());
  if (r.command_timeout_ms() > 0) o->command_timeout = absl::Milliseconds(r.command_timeout_ms());
  if (r.write_queue_blocks() > 0) o->write_queue_blocks = r.write_queue_blocks();
  if (r.write_queue_bytes() > 0) o->write_queue_bytes = r.write_queue_bytes();
  o->ttl_seconds = r.ttl_seconds();
  o->tenant_write_budget_bytes = r.tenant_write_budget_bytes();
  if (r.breaker_failure_threshold() > 0) {
    o->breaker_failure_threshold = r.breaker_failure_threshold();
  }
  if (r.breaker_backoff_ms() > 0) o->breaker_backoff = absl::Milliseconds(r.breaker_backoff_ms());
}

// The tiers into `o`.
void ParseTiers(const v1::TierSpec& t, const v1::ModelSpec& model, TierOptions* o, const Bad& bad) {
  if (t.host_blocks() < 0) bad("tiers.host_blocks", "must be >= 0 (0: no host tier)");
  if (t.staged_blocks() < 0) bad("tiers.staged_blocks", "must be >= 0 (0: the default)");
  if (t.lookup_blocks() < 0) bad("tiers.lookup_blocks", "must be >= 0 (0: the default)");
  if (t.host_checkpoints() < -1) {
    bad("tiers.host_checkpoints", "must be >= 0 (0: one per checkpoint interval), or -1 for none");
  }
  o->host_checkpoints = t.host_checkpoints();
  if (t.host_window_blocks() < -1) {
    bad("tiers.host_window_blocks",
        "must be >= 0 (0: as many per host block as the pool has window blocks per block), or -1 "
        "for none");
  }
  o->host_window_blocks = t.host_window_blocks();
  o->host_blocks = t.host_blocks();
  if (t.staged_blocks() > 0) o->staged_blocks = t.staged_blocks();
  if (t.lookup_blocks() > 0) o->lookup_blocks = t.lookup_blocks();
  ParseDiskTier(t.disk(), model, &o->disk, bad);
  ParseRedisTier(t.redis(), &o->redis, bad);
}

// The Redis password in `path` (tiers.redis.password_file), without one trailing newline.
// Errors: INVALID_ARGUMENT, one line naming the field, the file and what is wrong with it.
absl::StatusOr<std::string> ReadRedisPassword(const std::string& path) {
  absl::StatusOr<std::string> bytes =
      tier::ReadPrivateFile(path, "password file", 1, 4096, /*how_to_make=*/"");
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiers.redis.password_file: ", bytes.status().message()));
  }
  std::string password = *std::move(bytes);
  if (password.ends_with('\n')) password.pop_back();
  if (password.ends_with('\r')) password.pop_back();
  if (password.empty() || password.find_first_of("\r\n") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("tiers.redis.password_file: password file ",
                                                   path, " must hold one non-empty line"));
  }
  return password;
}

// The top-level fields of the pool and its bookkeeping into `o`.
void ParsePoolOptions(const v1::DaemonConfig& c, EngineOptions* o, const Bad& bad) {
  if (c.max_blocks_per_seq() <= 0) bad("max_blocks_per_seq", "must be > 0");
  if (absl::StatusOr<kernels::FillPolicy> fill = kernels::ParseFillPolicy(c.fill_policy());
      fill.ok()) {
    o->fill_policy = *fill;
  } else {
    bad("fill_policy", std::string(fill.status().message()));
  }
  if (c.trace_depth() < 0 || (c.trace_depth() & (c.trace_depth() - 1)) != 0) {
    bad("trace_depth", fmt::format("must be 0 or a power of 2 (got {})", c.trace_depth()));
  }
  if (absl::StatusOr<EvictionOptions> spec = ParseEvictionSpec(c.eviction_policy()); !spec.ok()) {
    bad("eviction_policy",
        fmt::format("{} (a policy, lru or reuse, then any of +admit and +notail; or default, {})",
                    std::string(spec.status().message()), kDefaultEvictionSpec));
  }
  if (c.event_capacity() <= 0) bad("event_capacity", "must be > 0");
  if (c.event_capacity_bytes() <= 0) {
    bad("event_capacity_bytes", fmt::format("must be > 0 (got {})", c.event_capacity_bytes()));
  }
  if (c.session_quota_blocks() < 0) bad("session_quota_blocks", "must be >= 0 (0: unlimited)");
  o->max_blocks_per_seq = c.max_blocks_per_seq();
  o->trace_depth = c.trace_depth();
  o->prefix_cache = !c.disable_prefix_cache();
  o->eviction_policy = c.eviction_policy();
  o->event_capacity = static_cast<size_t>(std::max<int64_t>(c.event_capacity(), 0));
  o->event_capacity_bytes = static_cast<size_t>(std::max<int64_t>(c.event_capacity_bytes(), 0));
  o->session_quota_blocks = c.session_quota_blocks();
  o->max_tenant_labels = static_cast<size_t>(
      c.metrics().max_tenants() > 0 ? c.metrics().max_tenants() : kDefaultMaxTenants);
  o->block_residency_sample = c.metrics().block_residency_sample();
}

// The process's own fields: nothing of them reaches the engine.
void CheckProcessFields(const v1::DaemonConfig& c, const Bad& bad) {
  if (!c.runtime_dir().empty() && c.runtime_dir()[0] != '/') {
    bad("runtime_dir", fmt::format("must be an absolute path (got '{}')", c.runtime_dir()));
  }
  if (absl::StatusOr<kernels::BackendKind> b = kernels::ParseBackend(c.backend()); !b.ok()) {
    bad("backend", std::string(b.status().message()));
  }
  if (c.device_ordinal() < 0) bad("device_ordinal", "must be >= 0");
  if (c.cpu_threads() < 0) bad("cpu_threads", "must be >= 0 (0: all cores)");
  static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  if (std::find(std::begin(kLevels), std::end(kLevels), c.log_level()) == std::end(kLevels)) {
    bad("log_level",
        fmt::format("'{}' is not one of trace, debug, info, warn, error, critical, off",
                    c.log_level()));
  }
  if (c.drain_timeout_ms() < 0) bad("drain_timeout_ms", "must be >= 0");
  if (c.socket_mode() > 0777)
    bad("socket_mode", fmt::format("{:o} is not a permission mode", c.socket_mode()));
  if (c.watchdog_ms() < 0) bad("watchdog_ms", "must be >= 0");
  if (c.runtime_dir_mode() > 0777 || (c.runtime_dir_mode() & 0700) != 0700 ||
      (c.runtime_dir_mode() & 0022) != 0) {
    bad("runtime_dir_mode",
        fmt::format("{:o} must give the owner rwx and no one else write permission",
                    c.runtime_dir_mode()));
  }
}

// The one pass over a config: each field checked once and, where it reaches the engine,
// converted once into *o. One line per problem; *o is usable only when there is none.
std::vector<std::string> Parse(const v1::DaemonConfig& c, EngineOptions* o) {
  std::vector<std::string> errors;
  auto bad = [&](std::string_view field, std::string why) {
    errors.push_back(fmt::format("{}: {}", field, why));
  };
  CheckProcessFields(c, bad);
  bool dtypes_ok = true;
  kernels::PoolLayout shape = ShapeLayout(c.shape(), bad, &dtypes_ok);
  const int32_t checkpoints = ParseStateGroup(c, &shape, o, bad);
  ParseWindowGroup(c, &shape, o, bad);
  const absl::Status shape_ok = kernels::ValidateLayout(shape);
  if (!shape_ok.ok()) bad("shape", std::string(shape_ok.message()));
  ParsePoolsAndTenants(c, shape_ok.ok() && dtypes_ok ? &shape : nullptr, checkpoints, o, bad);
  ParsePoolOptions(c, o, bad);
  ParseTiers(c.tiers(), c.model(), &o->tiers, bad);
  ValidateDiskTierNeeds(c, bad);
  if (o->tiers.disk.enabled()) o->invalidations_file = o->tiers.disk.directory + "/invalidations";
  ParseModel(c, shape_ok.ok(), o, bad);
  ParseLimits(c, o, bad);
  for (std::string& problem : ValidateMetricsSpec(c.metrics())) errors.push_back(problem);
  ValidateZmqEvents(c, bad);
  return errors;
}

}  // namespace

std::vector<std::string> ValidateConfig(const v1::DaemonConfig& c) {
  EngineOptions scratch;
  return Parse(c, &scratch);
}

absl::StatusOr<v1::DaemonConfig> LoadConfig(const std::string& path) {
  v1::DaemonConfig config;
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) return absl::NotFoundError(fmt::format("cannot read config {}", path));
    std::stringstream text;
    text << in.rdbuf();
    google::protobuf::TextFormat::Parser parser;
    ErrorLines errors(path);
    parser.RecordErrorsTo(&errors);
    if (!parser.ParseFromString(text.str(), &config)) {
      return absl::InvalidArgumentError(Join(errors.lines()));
    }
  }
  ApplyDefaults(&config);
  std::vector<std::string> problems = ValidateConfig(config);
  if (!problems.empty()) {
    for (std::string& p : problems) p = (path.empty() ? "config" : path) + ": " + p;
    return absl::InvalidArgumentError(Join(problems));
  }
  return config;
}

absl::StatusOr<EngineOptions> MakeEngineOptions(const v1::DaemonConfig& c, uint64_t epoch) {
  EngineOptions o;
  if (std::vector<std::string> problems = Parse(c, &o); !problems.empty()) {
    return absl::InvalidArgumentError(Join(problems));
  }
  // The files the config names, read once it is known to be good.
  if (o.tiers.redis.enabled && !c.tiers().redis().password_file().empty()) {
    KVPOOL_ASSIGN_OR_RETURN(o.tiers.redis.password,
                            ReadRedisPassword(c.tiers().redis().password_file()));
  }
  if (!c.secret_file().empty()) {
    absl::StatusOr<tier::DeploymentSecret> secret =
        tier::DeploymentSecret::FromFile(c.secret_file());
    if (!secret.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("secret_file: ", secret.status().message()));
    }
    o.secret = *std::move(secret);
  }
  o.epoch = epoch;
  return o;
}

}  // namespace kvpool::daemon
