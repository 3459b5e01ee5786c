"""The pool mapping from Python against a real kvpoold: KV written by a Python process is read
byte for byte by a C++ process and the reverse (the two share the prefix), stale block refs are
refused, numpy and memoryview views agree, a killed Python client is reclaimed, and the engine
helper drives a step loop over the mapping."""

import os
import signal
import struct
import unittest

import numpy as np

import kvpool
from kvpool import BlockRef, EngineHelper, KvPoolError, StatusCode
from kvpool._calls import to_sequence
from kvpool.mapping import bf16_to_f32, f32_to_bf16
from kvpool_testing import Daemon, INTEGRATION_CLIENT, python_child, read_line, run, spawn, wait_until

C = StatusCode


class MappingTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon()
        self.addCleanup(self.daemon.close)

    def connect(self, name="test"):
        c = kvpool.Client.connect(self.daemon.dir, client_name=name, kv_access=True)
        self.addCleanup(c.close)
        return c

    def cpp(self, mode, a, b):
        return run([INTEGRATION_CLIENT(), mode, self.daemon.dir, str(a), str(b)])

    def py(self, mode, a, b):
        return run(python_child("py_kv_client.py", mode, self.daemon.dir, a, b))

    def test_python_writes_and_cpp_reads_the_same_bytes(self):
        rc, written = self.py("write", 100, 42)
        self.assertEqual(rc, 0, written)
        self.assertTrue(written.startswith("written "), written)
        checksum = written.split()[1]
        rc, read = self.cpp("read", 100, 42)
        self.assertEqual(rc, 0, read)
        self.assertEqual(read, f"matched 100 checksum {checksum}\n")
        # Another prompt gets no hit.
        rc, other = self.cpp("read", 100, 43)
        self.assertTrue(other.startswith("matched 0 "), other)

    def test_cpp_writes_and_python_reads_the_same_bytes(self):
        rc, written = self.cpp("write", 77, 7)
        self.assertEqual(rc, 0, written)
        checksum = written.split()[1]
        rc, read = self.py("read", 77, 7)
        self.assertEqual(rc, 0, read)
        self.assertEqual(read, f"matched 77 checksum {checksum}\n")
        # And the Python writer's checksum of the same prompt is the C++ writer's.
        with Daemon() as other:
            rc, again = run(python_child("py_kv_client.py", "write", other.dir, 77, 7))
            self.assertEqual(again, written)

    def test_a_reused_block_is_refused(self):
        c = self.connect()
        seq = c.allocate_one([1] * 20)
        ref = seq.blocks[0]
        live = c.mapping.k(0, ref)  # a view taken while the sequence is held
        c.free([seq.id])
        other = c.allocate_one([2] * 20)
        self.assertIn(ref.id, [b.id for b in other.blocks])  # LIFO free list: handed out again
        self.assertEqual(c.mapping.generation(ref.id), ref.generation + 1)
        for call in (lambda: c.mapping.k(0, ref), lambda: c.mapping.v_array(1, ref),
                     lambda: c.mapping.block(ref), lambda: c.mapping.copy_to_host(0, 0, ref)):
            with self.assertRaises(KvPoolError) as e:
                call()
            self.assertEqual(e.exception.code, C.FAILED_PRECONDITION)
            self.assertIn(f"block {ref.id} was reused", e.exception.message)
        fresh = [b for b in other.blocks if b.id == ref.id][0]
        c.mapping.k(0, fresh)  # the new holder's ref is current
        for bad, code in ((BlockRef(-1, 0), C.INVALID_ARGUMENT), (BlockRef(256, 1), C.OUT_OF_RANGE)):
            with self.assertRaises(KvPoolError) as e:
                c.mapping.k(0, bad)
            self.assertEqual(e.exception.code, code)
        for layer, code in ((-1, C.INVALID_ARGUMENT), (4, C.OUT_OF_RANGE)):
            with self.assertRaises(KvPoolError) as e:
                c.mapping.k(layer, fresh)
            self.assertEqual(e.exception.code, code)
        self.assertEqual(live.shape, (16, 4, 64))  # the view itself stays mapped memory
        del live

    def test_views_address_the_layout(self):
        c = self.connect()
        layout, mapping = c.layout, c.mapping
        seq = c.allocate_one(list(range(40)))
        ref = seq.blocks[1]
        k = mapping.k_array(2, ref)
        v = mapping.v_array(2, ref)
        self.assertEqual(k.shape, (16, 4, 64))
        self.assertEqual(k.dtype, np.uint16)  # bf16 bits
        values = np.linspace(-2, 2, k.size, dtype=np.float32).reshape(k.shape)
        k[:] = f32_to_bf16(values)
        v[:] = f32_to_bf16(-values)
        np.testing.assert_allclose(bf16_to_f32(k), values, rtol=1 / 128)
        # The memoryview, the raw block and the arena see the same bytes at the layout's offsets.
        self.assertEqual(mapping.k(2, ref).tobytes(), k.tobytes())
        block = mapping.block(ref)
        chunk = layout.chunk(2, 1)
        self.assertEqual(chunk.offset, 5 * layout.chunk_bytes)
        self.assertEqual(bytes(block[chunk.offset:chunk.offset + v.nbytes]), v.tobytes())
        arena = mapping.arena_array()
        start = ref.id * layout.block_bytes + layout.chunk(2, 0).offset
        self.assertEqual(arena[start:start + k.nbytes].tobytes(), k.tobytes())
        self.assertEqual(mapping.copy_to_host(2, 0, ref)[:k.nbytes], k.tobytes())
        mapping.copy_from_host(3, 0, ref, b"\x01\x02")
        self.assertEqual(mapping.k(3, ref).cast("B")[:2].tolist(), [1, 2])
        with self.assertRaises(KvPoolError) as e:
            mapping.copy_from_host(3, 0, ref, bytes(layout.chunk_bytes + 1))
        self.assertEqual(e.exception.code, C.INVALID_ARGUMENT)
        self.assertEqual(mapping.block_address(ref) + chunk.offset, mapping.v_address(2, ref))
        del k, v, block, arena

    def test_generation_table_is_read_only(self):
        c = self.connect()
        with self.assertRaises(TypeError):
            c.mapping._generations[0:4] = b"\0\0\0\0"

    def test_killed_python_client_is_reclaimed(self):
        admin = self.connect("admin")
        kept = admin.allocate_one([7] * 40)
        holder = spawn(python_child("py_kv_client.py", "hold", self.daemon.dir, 5, 100))
        self.addCleanup(lambda: holder.poll() is None and holder.kill())
        self.assertEqual(read_line(holder, 30), "holding")
        self.assertEqual(admin.get_stats().active_blocks, len(kept.blocks) + 5 * 7)
        os.kill(holder.pid, signal.SIGKILL)
        self.assertEqual(holder.wait(), -signal.SIGKILL)
        holder.stdout.close()
        self.assertTrue(wait_until(lambda: admin.get_stats().active_blocks == len(kept.blocks)))
        stats = admin.get_stats()
        self.assertEqual(stats.sessions_reclaimed, 1)
        self.assertEqual(stats.free_blocks + stats.cached_blocks + stats.active_blocks,
                         stats.num_blocks)
        listed = admin.list_sequences().sequences
        self.assertEqual([s.sequence_id for s in listed], [kept.id])
        self.assertTrue(admin.check_invariants().ok)

    def test_engine_helper_steps_share_a_prefix_with_the_next_engine(self):
        layout = None
        with kvpool.Client.connect(self.daemon.dir, kv_access=True, client_name="engine-a") as c:
            layout = c.layout
            engine = EngineHelper(c)
            prompts = [list(range(100, 140)), list(range(100, 120)) + [9] * 5]
            seqs = engine.admit(prompts, extra_tokens=2)
            self.assertEqual([s.matched_tokens for s in seqs], [0, 0])
            self.assertEqual([s.capacity for s in seqs], [42, 27])
            for seq in seqs:  # the engine computes the prompt's KV: here, a pattern per token
                for p in range(seq.matched_tokens, seq.length):
                    _write_token(c, seq, p)
            # Decode steps: one Grow for both, then the new tokens' KV.
            for step in range(5):
                fresh = engine.reserve([(s, s.length + 1) for s in seqs])
                self.assertEqual(len(fresh), 2)
                for seq in seqs:
                    seq.append(1000 + step)
                    _write_token(c, seq, seq.length - 1)
            self.assertEqual(seqs[0].length, 45)
            engine.commit(seqs)
            self.assertEqual(engine.lookup([seqs[0].tokens, seqs[1].tokens]), [45, 30])
            engine.release(seqs)
            with self.assertRaises(KvPoolError) as e:
                seqs[0].append(*range(10))
            self.assertEqual(e.exception.code, C.INVALID_ARGUMENT)
        # The next engine (a new session) admits a longer prompt and finds the KV written.
        with kvpool.Client.connect(self.daemon.dir, kv_access=True, client_name="engine-b") as c:
            engine = EngineHelper(c)
            tokens = list(range(100, 140)) + [1000, 1001, 1002, 1003, 1004, 77]
            (seq,) = engine.admit([tokens])
            self.assertEqual(seq.matched_tokens, 45)
            for p in range(seq.matched_tokens):
                block, row = seq.slot(p, layout.block_size)
                expected = _pattern(seq.tokens[: p + 1], layout.row_bytes(0, 0))
                self.assertEqual(c.mapping.k(0, block).cast("B")[row * len(expected):(row + 1) * len(expected)].tobytes(),
                                 expected, f"token {p}")
            engine.release([seq], commit=False)
        with kvpool.Client.connect(self.daemon.dir) as compute_only:
            with self.assertRaises(KvPoolError) as e:
                EngineHelper(compute_only)
            self.assertEqual(e.exception.code, C.FAILED_PRECONDITION)


