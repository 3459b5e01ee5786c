"""EngineHelper: the pool as a serving engine's KV manager, one batched call per engine step.

An engine that computes KV itself (it holds a KV-access session and writes through the mapping)
does, per step:

    admitted = helper.admit([prompt_a, prompt_b])   # one Allocate: prefix lookup + blocks
    # the KV of prompt[matched_tokens:] is the engine's to compute; write it at seq.slot(p)
    helper.reserve([(seq, seq.length + 1), ...])    # one Grow: room for this step's new tokens
    seq.append(token)                               # local: the engine wrote its KV
    helper.commit(seqs)                             # publish what was written (prefix cache)
    helper.release(finished)                        # one Free (commit=True publishes first)

The daemon hashes tokens itself; nothing here computes a block hash. Each call returns what an
engine needs: matched tokens, and block ids with generations (BlockRef) for the mapping, whose
accessors refuse a block whose generation moved on. Errors are the Client's (KvPoolError); a
failed admit/reserve/release changes nothing in the daemon (all or none) and nothing here.
Commit has no batched form in kvpool.proto: commit() sends one Commit per sequence, concurrently
(gRPC futures), so a step still waits one round trip; each either publishes or not.

Thread-safety: none; an EngineSequence belongs to the step loop that admitted it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Sequence as Seq, Tuple

import grpc

from kvpool import _calls
from kvpool._calls import AllocateItem, apply_grow, apply_window_grow
from kvpool.client import Client
from kvpool.errors import KvPoolError, invalid_argument
from kvpool.mapping import BlockRef


@dataclasses.dataclass
class EngineSequence:
    """One sequence as the engine tracks it.

    tokens: every token whose KV is (or is about to be) in the pool, in order: the prompt, then
    what append() added. matched_tokens: prompt tokens whose KV the prefix cache already held at
    admission (the engine computes only the rest). blocks: the block table. capacity: tokens the
    table has room for. published: leading tokens the daemon knows (the prompt, then commits).
    window_blocks: the window table (a pool with a window group; empty without one), parallel to
    blocks, BlockRef(-1, 0) for an entry released when it left the window.
    """

    id: int
    tokens: List[int]
    matched_tokens: int
    blocks: List[BlockRef]
    capacity: int
    published: int
    window_blocks: List[BlockRef] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def slot(self, position: int, block_size: int) -> Tuple[BlockRef, int]:
        """Where token `position`'s KV lives: its block and the row within it."""
        if not 0 <= position < self.capacity:
            raise invalid_argument(f"position {position} outside the sequence's {self.capacity} tokens")
        return self.blocks[position // block_size], position % block_size

    def window_slot(self, position: int, block_size: int) -> Tuple[BlockRef, int]:
        """Where token `position`'s KV of the window layers lives: its window block and the row
        within it. Raises INVALID_ARGUMENT outside the sequence, or where the window has released
        the entry (that token left every window layer's window) or there is no window group."""
        _, row = self.slot(position, block_size)  # checks the position
        entry = position // block_size
        if entry >= len(self.window_blocks) or self.window_blocks[entry].id < 0:
            raise invalid_argument(f"sequence {self.id} holds no window block for position "
                                   f"{position} (released, or no window group)")
        return self.window_blocks[entry], row

    def append(self, *tokens: int) -> None:
        """Records tokens whose KV the engine has written (within capacity)."""
        if self.length + len(tokens) > self.capacity:
            raise invalid_argument(
                f"sequence {self.id} has room for {self.capacity} tokens, not {self.length + len(tokens)}: "
                "reserve() first"
            )
        self.tokens.extend(tokens)


class EngineHelper:
    """See the module docstring. REQUIRES: a blocking kvpool.Client connected with
    kv_access=True (FAILED_PRECONDITION otherwise)."""

    def __init__(self, client: Client):
        if not isinstance(client, Client):
            raise KvPoolError(grpc.StatusCode.FAILED_PRECONDITION,
                              "EngineHelper drives a blocking kvpool.Client")
        if not client.kv_access:
            raise KvPoolError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "EngineHelper writes KV: connect the client with kv_access=True",
            )
        self.client = client
        self.block_size = client.layout.block_size

    def admit(self, prompts: Iterable[Seq[int]], extra_tokens: int = 0,
              priority: int = 0) -> List[EngineSequence]:
        """One Allocate for every prompt: each prompt matched against the prefix cache, and room
        for the prompt plus `extra_tokens`."""
        prompts = [list(p) for p in prompts]
        if extra_tokens < 0:
            raise invalid_argument(f"extra_tokens {extra_tokens} < 0")
        sequences = self.client.allocate(
            [AllocateItem(p, len(p) + extra_tokens, priority) for p in prompts])
        return [
            EngineSequence(id=s.id, tokens=p, matched_tokens=s.matched_tokens, blocks=s.blocks,
                           capacity=s.num_tokens, published=len(p), window_blocks=s.window_blocks)
            for s, p in zip(sequences, prompts)
        ]

    def reserve(self, items: Iterable[Tuple[EngineSequence, int]]) -> List[List[BlockRef]]:
        """One Grow: each sequence gets room for `num_tokens` tokens (no-op when it has it).
        Returns, per item, the blocks that are new to its table."""
        items = list(items)
        tails = self.client.grow([(seq.id, n) for seq, n in items])
        fresh = []
        for (seq, _), tail in zip(items, tails):
            before = len(seq.blocks)
            if tail.window_blocks or tail.window_released != (0, 0):  # a window group
                apply_window_grow(tail, seq.window_blocks)
            apply_grow(tail, seq.blocks)
            seq.capacity = tail.num_tokens
            fresh.append(seq.blocks[before:])
        return fresh

    def commit(self, sequences: Iterable[EngineSequence]) -> None:
        """Publishes every sequence's written tokens into the prefix cache (one Commit each, sent
        concurrently). Raises the first failure, after every call has finished."""
        pending = []
        for seq in sequences:
            if seq.published >= seq.length:
                continue
            request = _calls.commit_request(seq.id, seq.length, seq.tokens[seq.published:])
            future = self.client.stub.Commit.future(
                request, timeout=self.client.timeout, metadata=self.client.metadata)
            pending.append((seq, future))
        error: Optional[KvPoolError] = None
        for seq, future in pending:
            try:
                future.result()
                seq.published = seq.length
            except grpc.RpcError as e:
                error = error or _calls.rpc_error(e)
        if error is not None:
            raise error

    def release(self, sequences: Iterable[EngineSequence], commit: bool = True) -> None:
        """Frees the sequences in one call; with `commit`, what they wrote is published first."""
        sequences = list(sequences)
        if commit:
            self.commit(sequences)
        self.client.free([s.id for s in sequences], commit=commit)

    def lookup(self, prompts: Iterable[Seq[int]]) -> List[int]:
        """Cached leading tokens of each prompt, without taking anything (MatchPrefix: one call
        per prompt, sent concurrently; routers use it to pick a frontend)."""
        futures = [
            self.client.stub.MatchPrefix.future(
                _calls.match_prefix_request(p), timeout=self.client.timeout,
                metadata=self.client.metadata)
            for p in prompts
        ]
        out = []
        for f in futures:
            try:
                out.append(f.result().matched_tokens)
            except grpc.RpcError as e:
                raise _calls.rpc_error(e) from None
        return out
