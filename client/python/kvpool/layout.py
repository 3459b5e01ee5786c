"""Layout: the pool's block-major layout (layout.proto, DESIGN.md §3) as this client uses it.

    block b            at arena + b * block_bytes
      layer l, K chunk at + offset(l, K)     // [block_size][num_kv_heads][head_dim] of dtype(l, K)
      layer l, V chunk at + offset(l, V)

Every chunk's offset, size and dtype come from one table built at construction, so a layout whose
dtype differs per layer or per side (K/V) changes only `_chunks()`. This client reads layouts of
one dtype and one chunk_bytes: chunk (l, side) sits at (2 * l + side) * chunk_bytes.

The window group (layout.proto, docs/hybrid-groups.md §2): the last num_window_layers layers (the
sliding-window ones) live in window blocks of their own, numbered apart from the blocks:

    window block w     at arena + window_offset + w * window_block_bytes
      window layer l, K chunk at + (2 * (l - first_window_layer) + 0) * chunk_bytes
      window layer l, V chunk at + (2 * (l - first_window_layer) + 1) * chunk_bytes

and block_bytes counts the other layers only. A layout is checked as strictly as the C++ client
does (client/pool_mapping.cc): the regions must not overlap, and a `layers` table, when the daemon
sends one, must agree with the table computed here.
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
_INT64_MAX = (1 << 63) - 1


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
        self._check_window_group(proto)
        self._table: List[Tuple[Chunk, Chunk]] = self._chunks()
        self._check_layers(proto)
        main_layers = self.num_layers - self.num_window_layers
        if self.block_bytes != 2 * main_layers * self.chunk_bytes:
            raise _invalid(
                f"pool layout block_bytes {self.block_bytes} != 2 * {main_layers} layers"
                f" * chunk_bytes {self.chunk_bytes}"
            )
        if self.num_window_layers > 0 and (
            self.window_block_bytes != 2 * self.num_window_layers * self.chunk_bytes
        ):
            raise _invalid(
                f"pool layout window_block_bytes {self.window_block_bytes} != 2 * "
                f"{self.num_window_layers} window layers * chunk_bytes {self.chunk_bytes}"
            )
        # The state group (models with state-space layers): slot s is state_slot_bytes at
        # state_offset + s * state_slot_bytes, after the blocks and window blocks. 0 slots: none.
        self.num_state_slots = proto.num_state_slots
        self.state_slot_bytes = proto.state_slot_bytes
        self.state_offset = proto.state_offset
        if (self.num_state_slots, self.state_slot_bytes, self.state_offset) != (0, 0, 0) and (
            self.num_state_slots <= 0
            or self.state_slot_bytes <= 0
            or self.state_slot_bytes % 4 != 0
            or self.state_offset < self.kv_end
            or self.state_offset + self.num_state_slots * self.state_slot_bytes > _INT64_MAX
        ):
            raise _invalid(
                f"invalid state slots in the pool layout: {self.num_state_slots} of "
                f"{self.state_slot_bytes} bytes at {self.state_offset} (blocks end at "
                f"{self.kv_end})"
            )

    def _check_window_group(self, proto) -> None:
        """The window group's fields: all 0 without one; with one, fewer layers than the pool's
        (the main blocks are the primary group), a non-negative block count, and a region after
        the blocks that fits 64-bit offsets."""
        self.num_window_layers = proto.num_window_layers
        self.num_window_blocks = proto.num_window_blocks
        self.window_block_bytes = proto.window_block_bytes
        self.window_offset = proto.window_offset
        self.first_window_layer = self.num_layers - self.num_window_layers
        fields = (self.num_window_layers, self.num_window_blocks, self.window_block_bytes,
                  self.window_offset)
        if self.num_window_layers == 0 and fields == (0, 0, 0, 0):
            return
        if (
            0 < self.num_window_layers < self.num_layers
            and self.num_window_blocks >= 0
            and self.window_block_bytes > 0
            and self.window_offset >= self.num_blocks * self.block_bytes
            and self.window_offset + self.num_window_blocks * self.window_block_bytes <= _INT64_MAX
        ):
            return
        raise _invalid(
            f"invalid window group in the pool layout: {self.num_window_layers} layers of "
            f"{self.num_layers}, {self.num_window_blocks} blocks of {self.window_block_bytes} "
            f"bytes at {self.window_offset}"
        )

    def _check_layers(self, proto) -> None:
        """A `layers` table the daemon sent must agree with the computed one (this client reads
        layouts of one dtype: a table that differs is a layout it cannot address)."""
        if len(proto.layers) == 0:
            return
        if len(proto.layers) != self.num_layers:
            raise _invalid(
                f"pool layout describes {len(proto.layers)} of its {self.num_layers} layers"
            )
        for i, (layer, (k, v)) in enumerate(zip(proto.layers, self._table)):
            if (layer.k_dtype, layer.v_dtype, layer.k_offset, layer.v_offset, layer.k_chunk_bytes,
                    layer.v_chunk_bytes) != (k.dtype, v.dtype, k.offset, v.offset, k.nbytes,
                                             v.nbytes):
                raise _invalid(
                    f"pool layout layer {i} is not the uniform layout this client reads: "
                    f"{layer}".replace("\n", " ")
                )

    @property
    def kv_end(self) -> int:
        """Where the KV regions end: the blocks', or the window blocks' (after them)."""
        if self.num_window_layers > 0:
            return self.window_offset + self.num_window_blocks * self.window_block_bytes
        return self.num_blocks * self.block_bytes

    @property
    def arena_bytes(self) -> int:
        """Bytes the blocks, the window blocks and the state slots take from the arena's start."""
        if self.num_state_slots > 0:
            return self.state_offset + self.num_state_slots * self.state_slot_bytes
        return self.kv_end

    def is_window_layer(self, layer: int) -> bool:
        """Whether layer `layer` keeps its K/V in window blocks (the window group's)."""
        return self.first_window_layer <= layer < self.num_layers

    def _chunks(self) -> List[Tuple[Chunk, Chunk]]:
        """[(K, V)] per layer. The one place that knows how layout.proto places chunks."""
        elements = self.block_size * self.num_kv_heads * self.head_dim
        if self.chunk_bytes < elements * self.dtype.itemsize:
            raise _invalid(
                f"pool layout chunk_bytes {self.chunk_bytes} < block_size * num_kv_heads * "
                f"head_dim * {self.dtype.itemsize} = {elements * self.dtype.itemsize}"
            )
        # A window layer's chunks are placed from the start of a window block.
        return [
            tuple(Chunk((2 * (layer if layer < self.first_window_layer
                              else layer - self.first_window_layer) + side) * self.chunk_bytes,
                        self.chunk_bytes, self.dtype)
                  for side in (K, V))
            for layer in range(self.num_layers)
        ]

    def chunk(self, layer: int, side: int) -> Chunk:
        """Layer `layer`'s K (side 0) or V (side 1) chunk, its offset from the start of its block
        (a window block for a window layer). Raises INVALID_ARGUMENT (negative layer,
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