class WindowGroupTest(unittest.TestCase):
    """A model with sliding-window layers (tiny-swa: window 256) seen from Python: the replies'
    window tables, followed through a Grow tail, equal the daemon's, and the mapping reaches the
    window layers' K/V in window blocks."""

    def test_window_tables_and_window_blocks(self):
        with Daemon('pool_bytes: 33554432 max_blocks_per_seq: 64 '
                    'shape { dtype: "f32" window_blocks: 40 } model { name: "tiny-swa" }') as d:
            c = kvpool.Client.connect(d.dir, client_name="window", kv_access=True)
            self.addCleanup(c.close)
            layout = c.mapping.layout
            self.assertEqual((layout.num_window_layers, layout.num_window_blocks), (2, 40))
            helper = kvpool.EngineHelper(c)
            seq = helper.admit([list(range(1, 401))])[0]  # 25 entries, nothing released yet
            self.assertEqual(len(seq.window_blocks), 25)
            self.assertTrue(all(b.id >= 0 for b in seq.window_blocks))
            # The engine wrote 400 tokens' KV: its commit slides the window past entries [0, 9)
            # (the first key token 400's query reads is 145); the next reserve's tail says so.
            c.commit(seq.id, 400)
            helper.reserve([(seq, 480)])
            listed = [s for s in c.list_sequences().sequences if s.sequence_id == seq.id][0]
            daemon = to_sequence("ListSequences", listed)
            self.assertEqual(seq.window_blocks, daemon.window_blocks)
            self.assertEqual(daemon.window_released, (0, 9))
            self.assertEqual(seq.window_blocks[8], kvpool.BlockRef(-1, 0))
            # Window layer 2 of token 400 through its window block; layer 0 through its block.
            ref, row = seq.window_slot(400, layout.block_size)
            view = c.mapping.window_k(2, ref)
            view[row, 0, 0] = 1.5
            self.assertEqual(c.mapping.copy_to_host(2, 0, ref, window=True)[
                4 * (row * layout.num_kv_heads * layout.head_dim):][:4], struct.pack("=f", 1.5))
            block, _ = seq.slot(400, layout.block_size)
            self.assertEqual(c.mapping.k(0, block).shape, layout.shape)
            for call in (lambda: c.mapping.k(2, block), lambda: seq.window_slot(100, 16)):
                with self.assertRaises(KvPoolError) as e:
                    call()
                self.assertEqual(e.exception.code, C.INVALID_ARGUMENT)
            del view


