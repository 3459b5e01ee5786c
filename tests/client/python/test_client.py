"""kvpool.Client and kvpool.aio.AsyncClient against a real kvpoold: the attach, every RPC of the
service, and the canonical error codes (with the shortfall), each leaving the daemon unchanged."""

import asyncio
import os
import subprocess
import sys
import tempfile
import unittest

import grpc

import kvpool
import kvpool.aio
from kvpool import KvPoolError, StatusCode
from kvpool._proto import kvpool_pb2
from kvpool_testing import SMALL_CONFIG, Daemon, KVPOOLCTL, run

C = StatusCode


def tokens(n, seed=1):
    x, out = seed * 7919 + 1, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(x % 8192)
    return out


class RuntimeDirTest(unittest.TestCase):
    def test_default_runtime_dir_follows_xdg_then_uid(self):
        saved = os.environ.get("XDG_RUNTIME_DIR")
        try:
            os.environ["XDG_RUNTIME_DIR"] = "/run/user/77"
            self.assertEqual(kvpool.default_runtime_dir(), "/run/user/77/kvpool")
            os.environ["XDG_RUNTIME_DIR"] = ""
            self.assertEqual(kvpool.default_runtime_dir(), f"/tmp/kvpool-{os.getuid()}")
            del os.environ["XDG_RUNTIME_DIR"]
            self.assertEqual(kvpool.default_runtime_dir(), f"/tmp/kvpool-{os.getuid()}")
        finally:
            if saved is not None:
                os.environ["XDG_RUNTIME_DIR"] = saved

    def test_shortfall_parses_the_last_colon(self):
        self.assertEqual(kvpool.Shortfall.parse("session quota:10"), kvpool.Shortfall("session quota", 10))
        self.assertEqual(kvpool.Shortfall.parse("a:b:3"), kvpool.Shortfall("a:b", 3))
        self.assertIsNone(kvpool.Shortfall.parse("pool"))
        self.assertIsNone(kvpool.Shortfall.parse(":3"))
        self.assertIsNone(kvpool.Shortfall.parse("pool:x"))


class ClientTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon(SMALL_CONFIG + "\nsession_quota_blocks: 20\n")
        self.addCleanup(self.daemon.close)

    def connect(self, name="test", **kwargs):
        kwargs.setdefault("kv_access", True)
        c = kvpool.Client.connect(self.daemon.dir, client_name=name, **kwargs)
        self.addCleanup(c.close)
        return c

    def test_attach_reports_the_session_and_the_pool(self):
        c = self.connect()
        self.assertGreater(c.session_id, 0)
        self.assertEqual(len(c.session_token), 32)
        self.assertTrue(c.admin)
        self.assertTrue(c.kv_access)
        self.assertEqual(c.model_name, "tiny")
        self.assertEqual(c.model_vocab_size, 8192)
        self.assertEqual(c.model_max_position, 4096)
        self.assertEqual(c.pool, "default")
        self.assertEqual((c.layout.block_size, c.layout.num_layers, c.layout.num_kv_heads,
                          c.layout.head_dim, c.layout.dtype), (16, 4, 4, 64, kvpool.DType.BF16))
        self.assertEqual(c.layout.num_blocks, 256)
        self.assertEqual(c.mapping.num_blocks, 256)
        sessions = c.list_sessions().sessions
        mine = [s for s in sessions if s.session_id == c.session_id]
        self.assertEqual(len(mine), 1)
        self.assertEqual(mine[0].client_name, "test")
        self.assertEqual(mine[0].pid, os.getpid())
        self.assertTrue(mine[0].kv_access)

    def test_compute_only_session_gets_no_mapping_and_no_kv_rpcs(self):
        c = self.connect("compute", kv_access=False)
        self.assertFalse(c.kv_access)
        self.assertIsNone(c.mapping)
        for call in (lambda: c.allocate([[1, 2, 3]]), lambda: c.grow([(1, 5)]),
                     lambda: c.commit(1, 1)):
            with self.assertRaises(KvPoolError) as e:
                call()
            self.assertEqual(e.exception.code, C.PERMISSION_DENIED)
        first = c.prefill(tokens(20))
        c.free([first.sequence_id])

    def test_control_rpcs_batched(self):
        c = self.connect()
        prompts = [tokens(40, 1), tokens(20, 2)]
        seqs = c.allocate([prompts[0], kvpool.client.AllocateItem(prompts[1], num_tokens=33)])
        self.assertEqual([s.num_tokens for s in seqs], [40, 33])
        self.assertEqual([len(s.blocks) for s in seqs], [3, 3])
        self.assertEqual([s.matched_tokens for s in seqs], [0, 0])
        # One Grow for both: the tails apply to the tables held.
        tables = [list(s.blocks) for s in seqs]
        tails = c.grow([(seqs[0].id, 70), (seqs[1].id, 33)])
        self.assertEqual([t.num_tokens for t in tails], [70, 33])
        self.assertEqual(tails[0].table_offset, 3)
        self.assertEqual(len(tails[0].blocks), 2)
        self.assertEqual(tails[1].blocks, [])
        for tail, table in zip(tails, tables):
            kvpool.apply_grow(tail, table)
        self.assertEqual(len(tables[0]), 5)
        listed = {s.sequence_id: s for s in c.list_sequences().sequences}
        self.assertEqual(list(listed[seqs[0].id].block_ids), [b.id for b in tables[0]])
        # Truncate, fork (copy-on-write child), commit, match, free.
        c.truncate(seqs[0].id, 40)
        child = c.fork(seqs[0].id)
        self.assertNotEqual(child.id, seqs[0].id)
        self.assertEqual(child.num_tokens, 40)
        self.assertEqual(child.blocks[:2], tables[0][:2])
        c.commit(seqs[0].id, 40)
        self.assertEqual(c.match_prefix(prompts[0]), 40)
        self.assertEqual(c.match_prefix(prompts[0][:17] + [1, 2]), 17)
        pin = c.pin_prefix(prompts[0][:32], ttl_s=60)
        self.assertEqual((pin.tokens, pin.blocks), (32, 2))
        self.assertEqual([p.pin_id for p in c.list_pins()], [pin.pin_id])
        self.assertGreater(c.renew_pin(pin.pin_id, ttl_s=120).expires_in_ms, 60_000)
        with self.assertRaises(KvPoolError) as e:
            c.pin_prefix(prompts[0][:32], ttl_s=0)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        c.unpin(pin.pin_id)
        self.assertEqual(c.list_pins(), [])
        c.free([seqs[0].id, seqs[1].id, child.id], commit=True)
        again = c.allocate_one(prompts[0] + [5])
        self.assertEqual(again.matched_tokens, 40)
        c.free([again.id])
        c.ping()
        self.assertEqual(len(c.list_sequences().sequences), 0)

    def test_compute_rpcs_agree_with_generate(self):
        c = self.connect()
        prompt = tokens(30, 5)
        first = c.prefill(prompt, top_k=3)
        self.assertEqual(first.computed_tokens, 30)
        self.assertEqual(len(first.top.tokens), 3)
        self.assertEqual(first.top.tokens[0].token, first.next_token)
        out, pending = [first.next_token], first.next_token
        for _ in range(4):
            step = c.decode([(first.sequence_id, pending)], top_k=1)
            pending = step.next_tokens[0]
            out.append(pending)
        self.assertEqual(step.num_tokens[0], 34)
        c.free([first.sequence_id])
        streamed = [r for r in c.generate(prompt, 5, free_when_done=True)]
        self.assertEqual([r.token for r in streamed], out)
        self.assertEqual([r.index for r in streamed], list(range(5)))
        # A second sequence continues a first one's turn: Prefill with its id.
        a = c.prefill(prompt)
        b = c.prefill([a.next_token, 1, 2], sequence_id=a.sequence_id)
        self.assertEqual(b.sequence_id, a.sequence_id)
        self.assertEqual(b.num_tokens, 33)
        # A stream closed early is cancelled; its sequence is freed (free_when_done).
        stream = c.generate(prompt, 1000, free_when_done=True)
        next(stream)
        stream.close()
        c.free([a.sequence_id])
        self.assertTrue(_eventually(lambda: c.get_stats().sequences == 0))

    def test_admin_rpcs(self):
        c = self.connect()
        seq = c.allocate_one(tokens(32, 9))
        c.free([seq.id], commit=True)
        stats = c.get_stats()
        self.assertEqual(stats.cached_blocks, 2)
        self.assertEqual(stats.free_blocks + stats.active_blocks + stats.cached_blocks
                         + stats.retiring_blocks, stats.num_blocks)
        self.assertEqual(c.get_stats("default").num_blocks, 256)
        trace = c.dump_block_trace(seq.blocks[0].id)
        self.assertTrue(any(e.op == "alloc" for e in trace.entries))
        self.assertGreaterEqual(len(c.dump_all_block_traces().entries), len(trace.entries))
        events = [e for r in c.watch_events(1) for e in r.events]
        self.assertEqual(events[0].type, kvpool_pb2.KvEvent.TYPE_BLOCK_STORED)
        self.assertEqual(events[0].seq, 1)
        self.assertEqual(events[0].epoch, c.epoch)
        # A followed stream starts with the snapshot asked for, stays open, and ends when closed.
        follow = c.watch_events(snapshot=True, follow=True)
        first = next(follow)
        self.assertTrue(first.snapshot)
        self.assertEqual(sum(len(e.block_hashes) for e in first.events), 2)  # the cached blocks
        follow.close()
        explained = c.explain_match(tokens(32, 9))
        self.assertEqual(explained.matched_tokens, 32)
        self.assertTrue(c.check_invariants().ok)
        c.set_log_level("warn")
        self.assertEqual(c.evict(1), 1)
        self.assertEqual(c.evict_all(), 1)
        self.assertEqual(c.get_stats().cached_blocks, 0)
        self.assertEqual(c.drain(), 0)
        with self.assertRaises(KvPoolError) as e:
            c.prefill(tokens(4))
        self.assertEqual(e.exception.code, C.UNAVAILABLE)
        with self.assertRaises(KvPoolError) as e:
            c.set_log_level("loud")
        self.assertEqual(e.exception.code, C.INVALID_ARGUMENT)

    def test_bad_input_gets_its_code_and_changes_nothing(self):
        a, b = self.connect("a"), self.connect("b")
        prompt = [3] * 50
        seq = a.allocate_one(prompt)
        before = a.get_stats()

        def code(call):
            with self.assertRaises(KvPoolError) as e:
                call()
            return e.exception.code

        for call in (lambda: a.grow_one(999999, 60), lambda: a.truncate(999999, 1),
                     lambda: a.fork(999999), lambda: a.commit(999999, 1), lambda: a.free([999999])):
            self.assertEqual(code(call), C.NOT_FOUND)
        for call in (lambda: b.grow_one(seq.id, 60), lambda: b.truncate(seq.id, 1),
                     lambda: b.fork(seq.id), lambda: b.commit(seq.id, 1), lambda: b.free([seq.id])):
            self.assertEqual(code(call), C.PERMISSION_DENIED)
        for call in (lambda: a.grow_one(seq.id, -5), lambda: a.truncate(seq.id, -1),
                     lambda: a.truncate(seq.id, 51), lambda: a.commit(seq.id, 60),
                     lambda: a.allocate_one(prompt, 10), lambda: a.allocate([]),
                     lambda: a.grow([]), lambda: a.free([]),
                     lambda: a.prefill([]), lambda: a.prefill([8192]),
                     lambda: a.prefill([1], top_k=65),
                     lambda: a.decode([(seq.id, 1), (seq.id, 2)], top_k=-1)):
            self.assertEqual(code(call), C.INVALID_ARGUMENT)
        # Arguments that cannot be encoded never leave this process.
        for call in (lambda: a.free([-1]), lambda: a.grow_one(seq.id, "many"),
                     lambda: a.allocate([[1 << 40]]), lambda: a.prefill([1], top_k=1.5)):
            self.assertEqual(code(call), C.INVALID_ARGUMENT)
        # Table overflow (64 blocks of 16): RESOURCE_EXHAUSTED with the shortfall.
        with self.assertRaises(KvPoolError) as e:
            a.grow_one(seq.id, 64 * 16 + 1)
        self.assertEqual(e.exception.code, C.RESOURCE_EXHAUSTED)
        self.assertEqual(e.exception.shortfall, kvpool.Shortfall("max_blocks_per_seq", 1))
        self.assertEqual(e.exception.metadata["kvpool-shortfall"], "max_blocks_per_seq:1")
        with self.assertRaises(KvPoolError) as e:
            a.grow_one(seq.id, 30 * 16)  # session quota 20 blocks; the sequence holds 4
        self.assertEqual(e.exception.shortfall, kvpool.Shortfall("session quota", 10))
        # A wrong session token, and none.
        for metadata in ((("kvpool-session-token", "0123456789abcdef0123456789abcdef"),), ()):
            with self.assertRaises(grpc.RpcError) as e:
                a.stub.Ping(kvpool_pb2.PingRequest(), metadata=metadata, timeout=5)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            self.assertEqual(KvPoolError.from_rpc_error(e.exception).code, C.UNAUTHENTICATED)

        after = a.get_stats()
        for field in ("free_blocks", "active_blocks", "cached_blocks", "blocks_allocated",
                      "sequences", "decode_tokens", "prefill_calls"):
            self.assertEqual(getattr(after, field), getattr(before, field), field)
        rc, out = run([KVPOOLCTL(), f"--socket_dir={self.daemon.dir}", "check"])
        self.assertEqual(rc, 0, out)

    def test_a_call_past_its_deadline_leaves_nothing(self):
        c = self.connect("hurried", kv_access=False)
        with self.assertRaises(KvPoolError) as e:
            c.prefill(tokens(300), timeout=0.001)  # 19 blocks: within the quota
        self.assertEqual(e.exception.code, C.DEADLINE_EXCEEDED)
        admin = self.connect("admin")
        self.assertTrue(_eventually(lambda: admin.get_stats().sequences == 0))
        self.assertTrue(admin.check_invariants().ok)

    def test_close_says_goodbye_and_releases_everything(self):
        admin = self.connect("admin")
        c = kvpool.Client.connect(self.daemon.dir, kv_access=True)
        c.allocate([tokens(40), tokens(40, 2)])
        self.assertEqual(admin.get_stats().sequences, 2)
        c.close()
        c.close()  # idempotent
        self.assertTrue(_eventually(lambda: admin.get_stats().sessions_detached == 1))
        stats = admin.get_stats()
        self.assertEqual(stats.sequences, 0)
        self.assertEqual(stats.sessions_reclaimed, 0)
        self.assertEqual(stats.active_blocks, 0)
        with self.assertRaises(KvPoolError) as e:
            c.ping()
        self.assertEqual(e.exception.code, C.FAILED_PRECONDITION)

    def test_cache_salts_split_the_namespace(self):
        c = self.connect(kv_access=False)
        other = self.connect("other", kv_access=False)
        prompt = tokens(40, 9)
        first = c.prefill(prompt, cache_salt="key:alice")
        c.free([first.sequence_id], commit=True)
        self.assertEqual(c.match_prefix(prompt, cache_salt="key:alice"), 40)
        # Another salt, or none, never sees it; another session naming the same salt does.
        self.assertEqual(c.match_prefix(prompt, cache_salt="key:bob"), 0)
        self.assertEqual(c.match_prefix(prompt), 0)
        self.assertEqual(other.match_prefix(prompt, cache_salt="key:alice"), 40)
        second = other.prefill(prompt, cache_salt="key:bob")
        self.assertEqual(second.reused_tokens, 0)
        other.free([second.sequence_id])
        third = other.prefill(prompt, cache_salt="key:alice")
        self.assertEqual(third.reused_tokens, 39)  # the last token's logits are computed anew
        other.free([third.sequence_id])
        streamed = list(c.generate(prompt, 1, cache_salt="key:alice", free_when_done=True))
        self.assertEqual(streamed[0].reused_tokens, 39)
        with self.assertRaises(KvPoolError) as e:
            c.prefill(prompt, cache_salt="x" * 257)
        self.assertEqual(e.exception.code, C.INVALID_ARGUMENT)

    def test_async_client_makes_the_same_calls(self):
        async def scenario():
            async with await kvpool.aio.AsyncClient.connect(
                    self.daemon.dir, kv_access=True, client_name="aio") as c:
                self.assertTrue(c.kv_access)
                await c.ping()
                seqs = await c.allocate([tokens(40), tokens(20, 2)])
                tails = await c.grow([(seqs[0].id, 70), (seqs[1].id, 20)])
                self.assertEqual([len(t.blocks) for t in tails], [2, 0])
                await c.commit(seqs[0].id, 40)
                self.assertEqual(await c.match_prefix(tokens(40)), 40)
                with self.assertRaises(KvPoolError) as e:
                    await c.grow_one(seqs[0].id, 64 * 16 + 1)
                self.assertEqual(e.exception.shortfall, kvpool.Shortfall("max_blocks_per_seq", 1))
                await c.free([s.id for s in seqs])
                salted = await c.prefill(tokens(30, 5), cache_salt="aio")
                await c.free([salted.sequence_id], commit=True)
                self.assertEqual(await c.match_prefix(tokens(30, 5), cache_salt="aio"), 30)
                self.assertEqual(await c.match_prefix(tokens(30, 5)), 0)
                first = await c.prefill(tokens(30, 5))
                steps = await asyncio.gather(*[
                    c.decode([(first.sequence_id, first.next_token)]) for _ in range(1)])
                self.assertEqual(steps[0].num_tokens[0], 31)
                await c.free([first.sequence_id])
                streamed = [r.token async for r in c.generate(tokens(30, 5), 2, free_when_done=True)]
                self.assertEqual(streamed, [first.next_token, steps[0].next_tokens[0]])
                events = [e async for r in c.watch_events(1) for e in r.events]
                self.assertTrue(events)
                self.assertTrue((await c.check_invariants()).ok)
                self.assertEqual((await c.get_stats()).sequences, 0)
                with self.assertRaises(KvPoolError) as e:
                    await c.free([12345])
                self.assertEqual(e.exception.code, C.NOT_FOUND)
            self.assertTrue(c.closed)

        asyncio.run(scenario())


