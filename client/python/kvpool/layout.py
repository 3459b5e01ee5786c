"""Layout: the pool's block-major layout (layout.proto, DESIGN.md §3) as this client uses it.

    block b            at arena + b * block_bytes
      layer l, K chunk at + offset(l, K)     // [block_size][num_kv_heads][head_dim] of dtype(l, K)
      layer l, V chunk at + offset(l, V)

Every chunk's offset, size and dtype come from one table built at construction, so a layout whose
dtype differs per layer or per side (K/V) changes only `_chunks()`. Today's layout.proto has one
dtype and one chunk_bytes: chunk (l, side) sits at (2 * l + side) * chunk_bytes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import List, Tuple

import grpc

from kvpool._proto import layout_pb2
from kvpool.errors import KvPoolError

K = 0
V = 1


class DType(enum.IntEnum):
    """Storage type of K and V (layout.proto DType)."""

    F32 = layout_pb2.DTYPE_F32
    F16 = layout_pb2.DTYPE_F16
    BF16 = layout_pb2.DTYPE_BF16

    @property
    def itemsize(self) -> int:
        return 4 if self == DType.F32 else 2

    @property
    def struct_format(self) -> str:
        """memoryview/struct format of one element. BF16 has none: its raw bits, 'H'."""
        return {DType.F32: "f", DType.F16: "e", DType.BF16: "H"}[self]

    @property
    def numpy_name(self) -> str:
        """numpy dtype of one element; numpy has no bfloat16, so BF16 is its raw bits (uint16)."""
        return {DType.F32: "float32", DType.F16: "float16", DType.BF16: "uint16"}[self]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Where one layer's K or V sits inside a block."""

    offset: int  # bytes from the block's first byte
    nbytes: int  # bytes of the chunk (>= block_size * num_kv_heads * head_dim * itemsize)
    dtype: DType


def _invalid(message: str) -> KvPoolError:
    return KvPoolError(grpc.StatusCode.INVALID_ARGUMENT, message)


class Layout:
    """An immutable, validated pool layout. Thread-safe (read-only)."""

    def __init__(self, proto: "layout_pb2.PoolLayout"):
        """Raises KvPoolError(INVALID_ARGUMENT) for an inconsistent layout."""
        self.proto = layout_pb2.PoolLayout()
        self.proto.CopyFrom(proto)
        self.block_size = proto.block_size
        self.num_layers = proto.num_layers
        self.num_kv_heads = proto.num_kv_heads
        self.head_dim = proto.head_dim
        self.num_blocks = proto.num_blocks
        self.chunk_bytes = proto.chunk_bytes
        self.block_bytes = proto.block_bytes
        self.layout_hash = proto.layout_hash
        if min(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim,
               self.num_blocks, self.chunk_bytes) <= 0:
            raise _invalid(f"invalid pool layout: {proto}".replace("\n", " "))
        try:
            self.dtype = DType(proto.dtype)
        except ValueError:
            raise _invalid(f"pool layout has unknown dtype {proto.dtype}") from None
        self._table: List[Tuple[Chunk, Chunk]] = self._chunks()
        end = max(c.offset + c.nbytes for pair in self._table for c in pair)
        if end > self.block_bytes:
            raise _invalid(f"pool layout chunks end at byte {end} of a {self.block_bytes}-byte block")
        if self.block_bytes != 2 * self.num_layers * self.chunk_bytes:
            raise _invalid(
                f"pool layout block_bytes {self.block_bytes} != 2 * num_layers {self.num_layers}"
                f" * chunk_bytes {self.chunk_bytes}"
            )
        # The state group (models with state-space layers): slot s is state_slot_bytes at
        # state_offset + s * state_slot_bytes, after the blocks. 0 slots: none.
        self.num_state_slots = proto.num_state_slots
        self.state_slot_bytes = proto.state_slot_bytes
        self.state_offset = proto.state_offset
        if (self.num_state_slots, self.state_slot_bytes, self.state_offset) != (0, 0, 0) and (
            self.num_state_slots <= 0
            or self.state_slot_bytes <= 0
            or self.state_slot_bytes % 4 != 0
            or self.state_offset < self.num_blocks * self.block_bytes
        ):
            raise _invalid(
                f"invalid state slots in the pool layout: {self.num_state_slots} of "
                f"{self.state_slot_bytes} bytes at {self.state_offset}"
            )

    @property
    def arena_bytes(self) -> int:
        """Bytes the blocks and the state slots take from the arena's start."""
        if self.num_state_slots > 0:
            return self.state_offset + self.num_state_slots * self.state_slot_bytes
        return self.num_blocks * self.block_bytes

    def _chunks(self) -> List[Tuple[Chunk, Chunk]]:
        """[(K, V)] per layer. The one place that knows how layout.proto places chunks."""
        elements = self.block_size * self.num_kv_heads * self.head_dim
        if self.chunk_bytes < elements * self.dtype.itemsize:
            raise _invalid(
                f"pool layout chunk_bytes {self.chunk_bytes} < block_size * num_kv_heads * "
                f"head_dim * {self.dtype.itemsize} = {elements * self.dtype.itemsize}"
            )
        return [
            tuple(Chunk((2 * layer + side) * self.chunk_bytes, self.chunk_bytes, self.dtype)
                  for side in (K, V))
            for layer in range(self.num_layers)
        ]

    def chunk(self, layer: int, side: int) -> Chunk:
        """Layer `layer`'s K (side 0) or V (side 1) chunk. Raises INVALID_ARGUMENT (negative layer,
        side not 0 or 1) or OUT_OF_RANGE (layer >= num_layers)."""
        if not isinstance(layer, int) or layer < 0:
            raise _invalid(f"negative layer {layer}")
        if layer >= self.num_layers:
            raise KvPoolError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"layer {layer} is past the pool's {self.num_layers} layers",
            )
        if side not in (K, V):
            raise _invalid(f"side {side} is neither K (0) nor V (1)")
        return self._table[layer][side]

    def dtype_of(self, layer: int, side: int) -> DType:
        return self.chunk(layer, side).dtype

    def row_bytes(self, layer: int, side: int) -> int:
        """Bytes of one token's K (or V) of one layer: num_kv_heads * head_dim elements."""
        return self.num_kv_heads * self.head_dim * self.dtype_of(layer, side).itemsize

    @property
    def shape(self) -> Tuple[int, int, int]:
        """The shape of one chunk: (block_size, num_kv_heads, head_dim)."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def __repr__(self) -> str:
        return (
            f"Layout(block_size={self.block_size}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype.name}, num_blocks={self.num_blocks})"
        )
