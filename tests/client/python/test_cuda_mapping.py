"""The CUDA mapping (kvpool.cuda): a Python process maps a kvpoold pool on the GPU through the
driver API by ctypes, writes a block's K through cuMemcpyHtoD, commits it, and a second process
reads the same bytes back through its own import. Skips without a GPU (no libcuda, or kvpoold
cannot start its CUDA backend); bench/gpu_check.sh runs it on a GPU machine."""

import ctypes
import os
import sys
import unittest

import kvpool
from kvpool._proto import attach_pb2
from kvpool_testing import Daemon, python_child, run


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _pattern(prompt, nbytes):
    return bytes((sum(prompt) * 131 + i * 7) & 0xFF for i in range(nbytes))


def child(mode: str, directory: str) -> int:
    prompt = list(range(1, 41))  # two full blocks and a partial one (40 of 48 tokens)
    with kvpool.Client.connect(directory, kv_access=True, client_name=f"cuda-{mode}") as c:
        m = c.mapping
        if m.host_accessible or m.kind not in (attach_pb2.ARENA_KIND_CUDA_VMM,
                                               attach_pb2.ARENA_KIND_CUDA_IPC):
            print(f"not a CUDA arena: kind {m.kind}")
            return 1
        seq = c.allocate_one(prompt)
        data = _pattern(prompt, c.layout.chunk_bytes)
        if mode == "write":
            for block in seq.blocks:
                for layer in range(c.layout.num_layers):
                    m.copy_from_host(layer, 0, block, data)
            c.commit(seq.id, len(prompt))
            print(f"written {m.k_address(0, seq.blocks[0]):#x}")
        else:
            good = all(m.copy_to_host(layer, 0, block) == data
                       for block in seq.blocks[: -(-seq.matched_tokens // c.layout.block_size)]
                       for layer in range(c.layout.num_layers))
            print(f"matched {seq.matched_tokens} {'same' if good else 'DIFFERENT'}")
    return 0


# bench/gpu_check.sh sets KVPOOL_REQUIRE_GPU=1: there, a missing GPU is a failure, not a skip.
REQUIRED = os.environ.get("KVPOOL_REQUIRE_GPU") == "1"


@unittest.skipUnless(_has_driver() or REQUIRED,
                     "no CUDA driver (libcuda.so.1): the CUDA mapping needs a GPU")
class CudaMappingTest(unittest.TestCase):
    def test_two_processes_share_kv_through_the_gpu_pool(self):
        try:
            daemon = Daemon("pool_bytes: 67108864 backend: \"cuda\"")
        except RuntimeError as e:
            if REQUIRED:
                raise
            self.skipTest(f"kvpoold cannot run its CUDA backend here: {e}")
        with daemon:
            rc, out = run(python_child("test_cuda_mapping.py", "write", daemon.dir))
            self.assertEqual(rc, 0, out)
            self.assertTrue(out.startswith("written 0x"), out)
            rc, out = run(python_child("test_cuda_mapping.py", "read", daemon.dir))
            self.assertEqual(rc, 0, out)
            self.assertEqual(out, "matched 40 same\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("write", "read"):
        sys.exit(child(sys.argv[1], sys.argv[2]))
    unittest.main()
