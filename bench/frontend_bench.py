#!/usr/bin/python3
"""The frontend's gateway overhead: inter-token latency of HTTP streaming through kvpool-frontend
(measured from the HTTP side by kvpool-http-loadgen) beside the same decode driven by
kvpool-loadgen directly through the C++ client (one Decode call per token), against one kvpoold,
in one run, alternating which goes first, `rounds` times.

Both sides: `concurrency` streams at once, prompts of about 512 shared + 144 own tokens (the
generated conversation workload's system prompt and user message; the byte tokenizer makes one
token per character), replies of up to 64 tokens, the daemon's default tiny model. The HTTP side
goes through `frontends` frontend processes, requests spread over them.

    bench/frontend_bench.py [--build_dir=build/release] [--rounds=3] [--concurrency=1]

Prints each round's ITL p50/p99 of both sides and the ratio HTTP / direct (median and spread).
--smoke: one short round (CI proves it still runs; the figures mean nothing then).
"""

import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import Daemon, spread, use_tree  # noqa: E402


def direct(build_dir, directory, concurrency, requests, max_tokens):
    out = subprocess.run(
        [os.path.join(build_dir, "client", "loadgen", "kvpool-loadgen"), f"--socket_dir={directory}",
         f"--workers={concurrency}", "--tenants=1", f"--conversations={requests}", "--turns=1",
         f"--max_reply_tokens={max_tokens}", "--seed=7"],
        check=True, stdout=subprocess.PIPE, text=True).stdout
    m = re.search(r"rpc decode\s+(\d+) calls\s+p50\s+([\d.]+) us\s+p99\s+([\d.]+) us", out)
    if not m:
        raise RuntimeError(f"no decode latencies in kvpool-loadgen's output:\n{out}")
    return {"tokens": int(m.group(1)), "p50": float(m.group(2)) / 1e3, "p99": float(m.group(3)) / 1e3}


def http(urls, concurrency, requests, max_tokens):
    argv = [sys.executable, "-m", "kvpool_frontend.loadgen", "--json", "--seed=7",
            f"--concurrency={concurrency}", f"--requests={requests}", "--shared_prefix=512",
            "--prompt=144", f"--max_tokens={max_tokens}"]
    for url in urls:
        argv += ["--url", url]
    summary = json.loads(subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout)
    return {"tokens": summary["tokens"], "p50": summary["itl_p50_ms"], "p99": summary["itl_p99_ms"]}


def start_frontend(build_dir, directory):
    process = subprocess.Popen(
        [os.path.join(build_dir, "client", "frontend", "kvpool-frontend"), f"--socket_dir={directory}",
         "--port=0", "--no_auth"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    if " at " not in line:
        process.kill()
        raise RuntimeError(f"kvpool-frontend did not start: {line!r}")
    return process, line.split(" at ")[1].split(" ")[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build_dir", default="build/release")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--frontends", type=int, default=1)
    p.add_argument("--requests", type=int, default=8, help="per round and side")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.requests, args.max_tokens = 1, 2, 8
    use_tree(args.build_dir)
    with Daemon(args.build_dir, "") as daemon:
        frontends = [start_frontend(args.build_dir, daemon.dir) for _ in range(args.frontends)]
        urls = [url for _, url in frontends]
        try:
            print(f"inter-token latency, {args.concurrency} stream(s) at once, {args.requests} "
                  f"requests of up to {args.max_tokens} tokens per side and round (ms)")
            print(f"{'round':>5} {'direct p50':>11} {'direct p99':>11} {'HTTP p50':>9} "
                  f"{'HTTP p99':>9} {'HTTP/direct p50':>16}")
            ratios, ratios99 = [], []
            for r in range(args.rounds):
                run_direct = lambda: direct(args.build_dir, daemon.dir, args.concurrency,  # noqa
                                            args.requests, args.max_tokens)
                run_http = lambda: http(urls, args.concurrency, args.requests, args.max_tokens)  # noqa
                if r % 2 == 0:
                    d, h = run_direct(), run_http()
                else:
                    h, d = run_http(), run_direct()
                ratios.append(h["p50"] / d["p50"])
                ratios99.append(h["p99"] / d["p99"])
                print(f"{r:>5} {d['p50']:>11.2f} {d['p99']:>11.2f} {h['p50']:>9.2f} "
                      f"{h['p99']:>9.2f} {ratios[-1]:>16.3f}")
            print(f"ratio HTTP / direct ITL p50: {spread(ratios)}")
            print(f"ratio HTTP / direct ITL p99: {spread(ratios99)}")
        finally:
            for process, _ in frontends:
                process.terminate()
                process.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
