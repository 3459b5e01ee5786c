"""The Python client's window group without a daemon (docs/hybrid-groups.md §2-§3): layouts with
a window region are accepted and checked as strictly as the C++ client checks them
(client/pool_mapping.cc); window layers are addressed in window blocks and only there; window
tables in SequenceInfo and GrowResponse are checked, split and applied like the C++ client's
(client/block_ref.cc)."""

import os
import unittest

from kvpool import BlockRef, KvPoolError, Layout, StatusCode, apply_window_grow
from kvpool._calls import Sequence, grow_request, grow_result, to_sequence
from kvpool._proto import attach_pb2, kvpool_pb2, layout_pb2
from kvpool.mapping import PoolMapping

C = StatusCode
CHUNK = 16 * 2 * 8 * 2  # block_size 16, 2 heads of 8, bf16: 512 bytes


def window_layout(**fields):
    """3 layers, the last 2 sliding: layer 0 in 4 blocks of 1 KiB, layers 1-2 in 3 window blocks
    of 2 KiB from byte 4096 (the daemon's page-aligned window_offset)."""
    l = layout_pb2.PoolLayout(block_size=16, num_layers=3, num_kv_heads=2, head_dim=8,
                              dtype=layout_pb2.DTYPE_BF16, num_blocks=4, chunk_bytes=CHUNK,
                              block_bytes=2 * CHUNK, num_window_layers=2, num_window_blocks=3,
                              window_block_bytes=4 * CHUNK, window_offset=4096)
    for k in (0, 0, 2 * CHUNK):  # the daemon's `layers`: window layers from a window block's start
        l.layers.add(k_dtype=layout_pb2.DTYPE_BF16, v_dtype=layout_pb2.DTYPE_BF16, k_offset=k,
                     v_offset=k + CHUNK, k_chunk_bytes=CHUNK, v_chunk_bytes=CHUNK)
    for name, value in fields.items():
        setattr(l, name, value)
    return l


def memfd(nbytes):
    fd = os.memfd_create("kvpool-test")
    os.ftruncate(fd, nbytes)
    return fd


class WindowLayoutTest(unittest.TestCase):
    def test_a_window_layout_is_accepted(self):
        l = Layout(window_layout())
        self.assertEqual(l.first_window_layer, 1)
        self.assertFalse(l.is_window_layer(0))
        self.assertTrue(l.is_window_layer(2))
        self.assertEqual(l.chunk(2, 1).offset, 3 * CHUNK)  # from the window block's start
        self.assertEqual(l.arena_bytes, 4096 + 3 * 4 * CHUNK)
        with_states = Layout(window_layout(num_state_slots=2, state_slot_bytes=64,
                                           state_offset=4096 + 3 * 4 * CHUNK))
        self.assertEqual(with_states.arena_bytes, 4096 + 3 * 4 * CHUNK + 128)

    def test_hostile_window_layouts_are_refused(self):
        bad = {
            "window_block_bytes": window_layout(window_block_bytes=3 * CHUNK),
            "inside the blocks": window_layout(window_offset=1024),
            "every layer": window_layout(num_window_layers=3, block_bytes=0),
            "negative count": window_layout(num_window_blocks=-1),
            "past 64 bits": window_layout(window_offset=2**63 - 1024),
            "fields without a group": window_layout(num_window_layers=0, block_bytes=6 * CHUNK),
            "main block_bytes": window_layout(block_bytes=4 * CHUNK),
            "state slots over the window blocks": window_layout(
                num_state_slots=1, state_slot_bytes=64, state_offset=4096),
        }
        moved = window_layout()
        moved.layers[1].k_offset = 2 * CHUNK  # a window layer that does not start its block
        bad["layers table"] = moved
        short = window_layout()
        del short.layers[2]
        bad["layers described"] = short
        for what, proto in bad.items():
            with self.assertRaises(KvPoolError, msg=what) as e:
                Layout(proto)
            self.assertEqual(e.exception.code, C.INVALID_ARGUMENT, what)


class WindowMappingTest(unittest.TestCase):
    def setUp(self):
        l = window_layout()
        self.arena = memfd(4096 + 3 * 4 * CHUNK)
        r = attach_pb2.AttachResponse(layout=l, arena_kind=attach_pb2.ARENA_KIND_MEMFD,
                                      fds=[attach_pb2.FD_ROLE_ARENA,
                                           attach_pb2.FD_ROLE_GENERATION_TABLE], kv_access=True)
        self.m = PoolMapping.create(r, [os.dup(self.arena), memfd(16)])
        self.addCleanup(self.m.close)
        self.addCleanup(os.close, self.arena)

    def byte_at(self, offset):
        return os.pread(self.arena, 1, offset)[0]

    def test_window_layers_land_in_their_window_blocks(self):
        for layer, side, at in ((1, 0, 0), (1, 1, CHUNK), (2, 0, 2 * CHUNK), (2, 1, 3 * CHUNK)):
            view = (self.m.window_k if side == 0 else self.m.window_v)(layer, BlockRef(2, 7))
            self.assertEqual(view.shape, (16, 2, 8))
            view[0, 0, 0] = 0x100 + 16 * layer + side
            raw = 4096 + 2 * 4 * CHUNK + at
            self.assertEqual(self.byte_at(raw), 16 * layer + side, (layer, side))
        self.m.copy_from_host(2, 1, BlockRef(1, 0), b"\x5a", window=True)
        self.assertEqual(self.byte_at(4096 + 4 * CHUNK + 3 * CHUNK), 0x5A)
        self.assertEqual(self.m.copy_to_host(2, 1, BlockRef(1, 0), window=True)[:1], b"\x5a")
        self.assertEqual(len(self.m.window_block(BlockRef(0, 0))), 4 * CHUNK)
        self.m.k(0, BlockRef(3, 0))[0, 0, 0] = 1  # the main layer still in the blocks

    def test_each_numbering_addresses_only_its_own_layers(self):
        cases = [
            (lambda: self.m.k(1, BlockRef(0, 0)), C.INVALID_ARGUMENT),  # window layer, block
            (lambda: self.m.window_v(0, BlockRef(0, 0)), C.INVALID_ARGUMENT),  # main layer
            (lambda: self.m.window_k(1, BlockRef(-1, 0)), C.INVALID_ARGUMENT),  # released
            (lambda: self.m.window_k(1, BlockRef(3, 0)), C.OUT_OF_RANGE),  # past the region
            (lambda: self.m.window_k(3, BlockRef(0, 0)), C.OUT_OF_RANGE),  # past the layers
            (lambda: self.m.window_block((0, 0)), C.INVALID_ARGUMENT),  # not a BlockRef
        ]
        for call, code in cases:
            with self.assertRaises(KvPoolError) as e:
                call()
            self.assertEqual(e.exception.code, code)


