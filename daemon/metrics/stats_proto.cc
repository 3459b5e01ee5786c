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

// Adds `value` into `field` of `out` (rows naming one field add up). A row naming a field that
// does not exist, or one of a type no figure has, is a bug in the table: the table test reads
// every row, so it fails there first.
void AddToField(std::string_view field, double value, v1::GetStatsResponse* out) {
  const FieldDescriptor* f =
      v1::GetStatsResponse::descriptor()->FindFieldByName(std::string(field));
  KVPOOL_CHECK(f != nullptr && !f->is_repeated());
  const google::protobuf::Reflection& r = *out->GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      r.SetInt32(out, f, r.GetInt32(*out, f) + static_cast<int32_t>(std::llround(value)));
      return;
    case FieldDescriptor::CPPTYPE_INT64:
      r.SetInt64(out, f, r.GetInt64(*out, f) + static_cast<int64_t>(std::llround(value)));
      return;
    case FieldDescriptor::CPPTYPE_UINT64:
      r.SetUInt64(out, f, r.GetUInt64(*out, f) + static_cast<uint64_t>(std::llround(value)));
      return;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      r.SetDouble(out, f, r.GetDouble(*out, f) + value);
      return;
    case FieldDescriptor::CPPTYPE_BOOL:
      r.SetBool(out, f, r.GetBool(*out, f) || value != 0);
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
    if (!s.proto_field.empty()) AddToField(s.proto_field, s.value * s.proto_scale, out);
  });
}

}  // namespace kvpool::daemon
