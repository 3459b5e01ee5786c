#!/usr/bin/env python3
"""Issue 16 target 1 in one command: kvpool-replay (plain LRU) beside the Python baselines of
SGLang's RadixCache (bench/sglang_radix_replay.py, under Debian's /usr/bin/python3), same trace,
same capacity, same block (page) size, alternating round by round, and the ratio of their
requests/s (median over rounds). Both time only the cache operations (match, allocate with
eviction, insert/commit, free); both expand the prompt's tokens outside the clock. Also prints
each side's hit rate and kvpool-replay's peak RSS. Each round, kvpool-replay replays the trace
--kvpool_passes times (requests/s over all passes), so that its timed window, like the
baseline's, is seconds long rather than a fraction of one.

Two baselines by default, each with its own ratio:
  - "tensor": SGLang's own layout (per-token slot tensors, its paged allocator's torch free
    list). This is the one the target is judged on. Without torch (Debian: python3-torch) the
    same per-token layout in Python lists ("token", about as fast) stands in for it.
  - "page": one page index per value in Python lists, a deliberately faster Python than SGLang
    (2.5-3x on these traces); its ratio is the stricter one.

  python3 bench/prefix_vs_sglang.py --build_dir=build/release
  python3 bench/prefix_vs_sglang.py --smoke   # a few hundred requests, one round (ctest)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = ["conversation_trace.jsonl", "synthetic_trace.jsonl"]


def run_kvpool(args, trace, block_size):
    cmd = [os.path.join(args.build_dir, "tools", "kvpool-replay"), f"--trace={trace}",
           f"--block_size={block_size}", f"--capacity_blocks={args.capacity_blocks}",
           "--policy=lru", f"--max_requests={args.max_requests}", f"--passes={args.kvpool_passes}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr}")
    out = done.stdout
    fields = {}
    for line in out.splitlines():
        k, _, v = line.partition(" ")
        fields[k] = v
    return {"requests_per_s": float(fields["requests_per_s"].split()[0]),
            "hit_rate": float(fields["hit_rate"])}


def run_python(args, trace, page_size, value):
    cmd = [args.python, os.path.join(REPO, "bench", "sglang_radix_replay.py"), f"--trace={trace}",
           f"--page_size={page_size}", f"--capacity_blocks={args.capacity_blocks}",
           f"--limit={args.max_requests}", f"--value={value}", "--json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def peak_rss_kb(args, trace, block_size):
    """kvpool-replay's peak RSS in KiB (a separate run: getrusage of the child)."""
    cmd = [os.path.join(args.build_dir, "tools", "kvpool-replay"), f"--trace={trace}",
           f"--block_size={block_size}", f"--capacity_blocks={args.capacity_blocks}",
           "--policy=lru", f"--max_requests={args.max_requests}"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed")
    return usage.ru_maxrss


def has_torch(python):
    return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build_dir", default=os.path.join(REPO, "build", "release"))
    p.add_argument("--traces_dir", default=os.path.join(REPO, "..", "shared", "traces", "mooncake"))
    p.add_argument("--capacity_blocks", type=int, default=1000)
    p.add_argument("--traces", default=",".join(TRACES), help="trace files in --traces_dir")
    p.add_argument("--block_sizes", default="16,512")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max_requests", type=int, default=0, help="0: the whole trace")
    p.add_argument("--python", default="/usr/bin/python3" if os.path.exists("/usr/bin/python3")
                   else sys.executable, help="interpreter for the baseline")
    p.add_argument("--values", default="tensor,page",
                   help="baselines, the first judged against the target: tensor (SGLang's layout; "
                        "token without torch), token (per-token lists), page (page lists, fastest)")
    p.add_argument("--kvpool_passes", type=int, default=5,
                   help="kvpool-replay replays the trace this many times per round (requests/s "
                        "over all): at block size 16 one pass times ~0.25 s against the "
                        "baseline's ~3 s, and so caught a burst of background load whole")
    p.add_argument("--target", type=float, default=10.0, help="ratio to report as met")
    p.add_argument("--smoke", action="store_true", help="300 requests, one round, no target")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.max_requests, args.kvpool_passes = 1, 300, 2
    traces_dir = args.traces_dir
    if not os.path.isdir(traces_dir):
        print(f"no traces at {traces_dir}; skipping")
        return 0
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    if "tensor" in values and not has_torch(args.python):
        print(f"{args.python} has no torch: SGLang's per-token layout in lists (token) stands in "
              "for its tensors")
        values = ["token" if v == "tensor" else v for v in values]
    print(f"capacity {args.capacity_blocks} x 512 tokens, plain LRU, baselines {args.python} "
          f"(values: {', '.join(values)}; target judged on {values[0]}), {args.rounds} "
          "alternating rounds, median")
    print(f"{'trace':<26} {'bs':>4} {'kvpool_rps':>11} "
          + " ".join(f"{v + '_rps':>11} {'ratio':>7}" for v in values)
          + f" {'kv_hit':>7} {'py_hit':>7} {'kv_rss_MB':>9}  target")
    ok = True
    for name in (t.strip() for t in args.traces.split(",") if t.strip()):
        trace = os.path.join(traces_dir, name)
        for bs in (int(b) for b in args.block_sizes.split(",")):
            kv, py, ratios = [], {v: [] for v in values}, {v: [] for v in values}
            for r in range(args.rounds):
                # Alternate who goes first, so neither always runs on a cooler machine.
                order = ["kvpool"] + values if r % 2 == 0 else values + ["kvpool"]
                got = {}
                for who in order:
                    got[who] = (run_kvpool(args, trace, bs) if who == "kvpool"
                                else run_python(args, trace, bs, who))
                kv.append(got["kvpool"])
                for v in values:
                    py[v].append(got[v])
                    ratios[v].append(got["kvpool"]["requests_per_s"] / got[v]["requests_per_s"])
            judged = statistics.median(ratios[values[0]])
            met = judged >= args.target
            ok = ok and met
            rss = peak_rss_kb(args, trace, bs) / 1024
            cols = " ".join(
                f"{statistics.median(x['requests_per_s'] for x in py[v]):>11.0f} "
                f"{statistics.median(ratios[v]):>6.1f}x" for v in values)
            print(f"{name:<26} {bs:>4} {statistics.median(x['requests_per_s'] for x in kv):>11.0f} "
                  f"{cols} {kv[0]['hit_rate']:>7.4f} {py[values[0]][0]['hit_rate']:>7.4f} "
                  f"{rss:>9.1f}  {'met' if met else 'MISSED'} (>= {args.target:g}x; rounds "
                  f"{', '.join(f'{x:.1f}' for x in ratios[values[0]])})", flush=True)
    if args.smoke:
        return 0
    print("all targets met" if ok else "some targets missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
