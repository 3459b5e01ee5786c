# Decides whether the CUDA backend is built: KVPOOL_ENABLE_CUDA = AUTO | ON | OFF.
# Sets KVPOOL_HAVE_CUDA. Nothing here needs a GPU: CI compiles the backend without running it.

set(KVPOOL_HAVE_CUDA OFF)
if(NOT KVPOOL_ENABLE_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "KVPOOL_ENABLE_CUDA must be AUTO, ON or OFF (got '${KVPOOL_ENABLE_CUDA}')")
endif()

if(NOT KVPOOL_ENABLE_CUDA STREQUAL "OFF")
  # The toolkit's default location is usually not on PATH; point check_language at it.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(KVPOOL_HAVE_CUDA ON)
  elseif(KVPOOL_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVPOOL_ENABLE_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

if(KVPOOL_HAVE_CUDA)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    # Ampere, Ada, Hopper; PTX for newer chips.
    set(CMAKE_CUDA_ARCHITECTURES 80-real 89-real 90)
  endif()
  enable_language(CUDA)
  # CMake 3.25 knows nvcc's dialect flags only up to C++17; nvcc 12+ takes -std=c++20, which the
  # shared headers need (defaulted comparisons).
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  message(STATUS "kvpool: CUDA backend ON (${CMAKE_CUDA_COMPILER}, ${CMAKE_CUDA_COMPILER_VERSION})")
else()
  message(STATUS "kvpool: CUDA backend OFF (KVPOOL_ENABLE_CUDA=${KVPOOL_ENABLE_CUDA})")
endif()