class StateSlotTest(unittest.TestCase):
    """A hybrid model's per-sequence states in the pool's state group, seen from Python."""

    def test_states_live_in_the_mapped_slots(self):
        with Daemon('pool_bytes: 33554432 max_blocks_per_seq: 64 '
                    'shape { dtype: "f32" state_slots: 4 } model { name: "tiny-hybrid" }') as d:
            c = kvpool.Client.connect(d.dir, client_name="states", kv_access=True)
            self.addCleanup(c.close)
            layout = c.mapping.layout
            # 4 working states, and for the prefix cache's state checkpoints a quarter of the
            # bytes left (shape.checkpoint_slots unset)
            slot = layout.state_slot_bytes
            self.assertEqual(layout.num_state_slots, 4 + (33554432 - 4 * slot) // 4 // slot)
            self.assertEqual(layout.num_layers, 1)  # K/V of the one attention layer only
            seq = c.allocate_one([], num_tokens=0)
            self.assertIsNotNone(seq.state_slot)
            state = c.mapping.state(seq.state_slot)
            self.assertEqual(len(state), layout.state_slot_bytes // 4)
            self.assertTrue(all(v == 0.0 for v in state))  # the state of no tokens
            c.prefill(list(range(1, 21)), sequence_id=seq.id)
            after = bytes(state.cast("B"))
            self.assertTrue(any(after))  # the step advanced it in place
            child = c.fork(seq.id)
            self.assertNotEqual(child.state_slot, seq.state_slot)
            self.assertEqual(bytes(c.mapping.state(child.state_slot).cast("B")), after)
            with self.assertRaises(KvPoolError) as e:
                c.mapping.state(layout.num_state_slots)
            self.assertEqual(e.exception.code, C.OUT_OF_RANGE)
            del state


def _pattern(prefix, nbytes):
    h = 0
    for t in prefix:
        h = (h * 31 + t) % (1 << 61)
    return bytes((h >> (i % 48)) & 0xFF for i in range(nbytes))


def _write_token(client, seq, position):
    block, row = seq.slot(position, client.layout.block_size)
    for layer in range(client.layout.num_layers):
        for view in (client.mapping.k(layer, block), client.mapping.v(layer, block)):
            data = _pattern(seq.tokens[: position + 1], client.layout.row_bytes(layer, 0))
            view.cast("B")[row * len(data):(row + 1) * len(data)] = data


if __name__ == "__main__":
    unittest.main()
