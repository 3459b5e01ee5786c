#pragma once

// Early-return helpers for absl::Status / absl::StatusOr inside the client library. The client
// depends on proto/ only (DESIGN.md §2), so it cannot use kvpool/util/status_macros.h; these carry
// their own names so that both headers may meet in one translation unit.

#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVPOOL_CLIENT_RETURN_IF_ERROR(expr)                \
  do {                                                     \
    ::absl::Status kvpool_client_status_ = (expr);         \
    if (ABSL_PREDICT_FALSE(!kvpool_client_status_.ok())) { \
      return kvpool_client_status_;                        \
    }                                                      \
  } while (0)

#define KVPOOL_CLIENT_CONCAT_INNER_(a, b) a##b
#define KVPOOL_CLIENT_CONCAT_(a, b) KVPOOL_CLIENT_CONCAT_INNER_(a, b)

#define KVPOOL_CLIENT_ASSIGN_OR_RETURN(lhs, rexpr)                                              \
  KVPOOL_CLIENT_ASSIGN_OR_RETURN_IMPL_(KVPOOL_CLIENT_CONCAT_(kvpool_client_or_, __LINE__), lhs, \
                                       rexpr)

#define KVPOOL_CLIENT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                         \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) {                        \
    return std::move(statusor).status();                           \
  }                                                                \
  lhs = std::move(statusor).value()
