#pragma once

// Invariant checks. KVPOOL_CHECK guards the program's own invariants only: never client input
// and never the environment (those are absl::Status errors). A failed check logs the condition
// and aborts. KVPOOL_DCHECK compiles away in NDEBUG builds.

#include <string_view>

#include "absl/base/optimization.h"
#include "absl/status/status.h"

namespace kvpool::internal {

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              std::string_view message);

}  // namespace kvpool::internal

#define KVPOOL_CHECK_MSG(cond, message)                                      \
  do {                                                                       \
    if (ABSL_PREDICT_FALSE(!(cond))) {                                       \
      ::kvpool::internal::CheckFailed(__FILE__, __LINE__, #cond, (message)); \
    }                                                                        \
  } while (0)

#define KVPOOL_CHECK(cond) KVPOOL_CHECK_MSG(cond, "")

#define KVPOOL_CHECK_OK(expr)                                                                      \
  do {                                                                                             \
    const ::absl::Status kvpool_check_status_ = (expr);                                            \
    if (ABSL_PREDICT_FALSE(!kvpool_check_status_.ok())) {                                          \
      ::kvpool::internal::CheckFailed(__FILE__, __LINE__, #expr, kvpool_check_status_.ToString()); \
    }                                                                                              \
  } while (0)

#ifdef NDEBUG
#define KVPOOL_DCHECK(cond) \
  do {                      \
    if (false && (cond)) {  \
    }                       \
  } while (0)
#else
#define KVPOOL_DCHECK(cond) KVPOOL_CHECK(cond)
#endif