def window_info(ids, begin, end, offset=0):
    info = kvpool_pb2.SequenceInfo(sequence_id=7, num_tokens=16 * (offset + len(ids)),
                                   table_offset=offset, window_released_begin=begin,
                                   window_released_end=end)
    for w in ids:
        info.block_ids.append(20)
        info.generations.append(1)
        info.window_block_ids.append(w)
        info.window_generations.append(0 if w < 0 else 3)
    return info


class WindowTableTest(unittest.TestCase):
    def test_a_full_window_table_keeps_released_entries_in_place(self):
        seq = to_sequence("Allocate", window_info([4, -1, -1, 2], 1, 3))
        self.assertEqual(seq.window_blocks, [BlockRef(4, 3), BlockRef(-1, 0), BlockRef(-1, 0),
                                             BlockRef(2, 3)])
        self.assertEqual(seq.window_released, (1, 3))
        # Entries past the last window block: not allocated yet (a prefill in chunks).
        lagging = to_sequence("Allocate", window_info([4, -1, 5, -1], 1, 2))
        self.assertEqual(lagging.window_blocks[2:], [BlockRef(5, 3), BlockRef(-1, 0)])
        plain = kvpool_pb2.SequenceInfo(sequence_id=1, block_ids=[3], generations=[1])
        self.assertEqual(to_sequence("Allocate", plain).window_blocks, [])

    def test_window_tables_that_disagree_with_their_run_are_refused(self):
        bad = [window_info([4, 5, -1, 2], 1, 3),  # a live entry inside the run
               window_info([4, -1, -1, 2], 1, 2),  # a released entry outside it
               window_info([4, -1, -1, 2], 1, 5),  # a run past the table
               window_info([4, -1, -1, 2], 3, 1)]  # begin > end
        extra = window_info([4, -1, -1, 2], 1, 3)
        extra.window_block_ids.append(9)  # longer than the block table
        bad.append(extra)
        for info in bad:
            with self.assertRaises(KvPoolError) as e:
                to_sequence("Fork", info)
            self.assertEqual(e.exception.code, C.INTERNAL)

    def grow(self):
        """Sequence 7 grew by one entry (run [1, 3)); sequence 8 only slid (run [2, 4))."""
        r = kvpool_pb2.GrowResponse(num_tokens=[80, 64], table_offsets=[4, 4],
                                    tail_lengths=[1, 0], block_ids=[14], generations=[2],
                                    window_block_ids=[6], window_generations=[3],
                                    window_released_begin=[1, 2], window_released_end=[3, 4])
        return grow_request([(7, 80), (8, 64)]), r

    def test_grow_tails_carry_and_apply_each_items_window(self):
        seven, eight = grow_result(*self.grow())
        held = [BlockRef(4, 3), BlockRef(-1, 0), BlockRef(5, 3), BlockRef(2, 3)]
        apply_window_grow(seven, held)
        self.assertEqual(held, [BlockRef(4, 3), BlockRef(-1, 0), BlockRef(-1, 0), BlockRef(2, 3),
                                BlockRef(6, 3)])
        held = [BlockRef(1, 1), BlockRef(2, 1), BlockRef(3, 1), BlockRef(5, 1)]
        apply_window_grow(eight, held)
        self.assertEqual(held[2:], [BlockRef(-1, 0), BlockRef(-1, 0)])

    def test_misshapen_window_arrays_are_refused(self):
        request, good = self.grow()
        for mutate in (lambda r: r.window_block_ids.append(1),
                       lambda r: r.window_released_end.pop(),
                       lambda r: r.window_block_ids.__setitem__(0, -1),
                       lambda r: r.ClearField("window_block_ids")):
            r = kvpool_pb2.GrowResponse()
            r.CopyFrom(good)
            mutate(r)
            with self.assertRaises(KvPoolError) as e:
                grow_result(request, r)
            self.assertEqual(e.exception.code, C.INTERNAL)

    def test_apply_window_grow_leaves_the_held_table_alone_on_error(self):
        held = [BlockRef(4, 3)]
        past = Sequence(id=7, num_tokens=64, table_offset=3, blocks=[BlockRef(1, 1)],
                        window_blocks=[BlockRef(2, 1)])
        no_window = Sequence(id=7, num_tokens=32, table_offset=1, blocks=[BlockRef(1, 1)])
        for tail in (past, no_window):
            with self.assertRaises(KvPoolError) as e:
                apply_window_grow(tail, held)
            self.assertEqual(e.exception.code, C.INVALID_ARGUMENT)
        self.assertEqual(held, [BlockRef(4, 3)])


if __name__ == "__main__":
    unittest.main()
