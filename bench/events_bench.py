#!/usr/bin/env python3
"""What the ZeroMQ publisher of cache events (docs/events.md) costs the calls that make events.

Two daemons of this build, one with `zmq_events` (and a subscriber draining it, as a router
would) and one without, get the same workload, their calls interleaved one by one (the order
alternating) and timed in rounds: each call commits a 64-token prompt never seen before (Allocate + Free with commit: one
BlockStored of 4 blocks, and once the pool is full a BlockRemoved for what it evicts). Prints
the median per-round ratio of the time per call (publisher on / off) and its spread, and checks
that the subscriber received every event the daemon numbered.

  python3 bench/events_bench.py --build_dir=build/release [--rounds=10 --calls=300]
"""

import argparse
import os
import sys
import tempfile
import subprocess
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402

CONFIG = "pool_bytes: 16777216 max_blocks_per_seq: 64\n"  # 256 blocks: it evicts soon


DRAIN = """
import sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
print("ready", flush=True)
batches = last = 0
poller = zmq.Poller()
poller.register(sub, zmq.POLLIN)
poller.register(sys.stdin, zmq.POLLIN)
while True:
    ready = dict(poller.poll())
    if sub in ready:
        _, seq, _ = sub.recv_multipart()
        batches += 1
        last = int.from_bytes(seq, "big")
    elif ready:  # stdin: the bench asks for the count
        if not sys.stdin.readline():
            break
        print(batches, last, flush=True)
"""


class Drain:
    """A router's subscriber, in a process of its own (a core of its own where there is one):
    counts the batches it receives and remembers the last seq."""

    def __init__(self, endpoint):
        self.process = subprocess.Popen([sys.executable, "-c", DRAIN, endpoint],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"

    def received(self):
        """(batches, last seq) so far."""
        self.process.stdin.write("count\n")
        self.process.stdin.flush()
        batches, last = self.process.stdout.readline().split()
        return int(batches), int(last)

    def stop(self):
        self.process.stdin.close()
        self.process.wait(timeout=10)


def commit(client, first_token):
    prompt = [(first_token + t) % 30000 + 1 for t in range(64)]
    seq = client.allocate_one(prompt)
    client.free([seq.id], commit=True)


def run_round(clients, first_token, calls):
    """Time per commit of each client, their commits interleaved one by one (the order
    alternating), so both see the same load on a shared machine."""
    total = {name: 0.0 for name in clients}
    names = list(clients)
    for i in range(calls):
        for name in (names if i % 2 == 0 else reversed(names)):
            start = time.perf_counter()
            commit(clients[name], first_token + 64 * i)
            total[name] += time.perf_counter() - start
    return {name: t / calls for name, t in total.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build_dir", default="build/release")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no_subscriber", action="store_true",
                        help="nobody subscribes: the publisher's own cost, without a reader's")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.calls = 2, 20
    bench_util.use_tree(args.build_dir)
    import kvpool

    sockets = tempfile.mkdtemp(prefix="kvpool-events-bench-")
    endpoint = f"ipc://{sockets}/events"
    on_config = (CONFIG + f'zmq_events {{ endpoint: "{endpoint}" '
                 f'replay_endpoint: "ipc://{sockets}/replay" }}\n')
    with bench_util.Daemon(args.build_dir, on_config) as on, \
            bench_util.Daemon(args.build_dir, CONFIG) as off:
        drain = None if args.no_subscriber else Drain(endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
        ratios, per_call = [], {"on": [], "off": []}
        with kvpool.Client.connect(on.dir, client_name="bench-on", kv_access=True) as c_on, \
                kvpool.Client.connect(off.dir, client_name="bench-off", kv_access=True) as c_off:
            clients = {"on": c_on, "off": c_off}
            run_round(clients, 0, args.calls)  # warm both up (and fill the pools)
            for r in range(args.rounds):
                times = run_round(clients, (r + 1) * 64 * args.calls, args.calls)
                for name in times:
                    per_call[name].append(times[name])
                ratios.append(times["on"] / times["off"])
            next_seq = c_on.get_stats().events_next_seq
            deadline = time.monotonic() + 10
            while drain and drain.received()[1] < next_seq - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        batches, last_seq = drain.received() if drain else (0, 0)
        if drain:
            drain.stop()
    events = next_seq - 1
    print(f"commits per round: {args.calls} (each Allocate + Free with commit), "
          f"rounds: {args.rounds}")
    print(f"time per commit, publisher off: {1e6 * min(per_call['off']):.0f} us (best round)")
    print(f"time per commit, publisher on:  {1e6 * min(per_call['on']):.0f} us (best round)")
    print(f"on/off: {bench_util.spread(ratios)}")
    print(f"events published: {events}; subscriber received {batches} batches, "
          f"last seq {last_seq}")
    if drain and last_seq != events:
        print("the subscriber did not receive the last event", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
