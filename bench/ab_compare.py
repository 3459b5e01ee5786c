#!/usr/bin/env python3
"""Before/after for a Google Benchmark binary, in one run: the old and the new binary run
alternately, round by round (the first to run alternates too), and each benchmark's time is
compared within its round. Prints, per benchmark, the median of the per-round ratios new/old,
a 95 % bootstrap interval for that median, their spread (min..max), and whether the median stays
within --max_slowdown.

On a shared machine a binary's own times move by tens of percent between runs; a ratio taken
within one round cancels most of that drift, and the median over rounds drops the rounds that
another process disturbed.

  python3 bench/ab_compare.py --old=/work/base/build/ci/bench/model_bench \\
      --new=build/release/bench/model_bench --rounds=6 \\
      -- --benchmark_filter='BM_(InProcessDecode|DaemonDecode)/batch'
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile


def run_once(binary, extra):
    # The results go to a file: some of our benchmarks print their own summary on stdout.
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([binary, f"--benchmark_out={out.name}",
                               "--benchmark_out_format=json", *extra], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{binary} failed ({done.returncode}): {done.stderr[-2000:]}")
        results = json.load(out)
    if not results.get("benchmarks"):
        raise RuntimeError(f"{binary} ran no benchmark (does the filter match?)")
    times = {}
    for b in results["benchmarks"]:
        if b.get("run_type") == "aggregate" or "error_occurred" in b:
            continue
        times.setdefault(b["run_name"], []).append(b["real_time"])
    # Several repetitions inside one run: their median stands for the round.
    return {name: statistics.median(t) for name, t in times.items()}


def bootstrap_median(values, resamples=2000, seed=1):
    """A 95 % percentile-bootstrap interval for the median of `values` (seeded: reproducible)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the binary before the change")
    p.add_argument("--new", required=True, help="the binary after the change")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max_slowdown", type=float, default=0.05,
                   help="a median ratio new/old above 1 + this is reported as slower")
    p.add_argument("extra", nargs="*", help="arguments for both binaries (after --)")
    args = p.parse_args()

    ratios = {}
    for r in range(args.rounds):
        order = [("old", args.old), ("new", args.new)]
        if r % 2:
            order.reverse()
        got = {side: run_once(binary, args.extra) for side, binary in order}
        for name, new_time in got["new"].items():
            if name in got["old"]:
                ratios.setdefault(name, []).append(new_time / got["old"][name])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {got['new'][n] / got['old'][n]:.3f}" for n in got["new"] if n in got["old"]),
              file=sys.stderr, flush=True)

    if not ratios:
        print("no benchmark ran in both binaries")
        return 1
    width = max(len(n) for n in ratios)
    print(f"{'benchmark':<{width}}  new/old median  95% interval   (min..max over {args.rounds} "
          "rounds)")
    slower = 0
    for name, rs in ratios.items():
        med = statistics.median(rs)
        flag = ""
        if med > 1 + args.max_slowdown:
            flag = f"  SLOWER by more than {args.max_slowdown:.0%}"
            slower += 1
        lo, hi = bootstrap_median(rs)
        print(f"{name:<{width}}  {med:14.3f}  [{lo:.3f}, {hi:.3f}]  ({min(rs):.3f}..{max(rs):.3f})"
              f"{flag}")
    print("no benchmark slower" if slower == 0 else f"{slower} benchmark(s) slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
