"""Time to first token after a restart, warm (the disk tier holds the prompts' prefixes) against
cold (an empty tier), real kvpoold processes, one run:

  PYTHONPATH=client/python:build/release/python:tests/client/python \\
  KVPOOLD=build/release/daemon/kvpoold KVPOOLCTL=build/release/client/kvpoolctl \\
  python3 bench/warm_restart_ttft.py [--model tiny] [--prompts 6] [--tokens 2048]

A daemon with a disk tier prefills the prompts (each then committed) and is stopped (SIGTERM);
a second daemon on the same tier directory, and a third on an empty one, each prefill every
prompt once: the first Prefill's latency (its next token is the first token) and the reused
tokens are printed per side, with the medians, and the tokens must agree.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import kvpool
from kvpool_testing import Daemon


def config(model, tokens, secret, tier):
    blocks = tokens // 16 + 1
    return (f'pool_bytes: {4 * blocks * 65536} max_blocks_per_seq: {blocks}\n'
            f'model {{ name: "{model}" max_step_tokens: {tokens} }}\n'
            f'secret_file: "{secret}"\n'
            f'tiers {{ disk {{ directory: "{tier}" capacity_bytes: {4 << 30} }} }}\n')


def prompt(seed, n):
    return [(seed * 7919 + 31 * i) % 1000 + 1 for i in range(n)]


def first_tokens(daemon, prompts):
    """(latency s, reused tokens, next token) of one Prefill of each prompt."""
    out = []
    with kvpool.Client.connect(daemon.dir, client_name="ttft") as c:
        for p in prompts:
            start = time.perf_counter()
            r = c.prefill(p)
            out.append((time.perf_counter() - start, r.reused_tokens, r.next_token))
            c.free([r.sequence_id], commit=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="kvpool-ttft-")
    try:
        secret = os.path.join(root, "secret")
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
        warm_tier, cold_tier = os.path.join(root, "warm"), os.path.join(root, "cold")
        prompts = [prompt(s, args.tokens) for s in range(args.prompts)]
        with Daemon(config(args.model, args.tokens, secret, warm_tier)) as a:
            first_tokens(a, prompts)
            with kvpool.Client.connect(a.dir, client_name="flush") as c:
                want = args.prompts * (args.tokens // 16)
                while min(s.written for s in c.get_stats().tiers.stores) < want:
                    time.sleep(0.05)
        sides = {}
        for name, tier in (("warm", warm_tier), ("cold", cold_tier)):
            with Daemon(config(args.model, args.tokens, secret, tier)) as d:
                sides[name] = first_tokens(d, prompts)
        for name, rows in sides.items():
            ms = [1e3 * t for t, _, _ in rows]
            print(f"{name}: TTFT median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, "
                  f"max {max(ms):.1f}); reused {[r for _, r, _ in rows]}")
        same = [w[2] == c[2] for w, c in zip(sides["warm"], sides["cold"])]
        print(f"first tokens agree: {all(same)}; cold/warm TTFT: "
              f"{statistics.median(t for t, _, _ in sides['cold']) / statistics.median(t for t, _, _ in sides['warm']):.1f}x")
        return 0 if all(same) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
