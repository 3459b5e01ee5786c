"""The attach framing and the mapping's checks without a daemon: frames split across reads, with
descriptors on the first byte; oversized, truncated and unparsable frames; attach responses whose
descriptors or layout do not add up. Every failure closes the descriptors it received."""

import os
import socket
import struct
import threading
import time
import unittest

import kvpool
from kvpool import KvPoolError, StatusCode
from kvpool._proto import attach_pb2, layout_pb2
from kvpool.attach import encode_frame, exchange, receive_frame
from kvpool.mapping import PoolMapping

C = StatusCode


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def open_test_memfds():
    """How many descriptors of this process are memfds this test made."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:kvpool-test")
        except OSError:
            pass  # the directory's own descriptor, gone by now
    return count


def layout(num_blocks=4):
    chunk = 16 * 2 * 8 * 2  # block_size 16, 2 heads of 8, bf16
    return layout_pb2.PoolLayout(block_size=16, num_layers=2, num_kv_heads=2, head_dim=8,
                                 dtype=layout_pb2.DTYPE_BF16, num_blocks=num_blocks,
                                 chunk_bytes=chunk, block_bytes=4 * chunk)


def memfd(nbytes):
    fd = os.memfd_create("kvpool-test")
    os.ftruncate(fd, nbytes)
    return fd


class FramingTest(unittest.TestCase):
    def setUp(self):
        self.a, self.b = socket.socketpair()
        self.addCleanup(self.a.close)
        self.addCleanup(self.b.close)

    def test_a_frame_in_pieces_with_descriptors(self):
        response = attach_pb2.AttachResponse(session_id=7, session_token="t" * 32)
        frame = encode_frame(response)
        fd = memfd(4096)
        self.addCleanup(os.close, fd)

        def send():
            socket.send_fds(self.a, [frame[:3]], [fd])
            time.sleep(0.01)
            self.a.sendall(frame[3:])

        thread = threading.Thread(target=send)
        thread.start()
        got = attach_pb2.AttachResponse()
        fds = receive_frame(self.b, got, time.monotonic() + 5)
        thread.join()
        self.assertEqual(got.session_id, 7)
        self.assertEqual(len(fds), 1)
        self.assertEqual(os.fstat(fds[0]).st_size, 4096)
        os.close(fds[0])

    def test_the_detach_frame_is_an_empty_message(self):
        self.assertEqual(encode_frame(attach_pb2.Detach()), b"\0\0\0\0")

    def test_bad_frames_fail_and_close_their_descriptors(self):
        cases = [
            (struct.pack("<I", (1 << 20) + 1), C.INVALID_ARGUMENT),  # oversized
            (struct.pack("<I", 3) + b"\xff\xff\xff", C.INVALID_ARGUMENT),  # unparsable
        ]
        before = open_test_memfds()
        for frame, code in cases:
            fd = memfd(16)
            socket.send_fds(self.a, [frame], [fd])
            os.close(fd)
            with self.assertRaises(KvPoolError) as e:
                receive_frame(self.b, attach_pb2.AttachResponse(), time.monotonic() + 5)
            self.assertEqual(e.exception.code, code)
            self.b.setblocking(False)
            try:
                self.b.recv(65536)  # drop what the failed read left
            except BlockingIOError:
                pass
            self.b.setblocking(True)
        # Nothing received by the failed reads is still open in this process.
        self.assertEqual(open_test_memfds(), before)

    def test_a_closed_peer_and_a_silent_one(self):
        with self.assertRaises(KvPoolError) as e:
            receive_frame(self.b, attach_pb2.AttachResponse(), time.monotonic() + 0.05)
        self.assertEqual(e.exception.code, C.DEADLINE_EXCEEDED)
        self.a.sendall(b"\x05\0")  # half a length, then gone
        self.a.close()
        with self.assertRaises(KvPoolError) as e:
            receive_frame(self.b, attach_pb2.AttachResponse(), time.monotonic() + 5)
        self.assertEqual(e.exception.code, C.UNAVAILABLE)

    def test_a_refusal_sent_before_the_request_keeps_its_code(self):
        # A daemon refusing a peer at accept writes the refusal and hangs up, often before the
        # client has sent its request: the send fails (EPIPE) but the refusal is what counts.
        refusal = attach_pb2.AttachResponse(error="uid 7 gid 7 may not attach", error_code=7)
        self.a.sendall(encode_frame(refusal))
        self.a.close()
        request = attach_pb2.AttachRequest(client_name="refused")
        with self.assertRaises(KvPoolError) as e:
            exchange(self.b, "/run/kvpool/attach.sock", request, time.monotonic() + 5)
        self.assertEqual(e.exception.code, C.PERMISSION_DENIED)
        self.assertIn("may not attach", e.exception.message)

    def test_a_hang_up_before_the_request_without_answer_is_unavailable(self):
        self.a.close()
        with self.assertRaises(KvPoolError) as e:
            deadline = time.monotonic() + 5
            exchange(self.b, "/run/kvpool/attach.sock", attach_pb2.AttachRequest(), deadline)
        self.assertEqual(e.exception.code, C.UNAVAILABLE)


class MappingChecksTest(unittest.TestCase):
    def attach(self, **fields):
        r = attach_pb2.AttachResponse(layout=layout(), arena_kind=attach_pb2.ARENA_KIND_MEMFD,
                                      fds=[attach_pb2.FD_ROLE_ARENA,
                                           attach_pb2.FD_ROLE_GENERATION_TABLE], kv_access=True)
        for k, v in fields.items():
            if k == "fds":
                del r.fds[:]
                r.fds.extend(v)
            elif k == "layout":
                r.layout.CopyFrom(v)
            else:
                setattr(r, k, v)
        return r

    def create(self, response, fds):
        with self.assertRaises(KvPoolError) as e:
            PoolMapping.create(response, fds)
        for fd in fds:
            self.assertFalse(is_open(fd), "a descriptor was left open")
        return e.exception

    def test_a_good_response_maps(self):
        l = layout()
        m = PoolMapping.create(self.attach(), [memfd(l.num_blocks * l.block_bytes), memfd(16)])
        self.assertEqual(m.num_blocks, 4)
        self.assertEqual(m.generation(0), 0)
        self.assertEqual(m.k(1, kvpool.BlockRef(3, 0)).shape, (16, 2, 8))
        m.close()
        self.assertTrue(m.closed)

    def test_inconsistent_responses_are_refused(self):
        l = layout()
        arena = l.num_blocks * l.block_bytes
        bad_layout = layout()
        bad_layout.block_bytes += 1
        cases = [
            (self.attach(), [memfd(arena)], "lists 2 descriptors but 1 arrived"),
            (self.attach(fds=[1, 1]), [memfd(arena), memfd(arena)], "sent twice"),
            (self.attach(fds=[1, 9]), [memfd(arena), memfd(16)], "unknown role"),
            (self.attach(fds=[1]), [memfd(arena)], "no generation table"),
            (self.attach(), [memfd(arena - 1), memfd(16)], "arena descriptor holds"),
            (self.attach(), [memfd(arena), memfd(8)], "generation table descriptor holds"),
            (self.attach(arena_bytes=arena - 1), [memfd(arena), memfd(16)], "arena_bytes"),
            (self.attach(arena_kind=0), [memfd(arena), memfd(16)], "unknown arena kind"),
            (self.attach(layout=bad_layout), [memfd(arena), memfd(16)], "block_bytes"),
        ]
        for response, fds, message in cases:
            error = self.create(response, fds)
            self.assertEqual(error.code, C.INVALID_ARGUMENT, message)
            self.assertIn(message, error.message)


if __name__ == "__main__":
    unittest.main()
