# Compiler-wide settings: ccache, warnings, sanitizers.

find_program(KVPOOL_CCACHE ccache)
if(KVPOOL_CCACHE)
  set(CMAKE_C_COMPILER_LAUNCHER "${KVPOOL_CCACHE}")
  set(CMAKE_CXX_COMPILER_LAUNCHER "${KVPOOL_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${KVPOOL_CCACHE}")
endif()

# Warnings apply to our own targets only (kvpool_cc_* helpers), never to third-party code.
# Designated initializers that leave defaulted fields out are idiomatic here.
set(KVPOOL_CXX_WARNINGS -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
if(KVPOOL_WERROR)
  list(APPEND KVPOOL_CXX_WARNINGS -Werror)
endif()
# clang's static lock checking: every ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED is checked
# at compile time (the ci-clang preset, run by .ci/run; clang-tsa checks the libraries alone).
option(KVPOOL_THREAD_SAFETY "Check lock annotations with clang's -Wthread-safety" OFF)
if(KVPOOL_THREAD_SAFETY)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVPOOL_THREAD_SAFETY needs clang (got ${CMAKE_CXX_COMPILER_ID})")
  endif()
  list(APPEND KVPOOL_CXX_WARNINGS -Wthread-safety)
endif()

if(KVPOOL_SANITIZER STREQUAL "asan")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=address,undefined)
elseif(KVPOOL_SANITIZER STREQUAL "tsan")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT KVPOOL_SANITIZER STREQUAL "")
  message(FATAL_ERROR "KVPOOL_SANITIZER must be '', asan or tsan (got '${KVPOOL_SANITIZER}')")
endif()

# libFuzzer targets (fuzz/): every object gets the fuzzer's coverage instrumentation, so the
# fuzzers see edges in the libraries they drive; only the fuzz targets link libFuzzer itself
# (tests and tools built in the same tree take the sanitizer runtime's no-op coverage hooks).
option(KVPOOL_FUZZ "Build the libFuzzer targets in fuzz/ (clang only)" OFF)
if(KVPOOL_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVPOOL_FUZZ needs clang (got ${CMAKE_CXX_COMPILER_ID})")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
