"""The lower tiers against real processes (DESIGN.md §9): a prefix evicted from the device pool
comes back from the host tier with the same greedy tokens; two daemons sharing one redis-server
on a private Unix socket (and one deployment secret) share their prefixes byte for byte and keep
tenants apart; Redis killed mid-run costs no call, and hits resume once it is back; a write
budget set in the config file keeps one tenant's flood from evicting another's prefix. Skipped
without redis-server."""

import os
import re
import shutil
import subprocess
import tempfile
import unittest

import kvpool
from kvpool_testing import (Daemon, SMALL_CONFIG, fetch, free_port, python_child, run,
                            wait_until)
from py_kv_client import prompt as kv_prompt

REDIS = shutil.which("redis-server")
PROMPT_TOKENS = 96  # six full blocks of 16


class Redis:
    """redis-server on a Unix socket in a private directory, no persistence; beside it the
    deployment secret (secret_file) every daemon that shares it must name."""

    def __init__(self, extra_args=()):
        self.extra_args = list(extra_args)
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.secret = os.path.join(self.dir, "secret")
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
        self.process = None
        self.start()

    def start(self):
        self.process = subprocess.Popen(
            [REDIS, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self.dir] + self.extra_args,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        until(lambda: os.path.exists(self.socket), "redis-server's socket")

    def kill(self):
        self.process.kill()
        self.process.wait()
        if os.path.exists(self.socket):
            os.unlink(self.socket)

    def close(self):
        if self.process and self.process.poll() is None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def until(predicate, what, timeout=10):
    if not wait_until(predicate, timeout=timeout):
        raise AssertionError(f"timed out waiting for {what}")


# tiny-hybrid (state-space layers): a prompt resumes only from a state checkpoint.
HYBRID_CONFIG = ('pool_bytes: 33554432 max_blocks_per_seq: 256 '
                 'shape { dtype: "f32" state_slots: 8 } model { name: "tiny-hybrid" }')

# tiny-swa (window 256): a prompt resumes only where the window group has the window's blocks.
WINDOW_CONFIG = ('pool_bytes: 33554432 max_blocks_per_seq: 64 '
                 'shape { dtype: "f32" window_blocks: 40 } model { name: "tiny-swa" }')


def redis_config(redis, extra="", base=SMALL_CONFIG):
    return (base + f'\nsecret_file: "{redis.secret}"\n'
            f'tiers {{ redis {{ enabled: true unix_socket: "{redis.socket}" '
            "connect_timeout_ms: 100 command_timeout_ms: 200 "
            f"breaker_backoff_ms: 200 }} {extra} }}\n")


def store(stats, medium):
    for s in stats.tiers.stores:
        if s.medium == medium:
            return s
    raise AssertionError(f"no {medium} tier in {stats.tiers}")


def py_kv(mode, directory, tokens, seed):
    rc, out = run(python_child("py_kv_client.py", mode, directory, tokens, seed))
    assert rc == 0, out
    return out


class HostTierTest(unittest.TestCase):
    def test_an_evicted_prefix_comes_back_with_the_same_greedy_tokens(self):
        with Daemon(SMALL_CONFIG + "\ntiers { host_blocks: 1024 }\n") as daemon:
            with kvpool.Client.connect(daemon.dir, client_name="host-tier") as c:
                prompt = [(7 * i + 3) % 500 for i in range(80)]  # five full blocks
                first = c.prefill(prompt)
                c.free([first.sequence_id], commit=True)
                until(lambda: c.get_stats().tiers.demoted_blocks >= 5, "five blocks demoted")
                self.assertGreaterEqual(c.evict_all(), 5)
                self.assertEqual(c.match_prefix(prompt), 0)
                again = c.prefill(prompt)
                self.assertGreaterEqual(again.reused_tokens, 64)
                self.assertEqual(again.next_token, first.next_token)
                c.free([again.sequence_id], commit=True)
                # As much as a prefix that never left the device pool gives.
                control = c.prefill(prompt)
                self.assertEqual(again.reused_tokens, control.reused_tokens)
                tiers = c.get_stats().tiers
                self.assertEqual(tiers.promoted_from_host, 5)
                self.assertEqual(store(c.get_stats(), "host").hits, 5)
                self.assertTrue(c.check_invariants().ok)


@unittest.skipUnless(REDIS, "redis-server is not installed")
class RedisTierTest(unittest.TestCase):
    def setUp(self):
        self.redis = Redis()
        self.addCleanup(self.redis.close)

    def test_a_prefix_committed_on_one_daemon_is_a_hit_on_another(self):
        config = redis_config(self.redis)
        with Daemon(config) as a, Daemon(config) as b:
            written = py_kv("write", a.dir, PROMPT_TOKENS, 42)
            checksum = written.split()[1]
            with kvpool.Client.connect(a.dir, client_name="watch-a") as ca:
                until(lambda: store(ca.get_stats(), "redis").written >= 6, "six blocks in redis")
            read = py_kv("read", b.dir, PROMPT_TOKENS, 42)
            self.assertEqual(read, f"matched {PROMPT_TOKENS} checksum {checksum}\n")
            with kvpool.Client.connect(b.dir, client_name="watch-b") as cb:
                stats = cb.get_stats()
                self.assertEqual(stats.tiers.promoted_from_redis, 6)
                self.assertEqual(store(stats, "redis").hits, 6)
                # Another tenant on daemon B finds nothing of it.
                with kvpool.Client.connect(b.dir, tenant="other", client_name="eve",
                                           kv_access=True) as eve:
                    seq = eve.allocate_one(kv_prompt(PROMPT_TOKENS, 42))
                    self.assertEqual(seq.matched_tokens, 0)
                self.assertTrue(cb.check_invariants().ok)

    def test_a_hybrid_prefix_resumes_on_another_daemon_from_its_checkpoint(self):
        """Issue 28: a state checkpoint is a value like a block. Daemon A's prefill keeps one at
        its last block boundary (48) and writes it to Redis beside the blocks; daemon B, sharing
        Redis and nothing else, resumes the same prompt there with A's answer. Before, B promoted
        the blocks and could resume none of them."""
        config = redis_config(self.redis, base=HYBRID_CONFIG)
        prompt = [(11 * i + 5) % 500 for i in range(57)]  # three full blocks and 9 tokens
        with Daemon(config) as a, Daemon(config) as b:
            with kvpool.Client.connect(a.dir, client_name="hybrid-a") as ca:
                first = ca.prefill(prompt)
                ca.free([first.sequence_id], commit=True)
                until(lambda: ca.get_stats().tiers.demoted_checkpoints >= 1,
                      "a checkpoint copied out")
                # Three blocks and the checkpoint at 48.
                until(lambda: store(ca.get_stats(), "redis").written >= 4, "four values in redis")
            with kvpool.Client.connect(b.dir, client_name="hybrid-b") as cb:
                again = cb.prefill(prompt)
                self.assertEqual(again.reused_tokens, 48)
                self.assertEqual(again.next_token, first.next_token)
                tiers = cb.get_stats().tiers
                self.assertEqual(tiers.promoted_checkpoints, 1)
                self.assertEqual(tiers.promoted_from_redis, 3)
                self.assertTrue(cb.check_invariants().ok)

    def conversation_on_daemon_a(self, config, prompt, values):
        """Daemon A prefills `prompt` (57 tokens), decodes 40 and frees the sequence with commit;
        returns the 97 tokens it knew once `values` values (blocks and checkpoints) are in
        Redis."""
        with Daemon(config) as a:
            with kvpool.Client.connect(a.dir, client_name="hybrid-a") as ca:
                first = ca.prefill(prompt)
                tokens = list(prompt)
                pending = first.next_token
                for _ in range(40):  # to 97 tokens: blocks 3, 4 and 5 come from the decode
                    tokens.append(pending)
                    pending = ca.decode([(first.sequence_id, pending)]).next_tokens[0]
                ca.free([first.sequence_id], commit=True)
                until(lambda: store(ca.get_stats(), "redis").written >= values,
                      f"{values} values in redis")
        return tokens

    def test_a_conversation_resumes_from_its_answers_last_block_boundary(self):
        """A decode keeps a rolling checkpoint at the last block boundary it reached (96 here),
        kept when the sequence ends and written to Redis with its block: daemon B resumes the
        whole conversation there, not at the prefill's last boundary (48), and computes one
        token of A's 97. (Four checkpoint slots: rolling ones take at most a quarter.)"""
        config = redis_config(self.redis, base=HYBRID_CONFIG.replace(
            'state_slots: 8', 'state_slots: 8 checkpoint_slots: 4 checkpoint_interval: -1'))
        prompt = [(5 * i + 1) % 500 for i in range(57)]
        # Six blocks and the checkpoints at 48 and 96.
        tokens = self.conversation_on_daemon_a(config, prompt, values=8)
        with Daemon(config) as b, kvpool.Client.connect(b.dir, client_name="hybrid-b") as cb:
            again = cb.prefill(tokens)
            self.assertEqual(again.reused_tokens, 96)
            self.assertEqual(cb.get_stats().tiers.promoted_checkpoints, 1)
            self.assertTrue(cb.check_invariants().ok)

    def test_a_checkpoint_below_the_deepest_blocks_costs_one_redis_get(self):
        """Redis holds a prefix's blocks deeper than its deepest checkpoint (decoded tokens with
        no rolling checkpoint: 3 checkpoint slots leave none for it). Daemon B asks which of the
        deepest blocks have a checkpoint in one round trip (EXISTS each) and GETs only the one
        that has: before, it GET each deeper block's checkpoint key in turn, a round trip each."""
        config = redis_config(self.redis, base=HYBRID_CONFIG.replace(
            'state_slots: 8', 'state_slots: 8 checkpoint_interval: -1 checkpoint_slots: 3'))
        prompt = [(7 * i + 3) % 500 for i in range(57)]  # three full blocks and 9 tokens
        # Six blocks and the checkpoint at 48.
        tokens = self.conversation_on_daemon_a(config, prompt, values=7)
        with Daemon(config) as b:
            cli = [shutil.which("redis-cli"), "-s", self.redis.socket]
            subprocess.run(cli + ["CONFIG", "RESETSTAT"], check=True, capture_output=True)
            with kvpool.Client.connect(b.dir, client_name="hybrid-b") as cb:
                again = cb.prefill(tokens)
                self.assertEqual(again.reused_tokens, 48)
                self.assertEqual(cb.get_stats().tiers.promoted_checkpoints, 1)
            info = subprocess.run(cli + ["INFO", "commandstats"], check=True,
                                  capture_output=True, text=True).stdout
            calls = {line.split(":")[0][len("cmdstat_"):]: int(line.split("calls=")[1].split(",")[0])
                     for line in info.splitlines() if line.startswith("cmdstat_")}
            # The six blocks (one pipeline), then the checkpoint at 48 alone.
            self.assertEqual(calls.get("get"), 7, info)
            self.assertEqual(calls.get("exists"), 6, info)

    def test_a_sliding_window_prefix_resumes_on_another_daemon_with_its_window(self):
        """Issue 28: a window-group block is a value like a block. Daemon A's prefill of
        tiny-swa (window 256) keeps its full blocks' window blocks and writes them to Redis
        beside the blocks; daemon B, sharing Redis and nothing else, resumes the prompt after
        its 18 full blocks with A's answer, copying in the 16 window blocks the window reads
        there. Before, B promoted the blocks with window blocks nobody had filled."""
        config = redis_config(self.redis, base=WINDOW_CONFIG)
        prompt = [(13 * i + 7) % 500 for i in range(300)]  # 18 full blocks and 12 tokens
        with Daemon(config) as a, Daemon(config) as b:
            with kvpool.Client.connect(a.dir, client_name="window-a") as ca:
                first = ca.prefill(prompt)
                ca.free([first.sequence_id], commit=True)
                until(lambda: ca.get_stats().tiers.demoted_window_blocks >= 16,
                      "window blocks copied out")
                until(lambda: store(ca.get_stats(), "redis").written >= 34,
                      "blocks and window blocks in redis")
            with kvpool.Client.connect(b.dir, client_name="window-b") as cb:
                again = cb.prefill(prompt)
                self.assertEqual(again.reused_tokens, 288)
                self.assertEqual(again.next_token, first.next_token)
                tiers = cb.get_stats().tiers
                self.assertEqual(tiers.promoted_from_redis, 18)
                # At 288 the window reads tokens [33, 288): blocks 2 to 17.
                self.assertEqual(tiers.promoted_window_blocks, 16)
                self.assertTrue(cb.check_invariants().ok)

    def test_a_corrupted_value_is_a_miss_never_data(self):
        config = redis_config(self.redis)
        with Daemon(config) as a, Daemon(config) as b:
            py_kv("write", a.dir, PROMPT_TOKENS, 9)
            with kvpool.Client.connect(a.dir, client_name="watch-a") as ca:
                until(lambda: store(ca.get_stats(), "redis").written >= 6, "six blocks in redis")
            cli = [shutil.which("redis-cli"), "-s", self.redis.socket]
            keys = subprocess.run(cli + ["--scan", "--pattern", "kvp2:*"], check=True,
                                  capture_output=True, text=True).stdout.split()
            self.assertEqual(len(keys), 6)
            # Flip one byte of one block's payload (past the 96-byte header).
            for key in keys[:1]:
                old = subprocess.run(cli + ["GETRANGE", key, "100", "100"], check=True,
                                     capture_output=True).stdout[:1]
                flipped = bytes([old[0] ^ 0xFF]) if old else b"x"
                subprocess.run(cli + ["-x", "SETRANGE", key, "100"], input=flipped, check=True,
                               capture_output=True)
            out = py_kv("read", b.dir, PROMPT_TOKENS, 9)
            matched = int(out.split()[1])
            self.assertLess(matched, PROMPT_TOKENS)  # the chain stops at the bad block
            self.assertEqual(matched % 16, 0)
            with kvpool.Client.connect(b.dir, client_name="watch-b") as cb:
                redis = store(cb.get_stats(), "redis")
                self.assertEqual(redis.corrupt, 1)
                self.assertEqual(redis.forged, 1)  # a damaged payload fails the MAC
                self.assertTrue(cb.check_invariants().ok)

    def test_redis_down_costs_no_call_and_hits_resume_when_it_is_back(self):
        config = redis_config(self.redis)
        with Daemon(config) as a, Daemon(config) as b:
            self.redis.kill()
            # Every call still works while Redis is gone; the breaker opens (three failed round
            # trips) and the daemon keeps serving.
            py_kv("write", a.dir, PROMPT_TOKENS, 5)
            for _ in range(3):
                out = py_kv("read", b.dir, PROMPT_TOKENS, 5)
                self.assertTrue(out.startswith("matched 0 "), out)
            with kvpool.Client.connect(b.dir, client_name="watch-b") as cb:
                redis = store(cb.get_stats(), "redis")
                self.assertGreaterEqual(redis.breaker_opens, 1)
                self.assertEqual(cb.get_stats().failure, "")  # still serving
                cb.ping()
            self.redis.start()
            # Back: what is written now is shared again (the breaker closes on a probe).
            def shared():
                py_kv("write", a.dir, PROMPT_TOKENS, 6)
                return py_kv("read", b.dir, PROMPT_TOKENS, 6).startswith(f"matched {PROMPT_TOKENS} ")
            until(shared, "hits after redis came back", timeout=20)


def tenant_samples(port, family):
    """{tenant: value} of one per-tenant family on the daemon's /metrics."""
    text = fetch(f"http://127.0.0.1:{port}/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        family + r'\{[^}]*tenant="([^"]+)"[^}]*\} (\S+)', text)}


@unittest.skipUnless(REDIS and shutil.which("redis-cli"), "redis-server is not installed")
class RedisBudgetTest(unittest.TestCase):
    """tiers.redis.tenant_write_budget_bytes through a config file, end to end: a quiet tenant's
    prefix, then another tenant's flood of twice what an 8 MiB Redis holds, then the quiet prefix
    read on a second daemon. Without a budget Redis evicts it (the control); with a 2 MiB budget the
    flood is cut at its share, Redis evicts nothing, and the prefix is whole on the other daemon."""

    FLOOD_PROMPTS = 40  # x 6 blocks of 64 KiB: 15 MiB of values (about 19 MiB as Redis spends it)

    def setUp(self):
        self.redis = Redis(["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"])
        self.addCleanup(self.redis.close)
        self.cli = [shutil.which("redis-cli"), "-s", self.redis.socket]

    def evicted_keys(self):
        info = subprocess.run(self.cli + ["INFO", "stats"], check=True, capture_output=True,
                              text=True).stdout
        return int(re.search(r"evicted_keys:(\d+)", info).group(1))

    def run_flood(self, budget):
        def settled(client):
            r = store(client.get_stats(), "redis")
            return r.written + r.already_present + r.dropped if r.queued_blocks == 0 else -1

        port = free_port()
        extra = f"ttl_seconds: 3600 tenant_write_budget_bytes: {budget}" if budget else ""
        config = redis_config(self.redis).replace("breaker_backoff_ms: 200",
                                                  "breaker_backoff_ms: 200 " + extra)
        quiet_prompt = kv_prompt(PROMPT_TOKENS, 77)
        with Daemon(config + f'metrics {{ listen: "{port}" }}\n') as a, \
                Daemon(redis_config(self.redis)) as b:
            with kvpool.Client.connect(a.dir, tenant="quiet", client_name="quiet",
                                       kv_access=True) as quiet, \
                    kvpool.Client.connect(a.dir, tenant="flood", client_name="flood",
                                          kv_access=True) as flood:
                seq = quiet.allocate_one(quiet_prompt)
                quiet.free([seq.id], commit=True)
                until(lambda: store(quiet.get_stats(), "redis").written >= 6, "the quiet prefix")
                for i in range(self.FLOOD_PROMPTS):
                    seq = flood.allocate_one(kv_prompt(PROMPT_TOKENS, 1000 + i))
                    flood.free([seq.id], commit=True)
                    # Drained before the next, so no write is dropped for a full queue.
                    until(lambda: settled(flood) >= 6 * (i + 2), "the flood's writes")
                redis_a = store(flood.get_stats(), "redis")
                bytes_by_tenant = tenant_samples(port, "kvpool_tenant_redis_bytes")
                over = tenant_samples(port, "kvpool_tenant_redis_over_budget_blocks_total")
            with kvpool.Client.connect(b.dir, tenant="quiet", client_name="quiet-b",
                                       kv_access=True) as reader:
                matched = reader.allocate_one(quiet_prompt).matched_tokens
                self.assertTrue(reader.check_invariants().ok)
        return matched, redis_a, bytes_by_tenant, over

    def test_without_a_budget_the_flood_evicts_the_quiet_prefix(self):
        matched, redis_a, _, _ = self.run_flood(0)
        self.assertGreater(self.evicted_keys(), 0)
        self.assertLess(matched, PROMPT_TOKENS)
        self.assertEqual(redis_a.dropped, 0)

    def test_a_budget_keeps_the_flood_to_its_share_and_the_quiet_prefix_whole(self):
        budget = 2 << 20
        matched, redis_a, bytes_by_tenant, over = self.run_flood(budget)
        self.assertEqual(self.evicted_keys(), 0)
        self.assertEqual(matched, PROMPT_TOKENS)
        self.assertGreater(redis_a.dropped, 0)
        self.assertGreater(over.get("flood", 0), 0)
        self.assertEqual(over.get("quiet", 0), 0)
        # Each holds at most its half (both active), the quiet tenant its six blocks.
        self.assertLessEqual(bytes_by_tenant["flood"], budget / 2)
        self.assertGreater(bytes_by_tenant["flood"], budget / 2 - 2 * 90_000)
        self.assertGreater(bytes_by_tenant["quiet"], 6 * 65_632)


if __name__ == "__main__":
    unittest.main()
