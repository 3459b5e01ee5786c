#pragma once

// Early-return helpers for absl::Status / absl::StatusOr (Debian's Abseil 20220623 has neither).
//
//   KVPOOL_RETURN_IF_ERROR(DoThing());
//   KVPOOL_ASSIGN_OR_RETURN(auto pool, BlockPool::Create(options));

#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVPOOL_RETURN_IF_ERROR(expr)                \
  do {                                              \
    ::absl::Status kvpool_status_ = (expr);         \
    if (ABSL_PREDICT_FALSE(!kvpool_status_.ok())) { \
      return kvpool_status_;                        \
    }                                               \
  } while (0)

#define KVPOOL_STATUS_CONCAT_INNER_(a, b) a##b
#define KVPOOL_STATUS_CONCAT_(a, b) KVPOOL_STATUS_CONCAT_INNER_(a, b)

#define KVPOOL_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVPOOL_ASSIGN_OR_RETURN_IMPL_(KVPOOL_STATUS_CONCAT_(kvpool_statusor_, __LINE__), lhs, rexpr)

#define KVPOOL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) {                 \
    return std::move(statusor).status();                    \
  }                                                         \
  lhs = std::move(statusor).value()
