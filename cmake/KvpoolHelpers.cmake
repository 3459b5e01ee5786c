# Target helpers. One directory is one library target `kvpool_<name>` with the alias
# `kvpool::<name>`; link only through the aliases.
#
#   kvpool_cc_library(NAME core SRCS ... HDRS ... DEPS ...)
#   kvpool_cc_binary(NAME kvpool-replay SRCS ... DEPS ...)
#   kvpool_cc_test(NAME block_pool_test SRCS ... DEPS ... LABELS unit [TIMEOUT s] [OPTIMIZED])
#   kvpool_cc_bench(NAME core_bench SRCS ... DEPS ... [SMOKE_ARGS ...])

function(kvpool_target_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KVPOOL_CXX_WARNINGS}>)
endfunction()

function(kvpool_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;HDRS;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target kvpool_${A_NAME})
  if(A_SRCS)
    add_library(${target} STATIC ${A_SRCS} ${A_HDRS})
    target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
    target_link_libraries(${target} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    kvpool_target_defaults(${target})
  else()
    add_library(${target} INTERFACE ${A_HDRS})
    target_include_directories(${target} INTERFACE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
    target_link_libraries(${target} INTERFACE ${A_DEPS})
  endif()
  add_library(kvpool::${A_NAME} ALIAS ${target})
endfunction()

function(kvpool_cc_binary)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
  kvpool_target_defaults(${A_NAME})
endfunction()

# The sanitizer trees compile a test's own code at -O0 (the code under test, the libraries', keeps
# its optimization): gtest's and gmock's expansions take a test file 2 to 3 times as long to
# compile at -O1 under ASan. OPTIMIZED keeps the tree's level for a test whose own code is the
# work (a reference model, a randomized walk), which at -O0 would run longer than it compiles.
function(kvpool_cc_test)
  cmake_parse_arguments(A "OPTIMIZED" "NAME;TIMEOUT" "SRCS;DEPS;LABELS;ARGS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gmock kvpool_test_main)
  kvpool_target_defaults(${A_NAME})
  if(KVPOOL_SANITIZER AND NOT A_OPTIMIZED)
    target_compile_options(${A_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O0>)
  endif()
  add_test(NAME ${A_NAME} COMMAND ${A_NAME} ${A_ARGS} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  if(NOT A_LABELS)
    set(A_LABELS unit)
  endif()
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  set_tests_properties(${A_NAME} PROPERTIES LABELS "${A_LABELS}" TIMEOUT ${A_TIMEOUT})
  kvpool_test_cost(${A_NAME})
endfunction()

# ctest starts the costliest tests first when it runs several at once. A clean tree has no
# Testing/Temporary/CTestCostData.txt to say which those are, and would start them in the order
# declared, the last long one maybe alone at the end; tests/CMakeLists.txt names them.
function(kvpool_test_cost name)
  if(DEFINED KVPOOL_TEST_COST_${name})
    set_tests_properties(${name} PROPERTIES COST ${KVPOOL_TEST_COST_${name}})
  endif()
endfunction()

# Benchmarks are not tests; each gets a ctest entry labelled `bench` that runs it in smoke mode
# (tiny minimum time) so CI proves it still runs without spending minutes on it.
function(kvpool_cc_bench)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;SMOKE_ARGS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} kvpool::bench_util)
  kvpool_target_defaults(${A_NAME})
  add_test(NAME ${A_NAME}_smoke COMMAND ${A_NAME} --benchmark_min_time=0.001 ${A_SMOKE_ARGS}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(${A_NAME}_smoke PROPERTIES LABELS bench TIMEOUT 300)
endfunction()

# Python tests (unittest, Debian's /usr/bin/python3): one ctest entry per test file, run with the
# Python packages of the source tree and the stubs the build generated on PYTHONPATH
# (client/python/CMakeLists.txt), and the built programs the tests start in the environment.
#
#   kvpool_py_test(NAME python_client_test FILE test_client.py LABELS integration [TIMEOUT s])
function(kvpool_py_test)
  cmake_parse_arguments(A "" "NAME;FILE;TIMEOUT" "LABELS" ${ARGN})
  if(NOT KVPOOL_HAVE_PYTHON)  # client/python/CMakeLists.txt says why
    return()
  endif()
  if(NOT A_LABELS)
    set(A_LABELS unit)
  endif()
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  add_test(NAME ${A_NAME}
           COMMAND ${KVPOOL_PYTHON} -m unittest -v ${CMAKE_CURRENT_SOURCE_DIR}/${A_FILE}
           WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  set_tests_properties(${A_NAME} PROPERTIES LABELS "${A_LABELS}" TIMEOUT ${A_TIMEOUT}
    ENVIRONMENT "PYTHONPATH=${KVPOOL_PYTHON_PATH}:${PROJECT_SOURCE_DIR}/tests/client/python;PYTHONDONTWRITEBYTECODE=1;KVPOOLD=$<TARGET_FILE:kvpoold>;KVPOOLCTL=$<TARGET_FILE:kvpoolctl>;KVPOOL_INTEGRATION_CLIENT=$<TARGET_FILE:integration_client>;KVPOOL_LOADGEN=$<TARGET_FILE:kvpool-loadgen>;KVPOOL_SANITIZER=${KVPOOL_SANITIZER}")
  kvpool_test_cost(${A_NAME})
endfunction()

# A target of the CUDA backend plug-in (kernels/cuda, model/cuda): the static CUDA runtime, hidden
# symbols (the plug-in exports its registration only), position-independent code, and the
# project's warnings on the host side of the .cu files and on the device side too.
function(kvpool_cuda_target target)
  set_target_properties(${target} PROPERTIES
    CUDA_RUNTIME_LIBRARY Static
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    POSITION_INDEPENDENT_CODE ON
  )
  kvpool_target_defaults(${target})
  set(warnings -Xcompiler=-Wall,-Wextra,-Wno-unused-parameter,-Wno-missing-field-initializers)
  if(KVPOOL_WERROR)
    list(APPEND warnings -Werror=all-warnings -Xcompiler=-Werror)
  endif()
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${warnings}>)
endfunction()
