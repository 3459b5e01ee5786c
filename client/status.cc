#include "client/status.h"

#include <charconv>
#include <string_view>

#include "kvpool/v1/wire.h"

namespace kvpool::client {

absl::Status FromGrpcStatus(const grpc::Status& status,
                            const std::multimap<grpc::string_ref, grpc::string_ref>& trailing) {
  if (status.ok()) return absl::OkStatus();
  const int raw = static_cast<int>(status.error_code());
  // Both enums are the canonical google.rpc.Code; anything else came from a broken peer.
  const absl::StatusCode code =
      raw > 0 && raw <= static_cast<int>(absl::StatusCode::kUnauthenticated)
          ? static_cast<absl::StatusCode>(raw)
          : absl::StatusCode::kUnknown;
  absl::Status out(code, status.error_message());
  if (code == absl::StatusCode::kResourceExhausted) {
    if (auto it = trailing.find(wire::kShortfallKey); it != trailing.end()) {
      out.SetPayload(kShortfallPayloadUrl,
                     absl::Cord(std::string(it->second.data(), it->second.size())));
    }
  }
  return out;
}

std::optional<Shortfall> GetShortfall(const absl::Status& status) {
  const auto payload = status.GetPayload(kShortfallPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  const std::string text(*payload);
  // The resource name may itself contain ':' only before the last one.
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) return std::nullopt;
  const std::string_view number = std::string_view(text).substr(colon + 1);
  Shortfall shortfall;
  const auto [end, ec] =
      std::from_chars(number.data(), number.data() + number.size(), shortfall.blocks);
  if (ec != std::errc() || end != number.data() + number.size()) return std::nullopt;
  shortfall.resource = text.substr(0, colon);
  return shortfall;
}

}  // namespace kvpool::client
