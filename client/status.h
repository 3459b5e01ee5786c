#pragma once

// Conversion of gRPC call results into absl::Status, and the RESOURCE_EXHAUSTED shortfall the
// daemon attaches to them (kvpool.proto: trailing metadata "kvpool-shortfall" =
// "<resource>:<blocks>").
//
// Free functions; thread-safe.

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "grpcpp/support/string_ref.h"

namespace kvpool::client {

// The absl::Status payload URL under which FromGrpcStatus keeps the shortfall metadata verbatim.
inline constexpr char kShortfallPayloadUrl[] = "type.kvpool.dev/kvpool.v1.Shortfall";

// The same code and message as `status` (grpc and absl share the canonical codes; a code outside
// them becomes UNKNOWN). When the code is RESOURCE_EXHAUSTED and `trailing_metadata` carries
// "kvpool-shortfall", its value is kept as the kShortfallPayloadUrl payload.
absl::Status FromGrpcStatus(
    const grpc::Status& status,
    const std::multimap<grpc::string_ref, grpc::string_ref>& trailing_metadata = {});

// What ran out, and by how many blocks.
struct Shortfall {
  std::string resource;  // as the daemon names it, e.g. "pool" or "session quota"
  int64_t blocks = 0;    // blocks missing for the refused call to succeed
};

// The shortfall carried by a status from FromGrpcStatus; nullopt when there is none or it does
// not parse as "<resource>:<blocks>".
std::optional<Shortfall> GetShortfall(const absl::Status& status);

}  // namespace kvpool::client
