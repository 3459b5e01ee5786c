#pragma once

// How many operations a seeded randomized core test runs.

#include <cstdint>
#include <cstdlib>

namespace kvpool::testing {

#if defined(__SANITIZE_ADDRESS__)  // g++
inline constexpr bool kUnderSanitizer = true;
#elif defined(__has_feature)  // clang
#if __has_feature(address_sanitizer)
inline constexpr bool kUnderSanitizer = true;
#else
inline constexpr bool kUnderSanitizer = false;
#endif
#else
inline constexpr bool kUnderSanitizer = false;
#endif

// `release` operations, or `sanitized` under ASan (where the checks after every operation cost
// ten times as much, and CI's time is short); the environment variable `env`, when set, over
// both.
inline int64_t RandomOps(const char* env, int64_t release, int64_t sanitized) {
  if (const char* v = std::getenv(env)) return std::atoll(v);
  return kUnderSanitizer ? sanitized : release;
}

}  // namespace kvpool::testing
