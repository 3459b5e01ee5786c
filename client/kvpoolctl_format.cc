#include "client/kvpoolctl_format.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "client/internal/table.h"
#include "fmt/format.h"
#include "google/protobuf/descriptor.h"
#include "nlohmann/json.hpp"

namespace kvpool::client::ctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using nlohmann::json;

std::string Hex(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) out += fmt::format("{:02x}", c);
  return out;
}

std::string HashText(const v1::BlockHash& hash) {
  return fmt::format("{:016x}{:016x}", hash.hi(), hash.lo());
}

json MessageJson(const Message& message);

json FieldJson(const Message& m, const Reflection& r, const FieldDescriptor* f, int i) {
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r.GetRepeatedInt32(m, f, i) : r.GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r.GetRepeatedInt64(m, f, i) : r.GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r.GetRepeatedUInt32(m, f, i) : r.GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r.GetRepeatedUInt64(m, f, i) : r.GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r.GetRepeatedDouble(m, f, i) : r.GetDouble(m, f);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r.GetRepeatedFloat(m, f, i) : r.GetFloat(m, f);
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r.GetRepeatedBool(m, f, i) : r.GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r.GetRepeatedEnum(m, f, i) : r.GetEnum(m, f))->name();
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string value = rep ? r.GetRepeatedString(m, f, i) : r.GetString(m, f);
      return f->type() == FieldDescriptor::TYPE_BYTES ? json(Hex(value)) : json(value);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      if (!rep && !r.HasField(m, f)) return nullptr;
      return MessageJson(rep ? r.GetRepeatedMessage(m, f, i) : r.GetMessage(m, f));
  }
  return nullptr;
}

json MessageJson(const Message& message) {
  if (message.GetDescriptor() == v1::BlockHash::descriptor()) {
    v1::BlockHash hash;
    hash.CopyFrom(message);
    return HashText(hash);
  }
  json out = json::object();
  const Reflection& r = *message.GetReflection();
  const google::protobuf::Descriptor& d = *message.GetDescriptor();
  for (int k = 0; k < d.field_count(); ++k) {
    const FieldDescriptor* f = d.field(k);
    if (f->is_repeated()) {
      json items = json::array();
      for (int i = 0; i < r.FieldSize(message, f); ++i)
        items.push_back(FieldJson(message, r, f, i));
      out[f->name()] = std::move(items);
    } else {
      out[f->name()] = FieldJson(message, r, f, -1);
    }
  }
  return out;
}

std::string Pretty(const Message& message) { return MessageJson(message).dump(2) + "\n"; }

std::string Bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", value, units[unit]);
}

std::string Percent(int64_t part, int64_t whole) {
  return whole <= 0 ? "-" : fmt::format("{:.1f}", 100.0 * static_cast<double>(part) / whole);
}

std::string Seconds(double seconds) {
  return absl::FormatDuration(absl::Trunc(absl::Seconds(seconds), absl::Seconds(1)));
}