# A process forked while a client is open (kvpool.client, "fork"): the child must not end the
# parent's session, and must not keep it alive once the parent is gone.
_DOOMED_PARENT = r"""
import os, sys
import kvpool
c = kvpool.Client.connect(sys.argv[1], kv_access=True, client_name="doomed")
c.allocate([[1, 2, 3, 4] * 10])
pid = os.fork()
if pid == 0:
    sys.stdin.read()  # lives on until the test closes stdin
    os._exit(0)
print(pid, flush=True)
sys.stdin.read()  # killed here
"""


class ForkTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon(SMALL_CONFIG)
        self.addCleanup(self.daemon.close)
        self.admin = kvpool.Client.connect(self.daemon.dir, client_name="admin")
        self.addCleanup(self.admin.close)

    def in_child(self, body) -> int:
        """Forks; the child runs `body` and exits 0 if it returned, 1 if it raised (nothing of
        unittest runs there). Returns the child's exit status."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                body()
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    def test_a_child_closing_the_client_leaves_the_parents_session(self):
        with kvpool.Client.connect(self.daemon.dir, kv_access=True, client_name="parent") as c:
            seq = c.allocate([tokens(40)])[0]

            def child():
                with c:  # __exit__, then close() and __del__ again
                    pass
                c.close()
                c.__del__()

            self.assertEqual(self.in_child(child), 0)
            c.ping()  # the session is still the parent's
            c.grow_one(seq.id, 64)
            c.mapping.k(0, seq.blocks[0]).cast("B")[:4] = b"\x01\x02\x03\x04"  # still mapped
            stats = self.admin.get_stats()
            self.assertEqual(stats.sequences, 1)
            self.assertEqual(stats.sessions_detached, 0)
        self.assertTrue(_eventually(lambda: self.admin.get_stats().sessions_detached == 1))
        self.assertEqual(self.admin.get_stats().sequences, 0)

    def test_the_child_holds_no_copy_of_the_attach_socket(self):
        c = kvpool.Client.connect(self.daemon.dir, kv_access=True, client_name="parent")
        self.addCleanup(c.close)
        fd = c._socket.fileno()
        inode = os.fstat(fd).st_ino

        def child():
            try:
                same = os.fstat(fd).st_ino == inode
            except OSError:
                same = False
            assert not same, "the child still holds the attach socket"
            assert c.closed
            try:
                c.ping()
            except KvPoolError as e:
                assert e.code == C.FAILED_PRECONDITION, e
            else:
                raise AssertionError("a forked child used the parent's session")

        self.assertEqual(self.in_child(child), 0)
        c.ping()

    def test_a_killed_parent_is_reclaimed_while_its_child_lives(self):
        parent = subprocess.Popen([sys.executable, "-c", _DOOMED_PARENT, self.daemon.dir],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.addCleanup(parent.stdin.close)  # ends the child too
        self.addCleanup(parent.stdout.close)
        child = int(parent.stdout.readline())
        self.assertEqual(self.admin.get_stats().sequences, 1)
        parent.kill()
        parent.wait()
        self.assertTrue(_eventually(lambda: self.admin.get_stats().sessions_reclaimed == 1))
        stats = self.admin.get_stats()
        self.assertEqual(stats.sequences, 0)
        self.assertEqual(stats.active_blocks, 0)
        os.kill(child, 0)  # still alive: its end did not have to wait for it


class AttachErrorTest(unittest.TestCase):
    def test_no_daemon_is_unavailable(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(KvPoolError) as e:
                kvpool.Client.connect(d)
            self.assertEqual(e.exception.code, C.UNAVAILABLE)
            self.assertIn("attach.sock", e.exception.message)
        with self.assertRaises(KvPoolError) as e:
            kvpool.Client.connect("/nonexistent/kvpool")
        self.assertEqual(e.exception.code, C.UNAVAILABLE)

    def test_bad_timeout_is_invalid(self):
        with self.assertRaises(KvPoolError) as e:
            kvpool.Client.connect("/tmp", timeout=0)
        self.assertEqual(e.exception.code, C.INVALID_ARGUMENT)

    def test_runtime_dir_through_a_symlink_is_refused(self):
        with Daemon() as daemon, tempfile.TemporaryDirectory() as d:
            link = os.path.join(d, "kvpool")
            os.symlink(daemon.dir, link)
            with self.assertRaises(KvPoolError) as e:
                kvpool.Client.connect(link)
            self.assertEqual(e.exception.code, C.PERMISSION_DENIED)
            self.assertIn("symlink", e.exception.message)

    def test_peer_not_allowed_is_refused(self):
        with Daemon(SMALL_CONFIG + "\nallowed_uids: 4242\nallowed_gids: 4242\n") as daemon:
            with self.assertRaises(KvPoolError) as e:
                kvpool.Client.connect(daemon.dir)
            self.assertEqual(e.exception.code, C.PERMISSION_DENIED)
            self.assertIn("may not attach", e.exception.message)

    def test_kv_access_not_granted_is_refused(self):
        config = SMALL_CONFIG + f'\ntenants {{ name: "serving" uids: {os.getuid()} }}\n'
        with Daemon(config) as daemon:
            with self.assertRaises(KvPoolError) as e:
                kvpool.Client.connect(daemon.dir, tenant="serving", kv_access=True)
            self.assertEqual(e.exception.code, C.PERMISSION_DENIED)
            with self.assertRaises(KvPoolError) as e:
                kvpool.Client.connect(daemon.dir, tenant="someone-else")
            self.assertEqual(e.exception.code, C.PERMISSION_DENIED)
            with kvpool.Client.connect(daemon.dir, tenant="serving") as c:
                self.assertFalse(c.kv_access)
                c.ping()


def _eventually(predicate, timeout=10.0):
    from kvpool_testing import wait_until

    return wait_until(predicate, timeout)


if __name__ == "__main__":
    unittest.main()
