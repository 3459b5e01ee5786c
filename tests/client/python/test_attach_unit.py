"""The attach framing, the runtime directory's checks and the mapping's checks without a daemon:
frames split across reads, with descriptors on the first byte; oversized, truncated and
unparsable frames; squatted, shared and symlinked runtime directories (refused before anything is
sent); attach responses whose descriptors or layout do not add up; a session's end against a
fake attach server (the pool unmapped before the Detach frame). Every failure closes the
descriptors it received."""

import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

import kvpool
import kvpool.client
from kvpool import KvPoolError, StatusCode
from kvpool._proto import attach_pb2, layout_pb2
from kvpool.attach import encode_frame, exchange, receive_frame
from kvpool.mapping import PoolMapping
from kvpool.runtime_dir import trusted_daemon_uid, untrusted_reason

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


def mappings_of(fd):
    """How many of this process's mappings map the file `fd` is open on (by device and inode)."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps
                   if line.split()[3:5] == [device, str(st.st_ino)])


class SessionEndTest(unittest.TestCase):
    """close() of a KV-access client attached to a fake attach server (a thread serving one
    connection in a private runtime directory) that maps nothing itself."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvpool-end-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        l = layout()
        self.arena = memfd(l.num_blocks * l.block_bytes)
        self.addCleanup(os.close, self.arena)
        self.generations = memfd(4 * l.num_blocks)
        self.addCleanup(os.close, self.generations)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(self.listener.close)
        self.listener.bind(os.path.join(self.dir, "attach.sock"))
        self.listener.listen(1)
        self.server = threading.Thread(target=self.serve)
        self.server.start()
        self.addCleanup(self.server.join, 10)

    def serve(self):
        connection, _ = self.listener.accept()
        with connection:
            receive_frame(connection, attach_pb2.AttachRequest(), time.monotonic() + 10)
            response = attach_pb2.AttachResponse(
                session_id=1, session_token="t" * 32, layout=layout(), kv_access=True,
                arena_kind=attach_pb2.ARENA_KIND_MEMFD,
                fds=[attach_pb2.FD_ROLE_ARENA, attach_pb2.FD_ROLE_GENERATION_TABLE])
            socket.send_fds(connection, [encode_frame(response)], [self.arena, self.generations])
            while connection.recv(64):  # until the client hangs up
                pass

    def test_the_pool_is_unmapped_before_the_detach_frame_is_sent(self):
        # The daemon ends a session on its Detach frame at once and may hand its blocks to
        # another tenant: when the frame leaves, this process must no longer map the pool.
        client = kvpool.Client.connect(self.dir, kv_access=True, timeout=10)
        self.assertEqual((mappings_of(self.arena), mappings_of(self.generations)), (1, 1))
        mapped_then = []
        send_detach = kvpool.client.send_detach

        def checked_send_detach(sock):
            mapped_then.append((mappings_of(self.arena), mappings_of(self.generations)))
            send_detach(sock)

        with mock.patch.object(kvpool.client, "send_detach", checked_send_detach):
            client.close()
        self.assertEqual(mapped_then, [(0, 0)], "(arena, generation table) mappings at Detach")
        self.assertTrue(client.closed)


def dir_stat(uid, mode):
    """An os.stat_result of a directory with that owner and permission bits."""
    return os.stat_result((stat.S_IFDIR | mode, 1, 1, 2, uid, uid, 4096, 0, 0, 0))


class RuntimeDirRuleTest(unittest.TestCase):
    """The trust rule itself (kvpool.runtime_dir, as proto/kvpool/v1/runtime_dir.cc), for any uid."""

    ME, OTHER, TRUSTED = 1000, 4242, 777

    def reason(self, directory, parent, trusted=()):
        return untrusted_reason("/x/kvpool", directory, parent, self.ME, trusted)

    def test_owner_root_me_or_trusted(self):
        tmp = dir_stat(0, 0o1777)
        for owner in (0, self.ME):
            self.assertIsNone(self.reason(dir_stat(owner, 0o700), tmp))
        self.assertIsNone(self.reason(dir_stat(self.TRUSTED, 0o755), tmp, [self.TRUSTED]))

    def test_someone_elses_directory_in_a_shared_parent_is_refused(self):
        for parent in (dir_stat(0, 0o1777), dir_stat(0, 0o777), dir_stat(0, 0o775),
                       dir_stat(self.OTHER, 0o755), None):
            why = self.reason(dir_stat(self.OTHER, 0o700), parent, [self.TRUSTED])
            self.assertIn("belongs to uid 4242", why)

    def test_placed_by_root_is_trusted(self):
        # systemd's /run/kvpool: made by root for the daemon's uid, in a parent only root writes.
        self.assertIsNone(self.reason(dir_stat(self.OTHER, 0o750), dir_stat(0, 0o755)))
        self.assertIsNone(self.reason(dir_stat(self.OTHER, 0o750), dir_stat(self.ME, 0o700)))

    def test_a_directory_others_may_write_is_refused_whoever_owns_it(self):
        for mode in (0o770, 0o707, 0o777, 0o1777):
            for owner in (0, self.ME, self.TRUSTED):
                why = self.reason(dir_stat(owner, mode), dir_stat(0, 0o755), [self.TRUSTED])
                self.assertIn("others may write to it", why)