std::string DTypeText(v1::DType d) {
  switch (d) {
    case v1::DTYPE_F32:
      return "f32";
    case v1::DTYPE_F16:
      return "f16";
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_FP8_E4M3:
      return "fp8";
    case v1::DTYPE_INT8:
      return "int8";
    case v1::DTYPE_UNSPECIFIED:
    case v1::DType_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::DType_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return v1::DType_Name(d);
}

std::string LayoutLine(const v1::PoolLayout& l) {
  std::string out = fmt::format(
      "{} tokens/block, {} layers, {} kv heads x {}, {}; {}/block, {} blocks ({})", l.block_size(),
      l.num_layers(), l.num_kv_heads(), l.head_dim(),
      l.chunk_bytes() > 0 ? DTypeText(l.dtype()) : "mixed dtypes", Bytes(l.block_bytes()),
      l.num_blocks(), Bytes(int64_t{l.num_blocks()} * l.block_bytes()));
  if (l.num_window_layers() > 0) {
    out += fmt::format("; window group: layers {}-{}, {}/block, {} blocks ({})",
                       l.num_layers() - l.num_window_layers(), l.num_layers() - 1,
                       Bytes(l.window_block_bytes()), l.num_window_blocks(),
                       Bytes(int64_t{l.num_window_blocks()} * l.window_block_bytes()));
  }
  return out;
}

// Bytes a token takes in each layer (K and V, the 8-bit scales shared out over the block's
// tokens), consecutive layers of equal dtypes on one row, then the whole model's.
std::string LayerBytesTable(const v1::PoolLayout& l) {
  internal::Table table({"LAYERS", "K", "V", "BYTES/TOKEN/LAYER"});
  double total = 0;
  for (int begin = 0; begin < l.layers_size();) {
    const v1::LayerLayout& first = l.layers(begin);
    int end = begin + 1;
    while (end < l.layers_size() && l.layers(end).k_dtype() == first.k_dtype() &&
           l.layers(end).v_dtype() == first.v_dtype() &&
           l.layers(end).bytes_per_token() == first.bytes_per_token()) {
      ++end;
    }
    table.AddRow({end - begin == 1 ? std::to_string(begin) : fmt::format("{}-{}", begin, end - 1),
                  DTypeText(first.k_dtype()), DTypeText(first.v_dtype()),
                  fmt::format("{:.1f}", first.bytes_per_token())});
    total += first.bytes_per_token() * (end - begin);
    begin = end;
  }
  if (table.num_rows() == 0) return "";
  table.AddRow({"all", "", "", fmt::format("{:.1f}", total)});
  return table.Render() + "\n";
}

// The lower tiers: their figures are rows of the stats table (tier_*{medium=...}, printed with
// the others); here only what is not a figure: which stores there are, their breakers, why the
// disk tier started empty, and the copy rates.
std::string TiersText(const v1::GetStatsResponse& s) {
  if (!s.has_tiers()) return "";
  const v1::TierStats& t = s.tiers();
  std::string out = "\ntiers:";
  for (const v1::TierStoreStats& st : t.stores()) {
    out += " " + st.medium();
    if (!st.breaker().empty()) out += fmt::format(" (breaker {})", st.breaker());
    if (!st.started_empty().empty()) out += fmt::format(" (started empty: {})", st.started_empty());
  }
  return out + fmt::format("; demoted at {:.2f} GB/s, promoted at {:.2f} GB/s\n", t.demote_gbps(),
                           t.promote_gbps());
}

std::string TableText(const v1::SequenceInfo& info, size_t max_entries) {
  std::string out;
  const size_t n = static_cast<size_t>(std::min(info.block_ids_size(), info.generations_size()));
  for (size_t i = 0; i < n && i < max_entries; ++i) {
    if (i > 0) out += ' ';
    out += fmt::format("{}@{}", info.block_ids(static_cast<int>(i)),
                       info.generations(static_cast<int>(i)));
  }
  if (n > max_entries) out += fmt::format(" ... (+{})", n - max_entries);
  return out;
}

// A window table (SequenceInfo.window_block_ids) as TableText writes a block table, its released
// run as one "-xN" (N entries released), the first `max_entries` entries shown; "-" when the
// sequence carries none (no window group).
std::string WindowText(const v1::SequenceInfo& info, size_t max_entries) {
  const auto n =
      static_cast<size_t>(std::min(info.window_block_ids_size(), info.window_generations_size()));
  if (n == 0) return "-";
  std::string out;
  size_t shown = 0, i = 0;
  for (; i < n && shown < max_entries; ++shown) {
    if (!out.empty()) out += ' ';
    const int id = info.window_block_ids(static_cast<int>(i));
    if (id >= 0) {
      out += fmt::format("{}@{}", id, info.window_generations(static_cast<int>(i)));
      ++i;
      continue;
    }
    size_t released = 0;
    for (; i < n && info.window_block_ids(static_cast<int>(i)) < 0; ++i) ++released;
    out += fmt::format("-x{}", released);
  }
  if (i < n) out += fmt::format(" ... (+{})", n - i);
  return out;
}

// The window group's blocks by state (its window_blocks rows of the stats table), as shares of
// the group's blocks; empty without a window group.
std::string WindowBlocksText(const v1::GetStatsResponse& s) {
  if (s.layout().num_window_layers() == 0) return "";
  internal::Table table({"WINDOW BLOCKS", "COUNT", "%"});
  const int64_t total = s.layout().num_window_blocks();
  for (const char* state : {"free", "active", "cached", "retiring"}) {
    int64_t count = 0;
    for (const v1::Stat& stat : s.stats()) {
      if (stat.name() != "window_blocks") continue;
      for (const std::string& v : stat.label_values()) {
        if (v == state) count = static_cast<int64_t>(stat.value());
      }
    }
    table.AddRow({state, std::to_string(count), Percent(count, total)});
  }
  table.AddRow({"total", std::to_string(total), Percent(total, total)});
  return table.Render() + "\n";
}

// The model's name and its mean batch, or "model: none" (its counters are in the stats table).
std::string ModelText(const v1::GetStatsResponse& s) {
  if (s.model().empty()) return "model: none\n";
  const double per_step = s.model_steps() ? static_cast<double>(s.model_step_sequences()) /
                                                static_cast<double>(s.model_steps())
                                          : 0.0;
  return fmt::format("model: {}, {:.2f} sequences per step\n", s.model(), per_step);
}

// A row's name with its labels but the pool's (the whole output is of one pool):
// evictions{reason=capacity}.
std::string StatName(const v1::Stat& stat) {
  std::string labels;
  for (int i = 0; i < stat.label_names_size() && i < stat.label_values_size(); ++i) {
    if (stat.label_names(i) == "pool") continue;
    labels += fmt::format("{}{}={}", labels.empty() ? "" : ",", stat.label_names(i),
                          stat.label_values(i));
  }
  return labels.empty() ? stat.name() : fmt::format("{}{{{}}}", stat.name(), labels);
}

std::string StatValue(const v1::Stat& stat) {
  if (stat.kind() == v1::Stat::KIND_HISTOGRAM) {
    return stat.count() == 0 ? "0 observed"
                             : fmt::format("{} observed, mean {:.4g}", stat.count(),
                                           stat.sum() / static_cast<double>(stat.count()));
  }
  const double v = stat.value();
  if (v == static_cast<double>(static_cast<int64_t>(v))) {
    return std::to_string(static_cast<int64_t>(v));
  }
  return fmt::format("{:.4g}", v);
}

// The daemon's stats table as it sent it (GetStatsResponse.stats), and the hit rate.
std::string StatsTable(const v1::GetStatsResponse& s) {
  internal::Table counters({"STAT", "VALUE", "UNIT"});
  for (const v1::Stat& stat : s.stats()) {
    counters.AddRow({StatName(stat), StatValue(stat), stat.unit()});
  }
  counters.AddRow(
      {"hit_rate_%",
       Percent(static_cast<int64_t>(s.hit_tokens()), static_cast<int64_t>(s.prompt_tokens())),
       "%"});
  return counters.Render();
}

}  // namespace

