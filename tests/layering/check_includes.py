#!/usr/bin/env python3
"""The layering rules of DESIGN.md §2, checked on every #include of the tree.

Each source directory may include only the project directories and third-party libraries its row
of RULES names (system and standard headers are always allowed). The most specific row wins. A
violation prints `file:line: <include> (<directory> may include ...)`, and the check fails.

  python3 tests/layering/check_includes.py [--root DIR]
"""

import argparse
import os
import re
import sys

# Project directories an include can name, by its first path component (kvpool/v1/ is the proto
# library's generated and hand-written code; kvpool/util/ is the leaf library).
PROJECT = ("kvpool/v1/", "kvpool/util/", "kvpool/", "tier/", "kernels/", "model/",
           "daemon/engine/internal/", "daemon/engine/", "daemon/metrics/", "daemon/edge/", "daemon/",
           "client/", "workload/", "tools/", "bench/", "tests/")
# Third-party libraries, by the first component of what is included.
THIRD_PARTY = ("absl", "fmt", "spdlog", "xxhash.h", "grpcpp", "grpc", "google", "nlohmann",
               "hiredis", "openssl", "cblas.h", "cublas_v2.h", "cuda.h", "cuda_runtime.h",
               "cuda_runtime_api.h", "cuda_fp16.h", "cuda_bf16.h", "cudaTypedefs.h", "gtest",
               "gmock", "benchmark", "prometheus", "zmq.h", "msgpack.hpp")
CUDA = ("cuda.h", "cuda_runtime.h", "cuda_runtime_api.h", "cuda_fp16.h", "cuda_bf16.h",
        "cudaTypedefs.h")
LEAF = ("absl", "fmt", "spdlog")

# directory: (project directories it may include, third-party libraries it may include)
RULES = {
    "kvpool/util/": (("kvpool/util/",), LEAF),
    "kvpool/": (("kvpool/util/", "kvpool/"), LEAF + ("xxhash.h",)),
    "proto/": (("kvpool/v1/", "kvpool/util/"), LEAF + ("google", "grpcpp")),
    "tier/": (("kvpool/util/", "kvpool/", "tier/"), LEAF + ("xxhash.h", "hiredis", "openssl")),
    "kernels/": (("kvpool/util/", "kvpool/", "kernels/"), LEAF + ("xxhash.h",) + CUDA),
    "model/": (("kvpool/util/", "kvpool/", "kernels/", "model/"),
               LEAF + ("nlohmann", "cblas.h", "cublas_v2.h") + CUDA),
    # The engine sees core types only: no gRPC, no protobuf, no generated kvpool/v1 types. Its
    # internal/ headers (test hooks: step_executor_of.h) are for itself and tests, never the edges.
    "daemon/engine/": (("kvpool/util/", "kvpool/", "kernels/", "model/", "tier/",
                        "daemon/engine/internal/", "daemon/engine/"), LEAF),
    # /metrics: prometheus-cpp (Debian's prometheus-cpp-dev) serves the stats tables; only here.
    # The metrics read the edges' counters (edge_counters.h, here), never an edge.
    "daemon/metrics/": (("kvpool/v1/", "kvpool/util/", "kvpool/", "kernels/", "model/", "tier/",
                         "daemon/engine/", "daemon/metrics/"),
                        LEAF + ("grpcpp", "grpc", "google", "prometheus")),
    # The edges also speak vLLM's KV-event protocol (daemon/edge/zmq_event_publisher.h): ZeroMQ,
    # and msgpack for its payloads.
    "daemon/edge/": (("kvpool/v1/", "kvpool/util/", "kvpool/", "kernels/", "model/", "tier/",
                      "daemon/engine/", "daemon/metrics/", "daemon/edge/"),
                     LEAF + ("grpcpp", "grpc", "google", "zmq.h", "msgpack.hpp")),
    # The daemon's life cycle (daemon.cc, main.cc) puts the edges, metrics and engine together.
    "daemon/": (("kvpool/v1/", "kvpool/util/", "kvpool/", "kernels/", "model/", "tier/",
                 "daemon/engine/", "daemon/metrics/", "daemon/edge/", "daemon/"),
                LEAF + ("grpcpp", "grpc", "google")),
    # Clients: proto (kvpool/v1) and kvpool/util only, as client/CMakeLists.txt links them (+ the
    # CUDA driver's headers for mapping).
    "client/": (("kvpool/v1/", "kvpool/util/", "client/"),
                LEAF + ("grpcpp", "google", "nlohmann", "cuda.h", "cudaTypedefs.h")),
    "client/loadgen/": (("kvpool/v1/", "kvpool/util/", "client/", "workload/"),
                        LEAF + ("grpcpp", "google", "nlohmann")),
    "workload/": (("kvpool/util/", "workload/"), LEAF + ("nlohmann",)),
}
SOURCE = re.compile(r".*\.(h|cc|cu|cuh|inc)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')


def project_dir(include):
    for prefix in PROJECT:
        if include.startswith(prefix):
            return prefix
    return None


def rule_for(path):
    best = None
    for directory in RULES:
        if path.startswith(directory) and (best is None or len(directory) > len(best)):
            best = directory
    return best


def violations(root):
    found = []
    for directory in RULES:
        base = os.path.join(root, directory)
        for dirpath, _, files in os.walk(base):
            for name in sorted(files):
                if not SOURCE.match(name):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if rule_for(rel) != directory:
                    continue  # a more specific row covers it
                found.extend(check_file(full, rel, directory))
    return found


def check_file(full, rel, directory):
    allowed_dirs, allowed_libs = RULES[directory]
    out = []
    with open(full, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            include = m.group(1)
            ours = project_dir(include)
            if ours is not None:
                if ours not in allowed_dirs:
                    out.append(f"{rel}:{number}: {include} ({directory} may include "
                               f"{', '.join(allowed_dirs)})")
                continue
            lib = include.split("/")[0]
            if lib in THIRD_PARTY and lib not in allowed_libs:
                out.append(f"{rel}:{number}: {include} ({directory} may use "
                           f"{', '.join(allowed_libs)})")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    args = parser.parse_args()
    bad = violations(os.path.abspath(args.root))
    for v in bad:
        print(v)
    if bad:
        print(f"layering: {len(bad)} include(s) break DESIGN.md §2 (tests/layering/check_includes.py)")
        return 1
    print("layering: every include follows DESIGN.md §2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
