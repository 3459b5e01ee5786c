#pragma once

// Translations between the wire (kvpool.v1 protobuf, grpc::Status) and the engine's core types.
// The only place besides the service and attach server where the daemon sees protobuf.

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/edge/attach_server.h"
#include "daemon/edge/zmq_event_publisher.h"
#include "daemon/engine/engine.h"
#include "daemon/metrics/rpc_counters.h"
#include "daemon/metrics/stream_counters.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/attach.pb.h"
#include "kvpool/v1/kvpool.pb.h"

namespace kvpool::daemon {

// The one mapping from absl::Status to grpc::Status (STYLE.md): same code and message; a
// RESOURCE_EXHAUSTED that carries a shortfall also sets the trailing metadata
// "kvpool-shortfall" = "<resource>:<blocks>" when `context` is given.
grpc::Status ToGrpcStatus(const absl::Status& status, grpc::ServerContextBase* context = nullptr);
// The "<resource>:<blocks>" value of that metadata, when `status` carries a shortfall.
std::optional<std::string> ShortfallValue(const absl::Status& status);

template <typename Field>
std::span<const int32_t> Tokens(const Field& field) {
  return {field.data(), static_cast<size_t>(field.size())};
}

void ToProto(const kernels::PoolLayout& layout, v1::PoolLayout* out);
v1::KvEvent ToProto(const KvEvent& event);
void ToProto(const BlockTraceEntry& entry, v1::TraceEntry* out);
// Every stats figure comes from the stats table (daemon/metrics/stats_table.h); `attach`,
// `rpcs`, `streams` and `zmq` (each may be null) give the attach socket's, the gRPC service's,
// the WatchEvents streams' and the ZeroMQ publisher's.
void ToProto(const EngineStats& stats, const AttachCounters* attach, const RpcCounters* rpcs,
             v1::GetStatsResponse* out, const EventStreamStats* streams = nullptr,
             const ZmqEventCounters* zmq = nullptr);
// `pool`: the session's pool's name.
void ToProto(const SessionListing& listing, int64_t now_ns, v1::SessionInfo* out);
// What an accepted attach sends back (the descriptors go beside it, in `fds` order).
void ToProto(const PoolGrant& grant, v1::AttachResponse* out);
std::string_view StopName(MatchStop stop);

// Slice i of `tables` as a SequenceInfo.
void ToProto(const Tables& tables, size_t slice, size_t first_block, v1::SequenceInfo* out);
// Every slice, in order.
void ToProto(const Tables& tables, google::protobuf::RepeatedPtrField<v1::SequenceInfo>* out);
// The changed tails of a Grow, as GrowResponse's parallel arrays.
void ToProto(const Tables& tables, v1::GrowResponse* out);

// Requests. Errors: INVALID_ARGUMENT for parallel arrays of different lengths.
std::vector<AllocateRequest> FromProto(const v1::AllocateRequest& request);
absl::StatusOr<std::vector<GrowRequest>> FromProto(const v1::GrowRequest& request);
absl::StatusOr<std::vector<model::DecodeInput>> FromProto(const v1::DecodeRequest& request);
// FromProto's check of a Decode alone, to make before anything is built per sequence.
absl::Status CheckParallelArrays(const v1::DecodeRequest& request);
// The sampling parameters as given (the engine checks their ranges); `drawn_seed` stands in for
// an absent seed.
model::SamplingParams FromProto(const v1::SamplingParams& params, uint64_t drawn_seed);

}  // namespace kvpool::daemon
