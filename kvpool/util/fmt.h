#pragma once

// fmt formatters for Abseil types. Debian's Abseil has its own absl::string_view (not
// std::string_view), which fmt cannot format out of the box; absl::Status prints as ToString().

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "fmt/format.h"

#if !ABSL_USES_STD_STRING_VIEW
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<std::string_view> {
  template <typename Context>
  auto format(absl::string_view s, Context& ctx) const {
    return fmt::formatter<std::string_view>::format(std::string_view(s.data(), s.size()), ctx);
  }
};
#endif

template <>
struct fmt::formatter<absl::Status> : fmt::formatter<std::string_view> {
  template <typename Context>
  auto format(const absl::Status& s, Context& ctx) const {
    return fmt::formatter<std::string_view>::format(s.ToString(), ctx);
  }
};