absl::StatusOr<TraceFormat> ParseTraceFormat(std::string_view name) {
  if (name == "text") return TraceFormat::kText;
  if (name == "json") return TraceFormat::kJson;
  if (name == "chrome") return TraceFormat::kChrome;
  return absl::InvalidArgumentError(
      fmt::format("unknown trace format '{}' (want text, json or chrome)", name));
}

std::string ToJson(const google::protobuf::Message& message) { return MessageJson(message).dump(); }

std::string FormatStats(const v1::GetStatsResponse& s, bool json) {
  if (json) return Pretty(s);
  std::string out = fmt::format("kvpoold  device {}  epoch {}  up {}{}\n", s.device(), s.epoch(),
                                Seconds(s.uptime_seconds()), s.draining() ? "  DRAINING" : "");
  if (!s.pool().empty()) out += fmt::format("pool     {}\n", s.pool());
  if (!s.failure().empty()) out += fmt::format("NOT SERVING: {}\n", s.failure());
  out += fmt::format("layout   {}\n\n", LayoutLine(s.layout()));
  out += LayerBytesTable(s.layout());

  internal::Table blocks({"BLOCKS", "COUNT", "%"});
  const auto add = [&](const char* name, int64_t count) {
    blocks.AddRow({name, std::to_string(count), Percent(count, s.num_blocks())});
  };
  add("free", s.free_blocks());
  add("active", s.active_blocks());
  add("cached", s.cached_blocks());
  add("retiring", s.retiring_blocks());
  add("total", s.num_blocks());
  out += blocks.Render() + "\n";
  out += WindowBlocksText(s);

  out += StatsTable(s);
  out += TiersText(s);
  return out + ModelText(s);
}

