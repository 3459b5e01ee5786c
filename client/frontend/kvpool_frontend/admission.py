"""Admission: which requests kvpool-frontend takes now, and which get 429 at once.

A pure policy object (no clock, no I/O, no event loop), driven call by call by the server and by
its test. Two kinds of slot:

  request slot  one per request of a key, at most Limits.concurrent_requests per key: taken right
                after authentication, before the body is read, and held until the response has
                been written (a client that stops reading keeps its slot until the stream's
                stall bound ends it).
  run slot      one per generation: taken once the request is parsed (prompt length and
                max_tokens known), before its Prefill, and held until its sequence is freed.
                At most `max_running` of them, and their blocks, ceil((prompt + max_tokens) /
                block_size) each, sum to at most `block_budget`.

A request that finds no slot is refused at once (429 with Retry-After), never queued: a refusal
costs the frontend nothing, and nothing already admitted waits for it or on it.

The bound, stated as what the sizing guarantees. Let W be the daemon's decode width
(limits.decode_width, by default model.max_step_tokens, 512), B the blocks the frontend's tenant
can hold (its pool's blocks, or its quota_blocks when lower, less what other sessions of the pool
keep ACTIVE), and Q the daemon's limits.queued_calls_per_session (64). If max_running <= W and
block_budget <= B, then no step of an admitted generation fails: a sequence of n tokens holds
ceil(n / block_size) blocks, so the running sequences together never hold more than the budget
(shared prefix blocks are counted once per sequence, which only overestimates); every Decode the
frontend sends carries at most max_running sequences (one call per top_k); and the frontend's
CallGate keeps its Prefill and Decode calls in flight below Q, queueing (not failing) the rest.
The defaults (main: --max_running 256, --kv_budget_blocks the pool's blocks, --daemon_calls 48)
hold that for a frontend alone in the daemon's default configuration.

Not thread-safe: one event loop.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

RETRY_AFTER_S = 1


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a request is not taken: HTTP status, an error code, a message; retry_after (seconds)
    for a 429, None for a request that can never run as it is."""

    status: int
    code: str
    message: str
    retry_after: Optional[int] = None


class Admission:
    """See the module docstring."""

    def __init__(self, max_running: int, block_budget: int, block_size: int):
        # REQUIRES: max_running >= 1, block_budget >= 1, block_size >= 1.
        self.max_running = max_running
        self.block_budget = block_budget
        self.block_size = block_size
        self._requests: Dict[str, int] = {}  # key name -> request slots held (none: absent)
        self.running = 0                     # run slots held
        self.reserved_blocks = 0             # blocks the run slots reserve, summed

    def requests(self, key: str) -> int:
        return self._requests.get(key, 0)

    def enter(self, key: str, limit: int) -> Optional[Refusal]:
        """Takes a request slot of `key`, which may hold `limit`; a Refusal (429) when it holds
        them all. On refusal nothing has changed."""
        held = self._requests.get(key, 0)
        if held >= limit:
            return Refusal(429, "too_many_requests",
                           f"this API key has {held} requests in flight, its limit: retry later",
                           RETRY_AFTER_S)
        self._requests[key] = held + 1
        return None

    def leave(self, key: str) -> None:
        """Gives back a request slot of `key`. REQUIRES: it holds one."""
        held = self._requests[key] - 1
        if held:
            self._requests[key] = held
        else:
            del self._requests[key]

    def blocks_for(self, prompt_tokens: int, max_tokens: int) -> int:
        """The blocks a generation can hold at most: its whole context, in blocks."""
        return -(-(prompt_tokens + max_tokens) // self.block_size)

    def start(self, blocks: int) -> Optional[Refusal]:
        """Takes a run slot reserving `blocks`; a Refusal when the frontend is full (429), or when
        `blocks` exceeds the whole budget (400: it could never run). On refusal nothing has
        changed."""
        if blocks > self.block_budget:
            return Refusal(400, "request_too_large",
                           f"prompt + max_tokens need up to {blocks} KV blocks; this frontend "
                           f"runs at most {self.block_budget} at once: ask for fewer max_tokens")
        if self.running >= self.max_running:
            return Refusal(429, "overloaded",
                           f"kvpool-frontend is running {self.running} generations, its limit: "
                           f"retry later", RETRY_AFTER_S)
        if self.reserved_blocks + blocks > self.block_budget:
            return Refusal(429, "overloaded",
                           f"kvpool-frontend's running generations may use "
                           f"{self.reserved_blocks} of its {self.block_budget} KV blocks; this "
                           f"one needs up to {blocks}: retry later", RETRY_AFTER_S)
        self.running += 1
        self.reserved_blocks += blocks
        return None

    def finish(self, blocks: int) -> None:
        """Gives back a run slot that reserved `blocks`. REQUIRES: start(blocks) took it."""
        self.running -= 1
        self.reserved_blocks -= blocks

    def check_invariants(self) -> Optional[str]:
        """None when every bound of the module docstring holds; otherwise what is broken."""
        if not 0 <= self.running <= self.max_running:
            return f"running {self.running} outside [0, {self.max_running}]"
        if not 0 <= self.reserved_blocks <= self.block_budget:
            return f"reserved_blocks {self.reserved_blocks} outside [0, {self.block_budget}]"
        if self.running == 0 and self.reserved_blocks != 0:
            return f"{self.reserved_blocks} blocks reserved by no generation"
        if any(held <= 0 for held in self._requests.values()):
            return "a key holds a non-positive number of request slots"
        return None