SQUATTER = """
import socket, sys
path, reply = sys.argv[1], bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
s.listen(1)
s.settimeout(10)
print("ready", flush=True)
try:
    c, _ = s.accept()
except socket.timeout:
    print("received 0", flush=True)
    sys.exit(0)
c.settimeout(2)
got = b""
try:
    while len(got) < 4 or len(got) < 4 + int.from_bytes(got[:4], "little"):
        chunk = c.recv(4096)
        if not chunk:
            break
        got += chunk
except socket.timeout:
    pass
if reply:
    c.sendall(reply)
print("received", len(got), flush=True)
"""


@unittest.skipUnless(os.geteuid() == 0, "needs root to give a directory to another uid")
class SquattedRuntimeDirTest(unittest.TestCase):
    """Real directories given to uid 65534 (nobody), with a listener running as that uid in them:
    a squatter. The client must refuse the directory before it sends anything."""

    NOBODY = 65534

    def setUp(self):
        self.top = tempfile.mkdtemp(prefix="kvpool-squat-")
        self.addCleanup(shutil.rmtree, self.top, True)

    def runtime_dir(self, parent_mode, owner, mode=0o700):
        parent = os.path.join(self.top, "parent")
        os.mkdir(parent)
        os.chmod(parent, parent_mode)
        os.chmod(self.top, 0o755)
        path = os.path.join(parent, f"kvpool-{os.geteuid()}")
        os.mkdir(path)
        os.chown(path, owner, owner)
        os.chmod(path, mode)
        return path

    def squatter(self, path, reply=b""):
        """A listener at <path>/attach.sock running as nobody; returns a function that waits for
        it and says how many bytes the client sent it."""
        process = subprocess.Popen(
            [sys.executable, "-c", SQUATTER, os.path.join(path, "attach.sock"), reply.hex()],
            stdout=subprocess.PIPE, text=True, user=self.NOBODY, group=self.NOBODY)
        self.addCleanup(process.kill)
        self.assertEqual(process.stdout.readline().strip(), "ready")

        def received():
            # The client gave up without connecting: wake the listener so it reports.
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(os.path.join(path, "attach.sock"))
            except OSError:
                pass
            s.close()
            line = process.stdout.readline().strip()
            process.wait(timeout=10)
            process.stdout.close()
            return int(line.split()[1])
        return received

    def connect(self, path, **kwargs):
        with self.assertRaises(KvPoolError) as e:
            kvpool.Client.connect(path, timeout=5, **kwargs)
        return e.exception

    def test_a_squatted_directory_in_a_world_writable_parent_is_refused(self):
        path = self.runtime_dir(0o1777, self.NOBODY)  # /tmp/kvpool-<uid>, made by nobody
        received = self.squatter(path)
        error = self.connect(path)
        self.assertEqual(error.code, C.PERMISSION_DENIED, error.message)
        self.assertIn("belongs to uid 65534", error.message)
        self.assertEqual(received(), 0, "the attach request went to the squatter")

    def test_the_frontend_refuses_it_too(self):
        path = self.runtime_dir(0o1777, self.NOBODY)
        received = self.squatter(path)
        done = subprocess.run([sys.executable, "-m", "kvpool_frontend", f"--socket_dir={path}",
                               "--no_auth", "--port=0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=60)
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertIn("not trusting kvpoold's runtime directory", done.stderr)
        self.assertEqual(received(), 0, "the frontend's attach request went to the squatter")

    def test_a_uid_the_caller_trusts_is_attached_to(self):
        refusal = encode_frame(attach_pb2.AttachResponse(error="fake daemon", error_code=9))
        path = self.runtime_dir(0o1777, self.NOBODY)
        received = self.squatter(path, refusal)
        error = self.connect(path, trusted_daemon_uids=[self.NOBODY])
        self.assertEqual(error.code, C.FAILED_PRECONDITION, error.message)  # its answer
        self.assertIn("fake daemon", error.message)
        self.assertGreater(received(), 0)

    def test_a_directory_root_placed_for_the_daemon_is_trusted(self):
        self.assertEqual(trusted_daemon_uid(self.runtime_dir(0o755, self.NOBODY, 0o750)),
                         self.NOBODY)

    def test_shared_symlinked_and_plain_files_are_refused(self):
        path = self.runtime_dir(0o755, os.geteuid(), 0o770)
        error = self.connect(path)
        self.assertEqual(error.code, C.PERMISSION_DENIED)
        self.assertIn("others may write to it", error.message)
        os.chmod(path, 0o700)
        self.assertEqual(trusted_daemon_uid(path), os.geteuid())
        link = os.path.join(self.top, "link")
        os.symlink(path, link)
        error = self.connect(link)
        self.assertEqual(error.code, C.PERMISSION_DENIED)
        self.assertIn("symlink", error.message)
        plain = os.path.join(self.top, "file")
        open(plain, "w").close()
        self.assertEqual(self.connect(plain).code, C.PERMISSION_DENIED)
        self.assertEqual(self.connect(os.path.join(self.top, "absent")).code, C.UNAVAILABLE)


if __name__ == "__main__":
    unittest.main()