namespace {

// A session's tenant quota: "used/bound" in blocks, or in bytes; "-" without one.
std::string QuotaText(const v1::SessionInfo& s) {
  if (s.quota_unit().empty()) return "-";
  if (s.quota_unit() == "bytes") {
    return fmt::format("{}/{}", Bytes(s.quota_used()), Bytes(s.quota_bound()));
  }
  return fmt::format("{}/{}", s.quota_used(), s.quota_bound());
}

// Its tenant's eviction share: cached bytes, blocks and weight; "-" with fair eviction off.
std::string ShareText(const v1::SessionInfo& s) {
  if (s.cache_share_weight() == 0) return "-";
  return fmt::format("{} ({} blocks) w{}", Bytes(s.cache_share_bytes()), s.cache_share_blocks(),
                     s.cache_share_weight());
}

}  // namespace

std::string FormatSessions(const v1::ListSessionsResponse& sessions, bool json) {
  if (json) return Pretty(sessions);
  internal::Table table({"SESSION", "CLIENT", "PID", "UID", "TENANT", "MODEL", "POOL", "ACCESS",
                         "NAMESPACE", "ADMIN", "SEQS", "REFS", "QUOTA", "CACHED", "ATTACHED"});
  for (const v1::SessionInfo& s : sessions.sessions()) {
    table.AddRow({std::to_string(s.session_id()), s.client_name(), std::to_string(s.pid()),
                  std::to_string(s.uid()), s.tenant().empty() ? "-" : s.tenant(), s.model(),
                  s.pool(), s.kv_access() ? "kv" : "compute",
                  fmt::format("{:#018x}", s.namespace_id()), s.admin() ? "yes" : "no",
                  std::to_string(s.sequences()), std::to_string(s.block_refs()), QuotaText(s),
                  ShareText(s), Seconds(s.attached_seconds())});
  }
  return table.Render() + fmt::format("{} session(s)\n", table.num_rows());
}

std::string FormatPins(const v1::ListPinsResponse& pins, bool json) {
  if (json) return Pretty(pins);
  internal::Table table(
      {"POOL", "PIN", "SESSION", "SEQUENCE", "PRIORITY", "TOKENS", "BLOCKS", "EXPIRES_IN"});
  for (const v1::PinInfo& p : pins.pins()) {
    table.AddRow({p.pool(), std::to_string(p.pin_id()), std::to_string(p.session_id()),
                  p.sequence_id() == 0 ? "-" : std::to_string(p.sequence_id()),
                  std::to_string(p.priority()), std::to_string(p.tokens()),
                  std::to_string(p.blocks()),
                  Seconds(static_cast<double>(p.expires_in_ms()) / 1e3)});
  }
  return table.Render() + fmt::format("{} pin(s)\n", table.num_rows());
}

