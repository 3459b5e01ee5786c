"""PoolMapping: this process's view of kvpoold's pool arena and block generation table, built
from the descriptors received at attach (attach.proto), as client/pool_mapping.h does in C++.

ARENA_KIND_MEMFD (the CPU backend): the arena is mmap'd MAP_SHARED read-write: k()/v() return
views of the very pages the daemon and every other client see (memoryview, or numpy arrays with
k_array()/v_array() when numpy is installed). ARENA_KIND_CUDA_VMM / ARENA_KIND_CUDA_IPC: the arena
is imported through the CUDA driver by ctypes (kvpool.cuda) and k_address()/v_address() return
DEVICE pointers (host_accessible is False); copy_from_host()/copy_to_host() move bytes. The
generation table is always a read-only host mapping.

Generations: the daemon bumps a block's entry every time it hands the block out again. Every
accessor compares the caller's BlockRef against the current entry and raises
KvPoolError(FAILED_PRECONDITION) "block N was reused (generation X, you hold Y)" instead of
returning another sequence's KV. The check is a snapshot: it cannot stop a reuse that happens
after it returns; a block of a sequence the caller still holds is never reused.

The window group (layout.proto: num_window_layers > 0): a window layer's K/V live in window
blocks, numbered apart from the blocks; a sequence's window table (Sequence.window_table, -1 for
an entry released when it left the window) names them. window_k()/window_v()/window_block() (and
the _array, _address and window=True copy forms) address them; k()/v() refuse a window layer and
the window forms a main one (INVALID_ARGUMENT), since the two numberings address different bytes.
No shared table publishes window generations: the window accessors check the id, not the
generation; keep only entries of sequences you hold, updated by every reply.

Element types of the views: F32 is float32; F16 is float16 in numpy, raw uint16 bits in a
memoryview (memoryview has no half format); BF16 is raw uint16 bits in both (numpy has no
bfloat16: use bf16_to_f32 / f32_to_bf16).

Thread-safety: immutable after create(); accessors may be called from any thread. Ownership: owns
the mappings and the descriptors. close() unmaps; a view still referenced keeps its pages mapped
until it is released (Python cannot revoke a buffer), so drop views before closing.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import List, NamedTuple, Optional

import grpc

from kvpool._proto import attach_pb2
from kvpool.errors import KvPoolError
from kvpool.layout import K, V, Layout

try:
    import numpy as _np
except ImportError:  # numpy is optional
    _np = None


class BlockRef(NamedTuple):
    """One entry of a sequence's block table: the block's id and the generation it had when the
    daemon handed it to the sequence. (A NamedTuple: tables of them are built per call.)"""

    id: int
    generation: int


def _invalid(message: str) -> KvPoolError:
    return KvPoolError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _fd_size(fd: int) -> int:
    return os.fstat(fd).st_size


class PoolMapping:
    """See the module docstring. Create with PoolMapping.create()."""

    def __init__(self, layout: Layout, kind: int, arena_bytes: int, mapped_bytes: int):
        self.layout = layout
        self.kind = kind
        self.arena_bytes = arena_bytes
        self.mapped_bytes = mapped_bytes
        self._arena: Optional[mmap.mmap] = None
        self._generations: Optional[mmap.mmap] = None
        self._cuda = None
        self._fds: List[int] = []

    # --- Construction ---

    @staticmethod
    def create(attach: "attach_pb2.AttachResponse", fds: List[int]) -> "PoolMapping":
        """Maps the pool of the accepted `attach` response; `fds` are the descriptors that came
        with it, in the order of attach.fds. Takes ownership of `fds` whether or not it succeeds.
        Raises KvPoolError: INVALID_ARGUMENT (inconsistent layout or sizes, descriptors missing,
        duplicated or smaller than the layout needs, unknown arena kind), UNAVAILABLE (CUDA arena
        and no CUDA driver), RESOURCE_EXHAUSTED (no address space), INTERNAL (mmap or driver)."""
        fds = list(fds)
        try:
            layout = Layout(attach.layout)
            needed = layout.arena_bytes
            arena_bytes = attach.arena_bytes or needed
            if arena_bytes < needed:
                raise _invalid(
                    f"arena_bytes {arena_bytes} < the {needed} bytes the blocks and state slots need"
                )
            mapped_bytes = attach.mapped_bytes or arena_bytes
            if mapped_bytes < arena_bytes:
                raise _invalid(f"mapped_bytes {mapped_bytes} < arena_bytes {arena_bytes}")
            if len(fds) != len(attach.fds):
                raise _invalid(
                    f"the attach response lists {len(attach.fds)} descriptors but {len(fds)} arrived"
                )
            roles = {}
            for i, role in enumerate(attach.fds):
                if role not in (attach_pb2.FD_ROLE_ARENA, attach_pb2.FD_ROLE_GENERATION_TABLE):
                    raise _invalid(f"descriptor {i} has unknown role {role}")
                if role in roles:
                    raise _invalid(f"descriptor role {attach_pb2.FdRole.Name(role)} sent twice")
                roles[role] = fds[i]
            if attach_pb2.FD_ROLE_GENERATION_TABLE not in roles:
                raise _invalid("no generation table descriptor in the attach response")
            kind = attach.arena_kind
            if kind in (attach_pb2.ARENA_KIND_MEMFD, attach_pb2.ARENA_KIND_CUDA_VMM) and (
                attach_pb2.FD_ROLE_ARENA not in roles
            ):
                raise _invalid("no arena descriptor in the attach response")
            if kind not in (
                attach_pb2.ARENA_KIND_MEMFD,
                attach_pb2.ARENA_KIND_CUDA_VMM,
                attach_pb2.ARENA_KIND_CUDA_IPC,
            ):
                raise _invalid(f"unknown arena kind {kind}")
            m = PoolMapping(layout, kind, arena_bytes, mapped_bytes)
            m._fds, fds = fds, []
            try:
                m._map_generations(roles[attach_pb2.FD_ROLE_GENERATION_TABLE])
                m._map_arena(attach, roles.get(attach_pb2.FD_ROLE_ARENA))
            except BaseException:
                m.close()
                raise
            return m
        finally:
            for fd in fds:  # not handed to a mapping
                os.close(fd)

    def _map_generations(self, fd: int) -> None:
        table_bytes = self.layout.num_blocks * 4
        if _fd_size(fd) < table_bytes:
            raise _invalid(
                f"the generation table descriptor holds {_fd_size(fd)} bytes but the layout "
                f"needs {table_bytes}"
            )
        self._generations = self._mmap(fd, table_bytes, mmap.PROT_READ, "generation table")

    def _map_arena(self, attach, fd: Optional[int]) -> None:
        if self.kind == attach_pb2.ARENA_KIND_MEMFD:
            if _fd_size(fd) < self.mapped_bytes:
                raise _invalid(
                    f"the arena descriptor holds {_fd_size(fd)} bytes but the layout needs "
                    f"{self.mapped_bytes}"
                )
            self._arena = self._mmap(fd, self.mapped_bytes, mmap.PROT_READ | mmap.PROT_WRITE, "arena")
            return
        from kvpool import cuda  # only CUDA arenas need the driver

        if self.kind == attach_pb2.ARENA_KIND_CUDA_VMM:
            self._cuda = cuda.CudaMapping.import_vmm(fd, self.mapped_bytes, attach.device_ordinal)
        else:
            self._cuda = cuda.CudaMapping.open_ipc(attach.cuda_ipc_handle, attach.device_ordinal)

    @staticmethod
    def _mmap(fd: int, nbytes: int, prot: int, what: str) -> mmap.mmap:
        try:
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as e:
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if e.errno == 12  # ENOMEM
                else grpc.StatusCode.INTERNAL
            )
            raise KvPoolError(code, f"mmap of the {what} ({nbytes} bytes): {e.strerror}") from e

    def close(self) -> None:
        """Unmaps the pool and closes the descriptors. Idempotent."""
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None
        for name in ("_arena", "_generations"):
            m = getattr(self, name)
            if m is None:
                continue
            try:
                m.close()
            except BufferError:
                pass  # a view is still referenced: the pages go when it does
            setattr(self, name, None)
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def _abandon(self) -> None:
        """close() for a forked child (kvpool.client: fork): this process's own mappings and
        descriptors go, but a CUDA arena is only forgotten, as the driver cannot be used after
        fork."""
        self._cuda = None
        self.close()

    # --- Properties ---

    @property
    def host_accessible(self) -> bool:
        """True when the views below are host memory (memfd arena)."""
        return self.kind == attach_pb2.ARENA_KIND_MEMFD

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def closed(self) -> bool:
        return self._generations is None

    # --- Generations ---

    def generation(self, block: int) -> int:
        """The block's current generation in the shared table (0 for an id out of range)."""
        if self._generations is None:
            raise KvPoolError(grpc.StatusCode.FAILED_PRECONDITION, "the pool mapping is closed")
        if not 0 <= block < self.layout.num_blocks:
            return 0
        # An aligned 4-byte load: atomic, and ordered after the daemon's release store on x86.
        return struct.unpack_from("=I", self._generations, 4 * block)[0]

    def check_current(self, ref: BlockRef) -> None:
        """Returns when `ref` is in range and still has the generation the caller holds.
        Raises INVALID_ARGUMENT (negative id), OUT_OF_RANGE (id >= num_blocks),
        FAILED_PRECONDITION (reused, or the mapping is closed)."""
        if not isinstance(ref, BlockRef):
            raise _invalid(f"expected a BlockRef, got {type(ref).__name__}")
        if ref.id < 0:
            raise _invalid(f"negative block id {ref.id}")
        if ref.id >= self.layout.num_blocks:
            raise KvPoolError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"block {ref.id} is past the pool's {self.layout.num_blocks} blocks",
            )
        current = self.generation(ref.id)
        if current != ref.generation:
            raise KvPoolError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"block {ref.id} was reused (generation {current}, you hold {ref.generation})",
            )

    # --- Addresses (host or device) ---

    def _base_address(self) -> int:
        if self._cuda is not None:
            return self._cuda.device_ptr
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._host()))

    def _host(self) -> mmap.mmap:
        if self._arena is None:
            if self._cuda is not None:
                raise KvPoolError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the pool is on a GPU: use k_address()/v_address() or copy_to_host()",
                )
            raise KvPoolError(grpc.StatusCode.FAILED_PRECONDITION, "the pool mapping is closed")
        return self._arena

    def check_window_block(self, ref: BlockRef) -> None:
        """Returns when `ref` names a window block of the pool. Raises INVALID_ARGUMENT (not a
        BlockRef, or a negative id: -1 is a released entry) or OUT_OF_RANGE (id >=
        num_window_blocks; every id without a window group)."""
        if not isinstance(ref, BlockRef):
            raise _invalid(f"expected a BlockRef, got {type(ref).__name__}")
        if ref.id < 0:
            raise _invalid(
                f"window block id {ref.id} (-1: an entry released when it left the window)"
            )
        if ref.id >= self.layout.num_window_blocks:
            raise KvPoolError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"window block {ref.id} is past the pool's {self.layout.num_window_blocks} "
                "window blocks",
            )

    def _chunk_offset(self, layer: int, side: int, ref: BlockRef, window: bool = False) -> int:
        chunk = self.layout.chunk(layer, side)
        if self.layout.is_window_layer(layer) != window:
            raise _invalid(
                f"layer {layer} is in the pool's window group: address it with the window "
                "accessors and a window table entry"
                if not window
                else f"layer {layer} is not in the pool's window group: address it with k()/v() "
                "and a block table entry"
            )
        if window:
            self.check_window_block(ref)
            return self.layout.window_offset + ref.id * self.layout.window_block_bytes + chunk.offset
        self.check_current(ref)
        return ref.id * self.layout.block_bytes + chunk.offset

    def block_address(self, ref: BlockRef) -> int:
        """The block's first byte (a device pointer unless host_accessible)."""
        self.check_current(ref)
        return self._base_address() + ref.id * self.layout.block_bytes

    def k_address(self, layer: int, ref: BlockRef) -> int:
        return self._base_address() + self._chunk_offset(layer, K, ref)

    def v_address(self, layer: int, ref: BlockRef) -> int:
        return self._base_address() + self._chunk_offset(layer, V, ref)

    def window_k_address(self, layer: int, ref: BlockRef) -> int:
        """A window layer's K in window block `ref` (a device pointer unless host_accessible)."""
        return self._base_address() + self._chunk_offset(layer, K, ref, window=True)

    def window_v_address(self, layer: int, ref: BlockRef) -> int:
        return self._base_address() + self._chunk_offset(layer, V, ref, window=True)

    # --- Host views (memfd arenas) ---

    def state(self, slot: int) -> memoryview:
        """State slot `slot` (a sequence's SequenceInfo.state_slot): its state-space state, f32,
        state_slot_bytes / 4 values, writable. The daemon's model steps advance it in place.
        Raises OUT_OF_RANGE (no such slot; every slot without a state group)."""
        if not isinstance(slot, int) or not 0 <= slot < self.layout.num_state_slots:
            raise KvPoolError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"state slot {slot} is outside the pool's [0, {self.layout.num_state_slots})",
            )
        start = self.layout.state_offset + slot * self.layout.state_slot_bytes
        raw = memoryview(self._host())[start : start + self.layout.state_slot_bytes]
        return raw.cast("f")

    def block(self, ref: BlockRef) -> memoryview:
        """The block's bytes: [2 * num_layers] chunks of [block_size][num_kv_heads][head_dim]."""
        self.check_current(ref)
        start = ref.id * self.layout.block_bytes
        return memoryview(self._host())[start : start + self.layout.block_bytes]

    def window_block(self, ref: BlockRef) -> memoryview:
        """Window block `ref`'s bytes: the window layers' chunks, [2 * num_window_layers]."""
        self.check_window_block(ref)
        start = self.layout.window_offset + ref.id * self.layout.window_block_bytes
        return memoryview(self._host())[start : start + self.layout.window_block_bytes]

    def _view(self, layer: int, side: int, ref: BlockRef, window: bool = False) -> memoryview:
        chunk = self.layout.chunk(layer, side)
        start = self._chunk_offset(layer, side, ref, window)
        elements = self.layout.block_size * self.layout.num_kv_heads * self.layout.head_dim
        raw = memoryview(self._host())[start : start + elements * chunk.dtype.itemsize]
        return raw.cast(chunk.dtype.struct_format, shape=list(self.layout.shape))

    def k(self, layer: int, ref: BlockRef) -> memoryview:
        """Layer `layer`'s K of the block, shape (block_size, num_kv_heads, head_dim), writable.
        Raises as check_current(), plus INVALID_ARGUMENT / OUT_OF_RANGE for the layer."""
        return self._view(layer, K, ref)

    def v(self, layer: int, ref: BlockRef) -> memoryview:
        return self._view(layer, V, ref)

    def window_k(self, layer: int, ref: BlockRef) -> memoryview:
        """A window layer's K in window block `ref` (a window table entry), shaped as k().
        Raises as check_window_block(), plus INVALID_ARGUMENT (a layer not in the window group)
        and OUT_OF_RANGE (layer >= num_layers)."""
        return self._view(layer, K, ref, window=True)

    def window_v(self, layer: int, ref: BlockRef) -> memoryview:
        return self._view(layer, V, ref, window=True)

    def _array(self, layer: int, side: int, ref: BlockRef, window: bool = False):
        if _np is None:
            raise KvPoolError(
                grpc.StatusCode.FAILED_PRECONDITION, "numpy is not installed (python3-numpy)"
            )
        chunk = self.layout.chunk(layer, side)
        start = self._chunk_offset(layer, side, ref, window)
        count = self.layout.block_size * self.layout.num_kv_heads * self.layout.head_dim
        array = _np.frombuffer(
            self._host(), dtype=chunk.dtype.numpy_name, count=count, offset=start
        )
        return array.reshape(self.layout.shape)

    def k_array(self, layer: int, ref: BlockRef):
        """numpy view of layer `layer`'s K: (block_size, num_kv_heads, head_dim), writable."""
        return self._array(layer, K, ref)

    def v_array(self, layer: int, ref: BlockRef):
        return self._array(layer, V, ref)

    def window_k_array(self, layer: int, ref: BlockRef):
        """numpy view of a window layer's K in window block `ref`, as k_array()."""
        return self._array(layer, K, ref, window=True)

    def window_v_array(self, layer: int, ref: BlockRef):
        return self._array(layer, V, ref, window=True)

    def arena_array(self):
        """The whole arena as one numpy uint8 array, without any generation check (bulk reads
        and benchmarks; address blocks through k_array()/v_array() otherwise)."""
        if _np is None:
            raise KvPoolError(
                grpc.StatusCode.FAILED_PRECONDITION, "numpy is not installed (python3-numpy)"
            )
        return _np.frombuffer(self._host(), dtype=_np.uint8, count=self.arena_bytes)

    # --- Copies (any arena kind) ---

    def copy_from_host(self, layer: int, side: int, ref: BlockRef, data, window=False) -> None:
        """Writes `data` (bytes-like, at most the chunk's size) at the start of the chunk (of
        window block `ref` for a window layer, with window=True)."""
        data = memoryview(data).cast("B")
        chunk = self.layout.chunk(layer, side)
        if data.nbytes > chunk.nbytes:
            raise _invalid(f"{data.nbytes} bytes do not fit a {chunk.nbytes}-byte chunk")
        offset = self._chunk_offset(layer, side, ref, window)
        if self._cuda is not None:
            self._cuda.copy_from_host(self._cuda.device_ptr + offset, data)
        else:
            self._host()[offset : offset + data.nbytes] = data

    def copy_to_host(self, layer: int, side: int, ref: BlockRef, window=False) -> bytes:
        """The chunk's bytes, copied (window=True: a window layer's, in window block `ref`)."""
        chunk = self.layout.chunk(layer, side)
        offset = self._chunk_offset(layer, side, ref, window)
        if self._cuda is not None:
            return self._cuda.copy_to_host(self._cuda.device_ptr + offset, chunk.nbytes)
        return bytes(self._host()[offset : offset + chunk.nbytes])


def bf16_to_f32(bits):
    """numpy uint16 bfloat16 bits -> float32 (exact)."""
    return (_np.asarray(bits, dtype=_np.uint16).astype(_np.uint32) << 16).view(_np.float32)


def f32_to_bf16(values):
    """numpy float32 -> uint16 bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    x = _np.asarray(values, dtype=_np.float32).view(_np.uint32)
    rounded = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(_np.uint16)
    nan = _np.isnan(_np.asarray(values, dtype=_np.float32))
    return _np.where(nan, _np.uint16(0x7FC0), rounded)
