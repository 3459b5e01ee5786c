#!/usr/bin/python3
"""The Python client beside the C++ client, against one kvpoold, in one run:

  - round trips: Ping, Allocate (32 tokens, two blocks) and Free, each call timed, by
    bench/client_rtt (C++ client) and by kvpool.Client (Python), alternately, `rounds` times;
    prints each round's p50s and the ratio Python / C++ (median and spread over the rounds);
  - mapping reads: the whole arena copied out of the Python client's mapping with numpy
    (np.copyto into a local array) beside a local memcpy of the same size (libc memcpy through
    ctypes.memmove, local to local), interleaved; ratio of bandwidths, mapping / memcpy.

    bench/python_client_bench.py [--build_dir=build/release] [--rounds=5] [--calls=2000]

--smoke: one short round (CI proves it still runs; the figures mean nothing then).
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import Daemon, spread, use_tree  # noqa: E402

import numpy as np  # noqa: E402


def python_rtt(directory, calls):
    import kvpool

    with kvpool.Client.connect(directory, client_name="python_client_bench", kv_access=True) as c:
        ping, allocate, free = [], [], []
        for i in range(calls + calls // 10):  # the first tenth warms up
            start = time.perf_counter()
            c.ping()
            if i >= calls // 10:
                ping.append(1e6 * (time.perf_counter() - start))
        for i in range(calls + calls // 10):
            prompt = [i * 64 + t for t in range(32)]
            start = time.perf_counter()
            seq = c.allocate([prompt])[0]
            middle = time.perf_counter()
            c.free([seq.id])
            end = time.perf_counter()
            if i >= calls // 10:
                allocate.append(1e6 * (middle - start))
                free.append(1e6 * (end - middle))
    return {"ping_p50_us": statistics.median(ping), "allocate_p50_us": statistics.median(allocate),
            "free_p50_us": statistics.median(free)}


def cpp_rtt(build_dir, directory, calls):
    out = subprocess.run([os.path.join(build_dir, "bench", "client_rtt"),
                          f"--socket_dir={directory}", f"--calls={calls}"],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


def round_trips(build_dir, directory, rounds, calls):
    ratios = {"ping": [], "allocate": [], "free": []}
    print(f"round trips ({calls} calls of each kind per round; p50 in us)")
    print(f"{'round':>5} {'ping C++':>9} {'ping Py':>9} {'alloc C++':>10} {'alloc Py':>9} "
          f"{'free C++':>9} {'free Py':>9}")
    for r in range(rounds):
        if r % 2 == 0:  # alternate which goes first
            cpp, py = cpp_rtt(build_dir, directory, calls), python_rtt(directory, calls)
        else:
            py, cpp = python_rtt(directory, calls), cpp_rtt(build_dir, directory, calls)
        for op in ratios:
            ratios[op].append(py[f"{op}_p50_us"] / cpp[f"{op}_p50_us"])
        print(f"{r:>5} {cpp['ping_p50_us']:>9.1f} {py['ping_p50_us']:>9.1f} "
              f"{cpp['allocate_p50_us']:>10.1f} {py['allocate_p50_us']:>9.1f} "
              f"{cpp['free_p50_us']:>9.1f} {py['free_p50_us']:>9.1f}")
    for op, values in ratios.items():
        print(f"ratio Python / C++ {op:<9} p50 latency: {spread(values)}")


def mapping_reads(directory, rounds, reps):
    import kvpool

    with kvpool.Client.connect(directory, client_name="python_client_bench", kv_access=True) as c:
        arena = c.mapping.arena_array()
        n = arena.nbytes
        dst = np.empty(n, dtype=np.uint8)
        src = np.ones(n, dtype=np.uint8)
        np.copyto(dst, arena)  # fault every page in before timing
        np.copyto(dst, src)

        def timed(fn):
            start = time.perf_counter()
            fn()
            return n / (time.perf_counter() - start) / 1e9

        ratios = []
        print(f"\nmapping reads ({n >> 20} MiB arena, best of {reps} per round, GB/s)")
        print(f"{'round':>5} {'numpy from mapping':>19} {'local memcpy':>13}")
        for r in range(rounds):
            mapped, local = [], []
            for _ in range(reps):
                mapped.append(timed(lambda: np.copyto(dst, arena)))
                local.append(timed(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)))
            ratios.append(max(mapped) / max(local))
            print(f"{r:>5} {max(mapped):>19.2f} {max(local):>13.2f}")
        print(f"ratio mapping (numpy) / local memcpy bandwidth: {spread(ratios)}")
        del arena


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build_dir", default="build/release")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--pool_bytes", type=int, default=256 << 20)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.calls, args.pool_bytes = 1, 50, 16 << 20
    use_tree(args.build_dir)
    with Daemon(args.build_dir, f"pool_bytes: {args.pool_bytes}") as daemon:
        round_trips(args.build_dir, daemon.dir, args.rounds, args.calls)
        mapping_reads(daemon.dir, args.rounds, 3 if args.smoke else 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