std::string FormatSequences(const v1::ListSequencesResponse& sequences, bool json) {
  if (json) return Pretty(sequences);
  internal::Table table({"POOL", "SESSION", "SEQUENCE", "TOKENS", "BLOCKS", "TABLE (id@generation)",
                         "WINDOW (id@generation, -xN released)"});
  for (int i = 0; i < sequences.sequences_size(); ++i) {
    const v1::SequenceInfo& info = sequences.sequences(i);
    const uint64_t owner = i < sequences.session_ids_size() ? sequences.session_ids(i) : 0;
    const std::string pool = i < sequences.pools_size() ? sequences.pools(i) : "";
    table.AddRow({pool, std::to_string(owner), std::to_string(info.sequence_id()),
                  std::to_string(info.num_tokens()), std::to_string(info.block_ids_size()),
                  TableText(info, 8), WindowText(info, 8)});
  }
  return table.Render() + fmt::format("{} sequence(s)\n", table.num_rows());
}

std::string FormatTrace(const v1::DumpBlockTraceResponse& trace, TraceFormat format) {
  switch (format) {
    case TraceFormat::kJson:
      return Pretty(trace);
    case TraceFormat::kChrome:
      return ChromeTrace(trace) + "\n";
    case TraceFormat::kText:
      break;
  }
  internal::Table table(
      {"OP_SEQ", "T+US", "BLOCK", "OP", "REFS", "GEN", "SESSION", "SEQUENCE", "SITE"});
  const int64_t t0 = trace.entries().empty() ? 0 : trace.entries(0).time_ns();
  for (const v1::TraceEntry& e : trace.entries()) {
    table.AddRow({std::to_string(e.op_seq()),
                  fmt::format("{:.3f}", static_cast<double>(e.time_ns() - t0) / 1000.0),
                  std::to_string(e.block_id()), e.op(), std::to_string(e.refs_after()),
                  std::to_string(e.generation()), std::to_string(e.session_id()),
                  std::to_string(e.sequence_id()), e.site()});
  }
  return table.Render() + fmt::format("{} operation(s)\n", table.num_rows());
}

std::string FormatExplain(const v1::ExplainMatchResponse& explain, bool json) {
  if (json) return Pretty(explain);
  std::string out =
      fmt::format("matched {} token(s); stopped: {}\n", explain.matched_tokens(), explain.stop());
  // Hybrid models: what every group can resume, and how much of the match the window group cut.
  if (explain.has_resumable_tokens()) {
    out += fmt::format("resumable {} token(s)", explain.resumable_tokens());
    if (explain.has_window_evicted_tokens()) {
      out += fmt::format("; window group cut {} token(s)", explain.window_evicted_tokens());
    }
    out += '\n';
  }
  if (!explain.explanation().empty()) {
    out += explain.explanation();
    if (out.back() != '\n') out += '\n';
  }
  return out;
}

std::string FormatCheck(const v1::CheckInvariantsResponse& check, bool json) {
  if (json) return Pretty(check);
  if (check.ok()) return "invariants hold\n";
  return fmt::format("INVARIANT VIOLATED: {}\n", check.violation());
}

