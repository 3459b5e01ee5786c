#include "daemon/metrics/stats_proto.h"

#include <cmath>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "kvpool/util/check.h"

namespace kvpool::daemon {
namespace {

using google::protobuf::FieldDescriptor;

v1::Stat::Kind KindOf(StatKind kind) {
  switch (kind) {
    case StatKind::kCounter:
      return v1::Stat::KIND_COUNTER;
    case StatKind::kGauge:
      return v1::Stat::KIND_GAUGE;
    case StatKind::kHistogram:
      return v1::Stat::KIND_HISTOGRAM;
  }
  return v1::Stat::KIND_UNSPECIFIED;
}

using google::protobuf::Message;

// The element of the repeated message field `f` of `m` whose field `key.name` holds `key.value`;
// appended (with that key set) when none does.
Message* Keyed(Message* m, const FieldDescriptor* f, const StatLabel& key) {
  const google::protobuf::Reflection& r = *m->GetReflection();
  const FieldDescriptor* k = f->message_type()->FindFieldByName(std::string(key.name));
  KVPOOL_CHECK_MSG(k != nullptr && k->cpp_type() == FieldDescriptor::CPPTYPE_STRING,
                   "a stats row's path runs through a repeated field its label does not key");
  for (int i = 0; i < r.FieldSize(*m, f); ++i) {
    Message* element = r.MutableRepeatedMessage(m, f, i);
    if (element->GetReflection()->GetString(*element, k) == key.value) return element;
  }
  Message* element = r.AddMessage(m, f);
  element->GetReflection()->SetString(element, k, std::string(key.value));
  return element;
}

// Adds `value` into the field at `path` below `out` (rows naming one field add up). A path
// through a repeated message field picks its element by the row's label (`key`). A row naming a
// field that does not exist, or one of a type no figure has, is a bug in the table: the table
// test reads every row, so it fails there first.
void AddToField(std::string_view path, const StatLabel& key, double value, Message* out) {
  Message* m = out;
  for (size_t dot = path.find('.'); dot != std::string_view::npos; dot = path.find('.')) {
    const FieldDescriptor* f =
        m->GetDescriptor()->FindFieldByName(std::string(path.substr(0, dot)));
    KVPOOL_CHECK(f != nullptr && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE);
    m = f->is_repeated() ? Keyed(m, f, key) : m->GetReflection()->MutableMessage(m, f);
    path.remove_prefix(dot + 1);
  }
  const FieldDescriptor* f = m->GetDescriptor()->FindFieldByName(std::string(path));
  KVPOOL_CHECK(f != nullptr && !f->is_repeated());
  const google::protobuf::Reflection& r = *m->GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      r.SetInt32(m, f, r.GetInt32(*m, f) + static_cast<int32_t>(std::llround(value)));
      return;
    case FieldDescriptor::CPPTYPE_INT64:
      r.SetInt64(m, f, r.GetInt64(*m, f) + static_cast<int64_t>(std::llround(value)));
      return;
    case FieldDescriptor::CPPTYPE_UINT64:
      r.SetUInt64(m, f, r.GetUInt64(*m, f) + static_cast<uint64_t>(std::llround(value)));
      return;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      r.SetDouble(m, f, r.GetDouble(*m, f) + value);
      return;
    case FieldDescriptor::CPPTYPE_BOOL:
      r.SetBool(m, f, r.GetBool(*m, f) || value != 0);
      return;
    default:
      KVPOOL_CHECK_MSG(false, "a stats row names a field of a type no figure has");
  }
}

void ToProto(const StatSample& s, v1::Stat* out) {
  out->set_name(std::string(s.name));
  out->set_kind(KindOf(s.kind));
  out->set_unit(std::string(s.unit));
  out->set_help(std::string(s.help));
  for (const auto& [name, value] : s.labels) {
    out->add_label_names(std::string(name));
    out->add_label_values(std::string(value));
  }
  if (s.histogram == nullptr) {
    out->set_value(s.value);
    return;
  }
  for (double bound : s.histogram->bounds()) out->add_bucket_bounds(bound);
  for (uint64_t count : s.histogram->counts()) out->add_bucket_counts(count);
  out->set_sum(s.histogram->sum());
  out->set_count(s.histogram->count());
}

}  // namespace

void FillStats(const StatsSource& source, v1::GetStatsResponse* out) {
  ForEachStat(source, /*daemon_rows=*/true, [&](const StatSample& s) {
    ToProto(s, out->add_stats());
    if (!s.proto_field.empty()) AddToField(s.proto_field, s.label, s.value * s.proto_scale, out);
  });
}

}  // namespace kvpool::daemon
