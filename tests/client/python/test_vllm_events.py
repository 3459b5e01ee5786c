"""The ZeroMQ publisher of cache events (docs/events.md) read as vLLM's own subscriber reads
vLLM: a SUB socket for [topic, seq, payload] messages, a REQ socket for replays, and payloads
decoded against vLLM's KV-event schema (vllm/distributed/kv_events.py: msgspec structs with
array_like=True, tag=True), strictly: every field of every struct, with its type. A consumer
that reconstructs the daemon's block set from them must end with the daemon's own snapshot
(WatchEvents), device and host tier alike, also when it drops messages and fills the gaps
through the replay socket, across a cleared cache (AllBlocksCleared forgets every medium; the
host tier's blocks are told again), and per layer group for a hybrid pool (vLLM's later group
fields); and garbage sent to the replay socket neither crashes nor blocks the daemon."""

import contextlib
import os
import shutil
import socket
import tempfile
import time
import unittest

import grpc
import kvpool
from kvpool_testing import Daemon, SMALL_CONFIG, wait_until

import msgpack  # python3-msgpack (deploy/install-deps.sh)
import zmq  # python3-zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = b"kvpool"
# vLLM's event structs: the tag, then the fields in declaration order.
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
# vLLM's later fields, which a pool with more than one layer group sends on every Stored and
# Removed event (docs/events.md); a consumer of the shorter form ignores them.
GROUP_FIELDS = {
    "BlockStored": ("lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("group_idx",),
    "AllBlocksCleared": (),
}
KINDS = ("full_attention", "sliding_window", "mamba")


def is_hash(h):  # ExternalBlockHash = bytes | int
    return isinstance(h, (bytes, int))


def decode_batch(payload):
    """KVEventBatch(ts: float, events: list[...], data_parallel_rank: int | None = None)."""
    batch = msgpack.unpackb(payload, raw=False, use_list=True)
    assert isinstance(batch, list) and 2 <= len(batch) <= 3, batch
    ts, events = batch[0], batch[1]
    assert isinstance(ts, float) and abs(ts - time.time()) < 600, ts
    assert isinstance(events, list)
    if len(batch) == 3:
        assert batch[2] is None or isinstance(batch[2], int)
    decoded = []
    for event in events:
        assert isinstance(event, list) and event and event[0] in FIELDS, event
        names = FIELDS[event[0]]
        if len(event) != 1 + len(names):
            names = names + GROUP_FIELDS[event[0]]
        assert len(event) == 1 + len(names), event
        e = dict(zip(names, event[1:]), type=event[0])
        if "group_idx" in e:
            assert isinstance(e["group_idx"], int) and e["group_idx"] >= 0, e
        if "kv_cache_spec_kind" in e:
            assert e["lora_name"] is None and e["extra_keys"] is None, e
            assert e["kv_cache_spec_kind"] in KINDS, e
            window = e["kv_cache_spec_sliding_window"]
            assert (e["kv_cache_spec_kind"] == "sliding_window") == (window is not None), e
            assert window is None or (isinstance(window, int) and window > 0), e
            assert (e["group_idx"] == 0) == (e["kv_cache_spec_kind"] == "full_attention"), e
        if "block_hashes" in e:
            assert isinstance(e["block_hashes"], list) and all(map(is_hash, e["block_hashes"]))
            assert e["medium"] is None or isinstance(e["medium"], str)
        if e["type"] == "BlockStored":
            assert e["parent_block_hash"] is None or is_hash(e["parent_block_hash"])
            assert isinstance(e["token_ids"], list)
            assert all(isinstance(t, int) for t in e["token_ids"])
            assert isinstance(e["block_size"], int) and e["block_size"] > 0
            assert e["lora_id"] is None or isinstance(e["lora_id"], int)
            if e["medium"] == "GPU":  # the device pool's events carry every block's tokens
                assert len(e["token_ids"]) == e["block_size"] * len(e["block_hashes"])
        decoded.append(e)
    return decoded


class Consumer:
    """vLLM's subscriber loop: a gap in seq asks the replay socket for what is missing. `drop`
    says which messages to lose on purpose (as a full high-water mark would). The replay socket
    is a DEALER sending vLLM's REQ envelope (an empty delimiter, then the start seq): a REQ
    socket takes only the first of the many replies a replay sends (so with vLLM's publisher)."""

    def __init__(self, endpoint, replay_endpoint, drop=lambda seq: False):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.req = self.ctx.socket(zmq.DEALER)
        self.req.connect(replay_endpoint)
        self.req.setsockopt(zmq.RCVTIMEO, 10000)
        self.drop = drop
        self.last_seq = 0  # kvpool numbers events from 1
        self.applied = []  # seqs applied, in order
        self.replays = 0
        self.blocks = {}  # (medium, group_idx) -> set of hashes; group 0 in a plain pool

    def close(self):
        self.ctx.destroy(linger=0)

    def apply(self, seq, payload):
        if seq <= self.last_seq:
            return  # had it already (a replay reached past it)
        assert seq == self.last_seq + 1, (seq, self.last_seq)
        for e in decode_batch(payload):
            if e["type"] == "AllBlocksCleared":  # every medium and group (docs/events.md)
                self.blocks.clear()
                continue
            key = (e["medium"], e.get("group_idx", 0))
            held = self.blocks.setdefault(key, set())
            if e["type"] == "BlockStored":
                if key[1] > 0 and key[0] != "DISK":  # a component after its block
                    assert set(e["block_hashes"]) <= self.blocks.get((key[0], 0), set()), e
                held.update(e["block_hashes"])
            else:
                held.difference_update(e["block_hashes"])
        self.last_seq = seq
        self.applied.append(seq)

    def replay(self):
        self.replays += 1
        self.req.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
        while True:
            delimiter, seq_bytes, payload = self.req.recv_multipart()
            assert delimiter == b""
            if seq_bytes == END_SEQ:
                return
            self.apply(int.from_bytes(seq_bytes, "big"), payload)

    def poll(self, timeout_ms):
        """Takes what arrives within `timeout_ms`; returns whether anything did."""
        got = False
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC
            seq = int.from_bytes(seq_bytes, "big")
            got = True
            timeout_ms = 0
            if self.drop(seq):
                continue
            if seq > self.last_seq + 1:
                self.replay()
            self.apply(seq, payload)
        return got

    def catch_up(self, next_seq, timeout=20):
        """Until every event before `next_seq` is applied; on idle, asks the replay socket for
        a tail the SUB socket lost."""
        deadline = time.monotonic() + timeout
        while self.last_seq < next_seq - 1:
            assert time.monotonic() < deadline, (self.last_seq, next_seq)
            if not self.poll(100) and self.last_seq < next_seq - 1:
                self.replay()


def hash_bytes(h):
    return h.hi.to_bytes(8, "big") + h.lo.to_bytes(8, "big")


def snapshot(client, group=0, medium="device"):
    """The daemon's blocks of layer group `group` in `medium` ("device", "host", "disk"), from its
    WatchEvents snapshot."""
    blocks = set()
    for response in client.watch_events(snapshot=True):
        if not response.snapshot:
            break
        for e in response.events:
            if (e.group.index if e.HasField("group") else 0) == group and e.medium == medium:
                blocks.update(hash_bytes(h) for h in e.block_hashes)
    return blocks


def host_blocks(client):
    for s in client.get_stats().tiers.stores:
        if s.medium == "host":
            return s.blocks
    raise AssertionError("no host tier")


def workload(client, rounds):
    """Prompts that share prefixes: prefill, commit, now and then an eviction."""
    for i in range(rounds):
        base = [(11 * (i % 3) + 5 * t) % 400 + 1 for t in range(48)]
        prompt = base + [(i * 31 + t) % 400 + 1 for t in range(16 + 16 * (i % 3))]
        out = client.prefill(prompt)
        client.free([out.sequence_id], commit=True)
        if i % 4 == 3:
            client.evict(2)


def settled_next_seq(client):
    """The daemon's next event seq once the tier writers are done (it stops moving)."""
    last = client.get_stats().events_next_seq
    while True:
        time.sleep(0.3)
        now = client.get_stats().events_next_seq
        if now == last:
            return now
        last = now


def evict_all_when_settled(client, timeout=20):
    """Evict with `all` once the tier writers are done; again while a block is still held for a
    copy (FAILED_PRECONDITION), which the slower sanitizer build can see."""
    deadline = time.monotonic() + timeout
    while True:
        settled_next_seq(client)
        try:
            return client.evict_all()
        except kvpool.KvPoolError as e:
            if e.code != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise


class VllmEventsTest(unittest.TestCase):
    def setUp(self):
        self.sockets = tempfile.mkdtemp(prefix="kvpool-zmq-")
        self.addCleanup(shutil.rmtree, self.sockets, ignore_errors=True)
        self.endpoint = f"ipc://{self.sockets}/events"
        self.replay_endpoint = f"ipc://{self.sockets}/replay"
        self.config = (SMALL_CONFIG + "\ntiers { host_blocks: 1024 }\n"
                       f'zmq_events {{ endpoint: "{self.endpoint}" '
                       f'replay_endpoint: "{self.replay_endpoint}" topic: "kvpool" }}\n')

    def run_consumer(self, drop):
        with Daemon(self.config) as daemon:
            consumer = Consumer(self.endpoint, self.replay_endpoint, drop)
            self.addCleanup(consumer.close)
            with kvpool.Client.connect(daemon.dir, client_name="vllm-events") as c:
                workload(c, 12)
                consumer.poll(0)
                evict_all_when_settled(c)  # AllBlocksCleared, then the host tier's blocks again
                workload(c, 12)
                next_seq = settled_next_seq(c)
                consumer.catch_up(next_seq)
                self.assertEqual(consumer.applied, list(range(1, next_seq)))  # gap-free
                media = consumer.blocks
                self.assertTrue(media.get(("GPU", 0)), "no device events")
                self.assertEqual(media[("GPU", 0)], snapshot(c))
                self.assertEqual(media.get(("CPU", 0), set()), snapshot(c, medium="host"))
                self.assertEqual(len(media.get(("CPU", 0), ())), host_blocks(c))
                self.assertGreater(host_blocks(c), 0)
                self.assertTrue(c.check_invariants().ok)
            return consumer

    def test_a_vllm_consumer_rebuilds_the_daemons_block_set(self):
        self.run_consumer(drop=lambda seq: False)

    def test_dropped_messages_come_back_through_the_replay_socket(self):
        consumer = self.run_consumer(drop=lambda seq: seq % 5 == 2)
        self.assertGreater(consumer.replays, 0)

    @contextlib.contextmanager
    def hybrid_run(self, pool_config, client_name):
        """A daemon of `pool_config` publishing to a consumer that loses every 7th message, the
        workload run and the consumer caught up gap-free: yields (consumer, client)."""
        config = (pool_config + f'zmq_events {{ endpoint: "{self.endpoint}" '
                  f'replay_endpoint: "{self.replay_endpoint}" topic: "kvpool" }}\n')
        with Daemon(config) as daemon:
            consumer = Consumer(self.endpoint, self.replay_endpoint, drop=lambda seq: seq % 7 == 3)
            self.addCleanup(consumer.close)
            with kvpool.Client.connect(daemon.dir, client_name=client_name) as c:
                workload(c, 12)
                next_seq = settled_next_seq(c)
                consumer.catch_up(next_seq)
                self.assertEqual(consumer.applied, list(range(1, next_seq)))
                yield consumer, c
                self.assertEqual(set(g for _, g in consumer.blocks), {0, 1})
                self.assertTrue(c.check_invariants().ok)

    def test_a_hybrid_pools_events_name_each_group(self):
        """tiny-swa with a window group: the window blocks the tree keeps are group 1
        (sliding_window, W 256) under their blocks' hashes; the main blocks group 0."""
        with self.hybrid_run('pool_bytes: 16777216 max_blocks_per_seq: 64 '
                             'model { name: "tiny-swa" } shape { window_blocks: 48 }\n',
                             "vllm-hybrid") as (consumer, c):
            main, window = consumer.blocks.get(("GPU", 0)), consumer.blocks.get(("GPU", 1))
            self.assertTrue(main, "no main-group events")
            self.assertTrue(window, "no window-group events")
            self.assertEqual(main, snapshot(c, 0))
            self.assertEqual(window, snapshot(c, 1))
            self.assertLessEqual(window, main)

    def test_a_hybrid_pools_tier_checkpoints_are_events_of_the_state_group(self):
        """tiny-hybrid with a host tier: the checkpoints the host tier keeps are CPU events of
        the state group (group 1, mamba) under their blocks' hashes, as many as the tier
        holds; before, a consumer saw the tier's blocks alone and could not tell which of
        them a prompt could resume from."""
        with self.hybrid_run('pool_bytes: 33554432 max_blocks_per_seq: 256 '
                             'shape { dtype: "f32" state_slots: 8 } model { name: "tiny-hybrid" }\n'
                             'tiers { host_blocks: 1024 }\n',
                             "vllm-hybrid-tiers") as (consumer, c):
            tiers = c.get_stats().tiers
            on_host = consumer.blocks.get(("CPU", 1), set())
            self.assertGreater(tiers.host_checkpoints, 0)
            self.assertEqual(len(on_host), tiers.host_checkpoints)
            self.assertLessEqual(on_host, consumer.blocks.get(("CPU", 0), set()))
            self.assertEqual(on_host, snapshot(c, 1, "host"))
            self.assertEqual(consumer.blocks.get(("GPU", 1), set()), snapshot(c, 1))

    def test_garbage_on_the_replay_socket_neither_crashes_nor_blocks_the_daemon(self):
        with Daemon(self.config) as daemon:
            ctx = zmq.Context()
            self.addCleanup(ctx.term)
            dealer = ctx.socket(zmq.DEALER)  # frames as they come, no REQ envelope rules
            dealer.setsockopt(zmq.LINGER, 0)
            self.addCleanup(dealer.close)
            dealer.connect(self.replay_endpoint)
            for frames in ([b""], [b"", b"1234567"], [b"x", b"\0" * 8], [b"", b"\0" * 8, b"x"],
                           [b"", b"\0" * 9], [b"", b"a" * 100000], [b""] * 50):
                dealer.send_multipart(frames)
            # Valid requests from a peer that never reads its answers.
            for _ in range(200):
                dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            # Raw bytes on the socket itself: not ZeroMQ's handshake at all.
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.connect(self.replay_endpoint[len("ipc://"):])
            raw.sendall(os.urandom(4096))
            raw.close()
            consumer = Consumer(self.endpoint, self.replay_endpoint)
            self.addCleanup(consumer.close)
            with kvpool.Client.connect(daemon.dir, client_name="after-garbage") as c:
                workload(c, 6)
                next_seq = settled_next_seq(c)
                consumer.catch_up(next_seq)  # published and replayed as before
                self.assertEqual(consumer.applied, list(range(1, next_seq)))
                self.assertEqual(consumer.blocks[("GPU", 0)], snapshot(c))
            self.assertIsNone(daemon.process.poll())
            self.assertEqual(daemon.stop(), 0)


if __name__ == "__main__":
    unittest.main()
