#!/usr/bin/env python3
"""Issue 16 target 1 and issue 31's prefix-tree target in one command: kvpool-replay (plain LRU)
beside baselines of SGLang's RadixCache (under Debian's /usr/bin/python3), same trace, same
capacity, same block (page) size, alternating round by round, and the ratio of their requests/s
(median over rounds). All time only the cache operations (match, allocate with eviction,
insert/commit, free); all expand the prompt's tokens outside the clock. Also prints each side's
hit rate and kvpool-replay's peak RSS. Each round, kvpool-replay replays the trace
--kvpool_passes times (requests/s over all passes), so that its timed window, like the
baseline's, is seconds long rather than a fraction of one.

Baselines, each with its own ratio; the first listed is the one the target is judged on:
  - "sglang": SGLang's own radix_cache.py with a fast paged allocator
    (bench/sglang_real_replay.py). Given with --sglang_path (or $KVPOOL_SGLANG_PATH): a directory
    from which `import sglang.srt.mem_cache.radix_cache` works. SGLang's code stays outside kvpool.
  - "tensor": SGLang's algorithm re-implemented (bench/sglang_radix_replay.py) with its own layout
    (per-token slot tensors, its paged allocator's torch free list). Without torch (Debian:
    python3-torch) the same per-token layout in Python lists ("token", about as fast) stands in.
  - "page": one page index per value in Python lists, a faster Python than SGLang's own
    (2.5-3x on these traces); its ratio is the stricter one.
The default is "sglang,page" when SGLang is given, else "tensor,page". Targets are per block size
(--targets; issue 31: 10x at 16, 50x at 512).

  python3 bench/prefix_vs_sglang.py --build_dir=build/release --capacities=1000,5000 \
      --sglang_path=/path/to/sglang/python
  python3 bench/prefix_vs_sglang.py --smoke   # a few hundred requests, one round (ctest)
With --kvpool_b=<another kvpool-replay> (an A/B: main's binary, say) that binary runs in the same
alternating rounds, and the row adds its requests/s, this build's over it and its own ratio.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = ["conversation_trace.jsonl", "synthetic_trace.jsonl"]


def run_kvpool(args, trace, block_size, capacity, binary=None, floor=False):
    binary = binary or os.path.join(args.build_dir, "tools", "kvpool-replay")
    cmd = [binary, f"--trace={trace}",
           f"--block_size={block_size}", f"--capacity_blocks={capacity}",
           "--policy=lru", f"--max_requests={args.max_requests}", f"--passes={args.kvpool_passes}"]
    if floor:
        cmd.append("--memory_floor")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr}")
    out = done.stdout
    fields = {}
    for line in out.splitlines():
        k, _, v = line.partition(" ")
        fields[k] = v
    got = {"requests_per_s": float(fields["requests_per_s"].split()[0]),
           "hit_rate": float(fields["hit_rate"])}
    if floor:
        got["floor_requests_per_s"] = float(fields["floor_requests_per_s"].split()[0])
    return got


def run_python(args, trace, page_size, capacity, value):
    if value == "sglang":
        cmd = [args.python, os.path.join(REPO, "bench", "sglang_real_replay.py"),
               f"--sglang_path={args.sglang_path}"]
    else:
        cmd = [args.python, os.path.join(REPO, "bench", "sglang_radix_replay.py"),
               f"--value={value}"]
    cmd += [f"--trace={trace}", f"--page_size={page_size}", f"--capacity_blocks={capacity}",
            f"--limit={args.max_requests}", "--json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def peak_rss_kb(args, trace, block_size, capacity):
    """kvpool-replay's peak RSS in KiB (a separate run: getrusage of the child)."""
    cmd = [os.path.join(args.build_dir, "tools", "kvpool-replay"), f"--trace={trace}",
           f"--block_size={block_size}", f"--capacity_blocks={capacity}",
           "--policy=lru", f"--max_requests={args.max_requests}"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed")
    return usage.ru_maxrss


def has_torch(python):
    return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build_dir", default=os.path.join(REPO, "build", "release"))
    p.add_argument("--traces_dir", default=os.path.join(REPO, "..", "shared", "traces", "mooncake"))
    p.add_argument("--capacities", default="1000",
                   help="cache capacities in 512-token blocks, comma-separated")
    p.add_argument("--capacity_blocks", type=int, default=0, help="one capacity (overrides)")
    p.add_argument("--traces", default=",".join(TRACES), help="trace files in --traces_dir")
    p.add_argument("--block_sizes", default="16,512")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max_requests", type=int, default=0, help="0: the whole trace")
    p.add_argument("--python", default="/usr/bin/python3" if os.path.exists("/usr/bin/python3")
                   else sys.executable, help="interpreter for the baselines")
    p.add_argument("--sglang_path", default=os.environ.get("KVPOOL_SGLANG_PATH", ""),
                   help="directory from which `import sglang.srt.mem_cache.radix_cache` works; "
                        "adds the judged 'sglang' baseline (bench/sglang_real_replay.py)")
    p.add_argument("--values", default="",
                   help="baselines, the first judged against the target: sglang (SGLang's own "
                        "radix_cache.py), tensor (SGLang's layout; token without torch), token "
                        "(per-token lists), page (page lists). Default: sglang,page with "
                        "--sglang_path, else tensor,page")
    p.add_argument("--kvpool_passes", type=int, default=5,
                   help="kvpool-replay replays the trace this many times per round (requests/s "
                        "over all): at block size 16 one pass times ~0.25 s against the "
                        "baseline's ~3 s, and so caught a burst of background load whole")
    p.add_argument("--kvpool_b", default="",
                   help="another kvpool-replay binary (e.g. main's) run in the same rounds: its "
                        "requests/s, this build's over it (ab), and its ratio to the judged "
                        "baseline are printed beside this build's")
    p.add_argument("--floor", action="store_true",
                   help="also run kvpool-replay --memory_floor each round (its own process, so "
                        "the judged requests/s stay the plain run's): the floor's requests/s, "
                        "its ratio to the judged baseline (the most any exact-token cache could "
                        "reach here) and kvpool's share of it, side by side in that process")
    p.add_argument("--targets", default="16:10,512:50",
                   help="ratio to report as met, per block size (issue 31); others: --target")
    p.add_argument("--target", type=float, default=10.0, help="ratio for other block sizes")
    p.add_argument("--smoke", action="store_true", help="300 requests, one round, no target")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.max_requests, args.kvpool_passes = 1, 300, 2
    if args.capacity_blocks:
        args.capacities = str(args.capacity_blocks)
    args.targets = {int(k): float(v) for k, v in
                    (t.split(":") for t in args.targets.split(",") if t.strip())}
    return args


def baselines(args):
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    if not values:
        values = ["sglang", "page"] if args.sglang_path else ["tensor", "page"]
    if "sglang" in values and not args.sglang_path:
        raise SystemExit("the sglang baseline needs --sglang_path (or $KVPOOL_SGLANG_PATH)")
    if "tensor" in values and not has_torch(args.python):
        print(f"{args.python} has no torch: SGLang's per-token layout in lists (token) stands in "
              "for its tensors")
        values = ["token" if v == "tensor" else v for v in values]
    return values


def compare(args, values, trace, bs, capacity):
    """Alternating rounds of kvpool and every baseline; returns the row and whether it met."""
    kv, py, ratios = [], {v: [] for v in values}, {v: [] for v in values}
    kv_b, ab, b_ratios = [], [], []
    floor_x, of_floor, floor_rps = [], [], []
    mine = ["kvpool", "kvpool_b"] if args.kvpool_b else ["kvpool"]
    if args.floor:
        mine.append("floor")
    for r in range(args.rounds):
        # Alternate who goes first, so neither always runs on a cooler machine.
        order = mine + values if r % 2 == 0 else values + mine[::-1]
        got = {}
        for who in order:
            if who == "kvpool":
                got[who] = run_kvpool(args, trace, bs, capacity)
            elif who == "kvpool_b":
                got[who] = run_kvpool(args, trace, bs, capacity, args.kvpool_b)
            elif who == "floor":
                got[who] = run_kvpool(args, trace, bs, capacity, floor=True)
            else:
                got[who] = run_python(args, trace, bs, capacity, who)
        kv.append(got["kvpool"])
        if args.kvpool_b:
            kv_b.append(got["kvpool_b"])
            ab.append(got["kvpool"]["requests_per_s"] / got["kvpool_b"]["requests_per_s"])
            b_ratios.append(got["kvpool_b"]["requests_per_s"] / got[values[0]]["requests_per_s"])
            if got["kvpool_b"]["hit_rate"] != got["kvpool"]["hit_rate"]:
                raise RuntimeError(f"hit rates differ: {got['kvpool']['hit_rate']} against "
                                   f"{args.kvpool_b}'s {got['kvpool_b']['hit_rate']}")
        if args.floor:
            f = got["floor"]
            floor_rps.append(f["floor_requests_per_s"])
            floor_x.append(f["floor_requests_per_s"] / got[values[0]]["requests_per_s"])
            of_floor.append(f["requests_per_s"] / f["floor_requests_per_s"])
        for v in values:
            py[v].append(got[v])
            ratios[v].append(got["kvpool"]["requests_per_s"] / got[v]["requests_per_s"])
    target = args.targets.get(bs, args.target)
    met = statistics.median(ratios[values[0]]) >= target
    rss = peak_rss_kb(args, trace, bs, capacity) / 1024
    cols = " ".join(
        f"{statistics.median(x['requests_per_s'] for x in py[v]):>11.0f} "
        f"{statistics.median(ratios[v]):>6.1f}x" for v in values)
    b_cols = (f"{statistics.median(x['requests_per_s'] for x in kv_b):>11.0f} "
              f"{statistics.median(ab):>5.2f}x {statistics.median(b_ratios):>6.1f}x "
              if args.kvpool_b else "")
    floor_cols = (f"{statistics.median(floor_rps):>10.0f} {statistics.median(floor_x):>7.1f}x "
                  f"{statistics.median(of_floor):>8.2f} " if args.floor else "")
    row = (f"{os.path.basename(trace):<26} {capacity:>5} {bs:>4} "
           f"{statistics.median(x['requests_per_s'] for x in kv):>11.0f} {b_cols}{cols} "
           f"{floor_cols}"
           f"{kv[0]['hit_rate']:>7.4f} {py[values[0]][0]['hit_rate']:>7.4f} {rss:>9.1f}  "
           f"{'met' if met else 'MISSED'} (>= {target:g}x; rounds "
           f"{', '.join(f'{x:.1f}' for x in ratios[values[0]])})")
    return row, met


def main():
    args = parse_args()
    if not os.path.isdir(args.traces_dir):
        print(f"no traces at {args.traces_dir}; skipping")
        return 0
    values = baselines(args)
    print(f"plain LRU, baselines {args.python} (values: {', '.join(values)}; target judged on "
          f"{values[0]}), {args.rounds} alternating rounds, median; capacity in 512-token blocks")
    if args.kvpool_b:
        print(f"B: {args.kvpool_b} (ab: kvpool_rps / b_rps; b_ratio: B over {values[0]})")
    if args.floor:
        print(f"floor: kvpool-replay --memory_floor (ReplayOptions::memory_floor), its own run; "
              f"floor_x: floor over {values[0]}; of_floor: kvpool over the floor in that run")
    print(f"{'trace':<26} {'cap':>5} {'bs':>4} {'kvpool_rps':>11} "
          + (f"{'b_rps':>11} {'ab':>6} {'b_ratio':>7} " if args.kvpool_b else "")
          + " ".join(f"{v + '_rps':>11} {'ratio':>7}" for v in values)
          + (f" {'floor_rps':>10} {'floor_x':>8} {'of_floor':>8}" if args.floor else "")
          + f" {'kv_hit':>7} {'py_hit':>7} {'kv_rss_MB':>9}  target")
    ok = True
    for name in (t.strip() for t in args.traces.split(",") if t.strip()):
        for capacity in (int(c) for c in args.capacities.split(",")):
            for bs in (int(b) for b in args.block_sizes.split(",")):
                row, met = compare(args, values, os.path.join(args.traces_dir, name), bs,
                                   capacity)
                ok = ok and met
                print(row, flush=True)
    if args.smoke:
        return 0
    print("all targets met" if ok else "some targets missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