std::string FormatEvents(const v1::WatchEventsResponse& events, bool json) {
  if (json) return ToJson(events) + "\n";
  std::string out;
  if (events.snapshot()) {
    // Blocks by medium: the device's, then each tier's that holds any (docs/events.md).
    std::map<std::string, int64_t> blocks;
    for (const v1::KvEvent& e : events.events()) {
      blocks[e.medium().empty() ? "device" : e.medium()] += e.block_hashes_size();
    }
    std::string media = fmt::format("{} device block(s)", blocks["device"]);
    for (const auto& [medium, n] : blocks) {
      if (medium != "device") media += fmt::format(", {} {}", n, medium);
    }
    out += fmt::format("snapshot: {} event(s), {}; resume at seq {}\n", events.events_size(), media,
                       events.resume_seq());
  }
  for (const v1::KvEvent& e : events.events()) {
    const char* type = "unknown";
    switch (e.type()) {
      case v1::KvEvent::TYPE_BLOCK_STORED:
        type = "stored";
        break;
      case v1::KvEvent::TYPE_BLOCK_REMOVED:
        type = "removed";
        break;
      case v1::KvEvent::TYPE_ALL_BLOCKS_CLEARED:
        type = "cleared";
        break;
      case v1::KvEvent::TYPE_UNSPECIFIED:
      case v1::KvEvent_Type_KvEvent_Type_INT_MIN_SENTINEL_DO_NOT_USE_:
      case v1::KvEvent_Type_KvEvent_Type_INT_MAX_SENTINEL_DO_NOT_USE_:
        break;
    }
    std::string line =
        fmt::format("{:>8} {:<7} {:<6} epoch {} ns {:#018x}", e.seq(), type,
                    e.medium().empty() ? "device" : e.medium(), e.epoch(), e.namespace_id());
    if (e.has_group()) {
      line += fmt::format(" group {} {}", e.group().index(), e.group().kind());
      if (e.group().sliding_window() > 0) line += fmt::format(" W {}", e.group().sliding_window());
    }
    if (e.block_hashes_size() > 0) {
      line += fmt::format(" blocks {} [{}", e.block_hashes_size(), HashText(e.block_hashes(0)));
      if (e.block_hashes_size() > 1) line += " ...";
      line += "]";
    }
    if (e.type() == v1::KvEvent::TYPE_BLOCK_STORED) {
      line += e.has_parent_hash() ? fmt::format(" parent {}", HashText(e.parent_hash()))
                                  : std::string(" parent root");
      line += fmt::format(" tokens {} (block_size {})", e.token_ids_size(), e.block_size());
    }
    out += line + "\n";
  }
  return out;
}

std::string ChromeTrace(const v1::DumpBlockTraceResponse& trace) {
  std::vector<const v1::TraceEntry*> entries;
  entries.reserve(static_cast<size_t>(trace.entries_size()));
  for (const v1::TraceEntry& e : trace.entries()) entries.push_back(&e);
  std::stable_sort(
      entries.begin(), entries.end(),
      [](const v1::TraceEntry* a, const v1::TraceEntry* b) { return a->op_seq() < b->op_seq(); });
  const auto micros = [](int64_t ns) { return static_cast<double>(ns) / 1000.0; };

  json events = json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", 1},
                    {"args", {{"name", "kvpoold block pool"}}}});
  // Per (block, generation): the first and last time seen, for the complete events.
  std::map<std::pair<int32_t, uint32_t>, std::pair<int64_t, int64_t>> spans;
  std::map<int32_t, bool> blocks;
  for (const v1::TraceEntry* e : entries) {
    blocks[e->block_id()] = true;
    auto [it, inserted] =
        spans.try_emplace({e->block_id(), e->generation()}, e->time_ns(), e->time_ns());
    if (!inserted) {
      it->second.first = std::min(it->second.first, e->time_ns());
      it->second.second = std::max(it->second.second, e->time_ns());
    }
  }
  for (const auto& [block, unused] : blocks) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", block},
                      {"args", {{"name", fmt::format("block {}", block)}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", block},
                      {"args", {{"sort_index", block}}}});
  }
  for (const auto& [key, range] : spans) {
    events.push_back({{"name", fmt::format("generation {}", key.second)},
                      {"cat", "generation"},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", key.first},
                      {"ts", micros(range.first)},
                      {"dur", micros(range.second - range.first)},
                      {"args", {{"generation", key.second}}}});
  }
  for (const v1::TraceEntry* e : entries) {
    events.push_back({{"name", e->op()},
                      {"cat", "block"},
                      {"ph", "i"},
                      {"s", "t"},
                      {"pid", 1},
                      {"tid", e->block_id()},
                      {"ts", micros(e->time_ns())},
                      {"args",
                       {{"op_seq", e->op_seq()},
                        {"refs", e->refs_after()},
                        {"generation", e->generation()},
                        {"session", e->session_id()},
                        {"sequence", e->sequence_id()},
                        {"site", e->site()}}}});
  }
  json doc = {{"displayTimeUnit", "ns"}, {"traceEvents", std::move(events)}};
  return doc.dump();
}

}  // namespace kvpool::client::ctl
