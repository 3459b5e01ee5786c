"""Request builders and response checks shared by the blocking and the asyncio clients: each RPC
is built and its response validated in one place, so Client and AsyncClient differ only in how
they wait."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, List, Optional, Sequence as Seq, Tuple, Union

import grpc

from kvpool._proto import kvpool_pb2
from kvpool.errors import KvPoolError, internal, invalid_argument
from kvpool.mapping import BlockRef


@dataclasses.dataclass
class Sequence:
    """A sequence's block table as the daemon returned it (SequenceInfo): for Allocate and Fork the
    full table; for Grow the changed tail, blocks[i] being table entry table_offset + i."""

    id: int
    num_tokens: int
    matched_tokens: int = 0  # Allocate only: prompt tokens already cached (a prefix hit)
    table_offset: int = 0
    blocks: List[BlockRef] = dataclasses.field(default_factory=list)
    # Its slot in the pool's state group (models with state-space layers; mapping.state()); None
    # without one.
    state_slot: Optional[int] = None
    # The window group (models with sliding-window layers; mapping.window_k()): the window table's
    # entries parallel to `blocks`, BlockRef(-1, 0) for one released when it left the window;
    # empty without a window group. window_released: the released run [begin, end) in entries of
    # the whole table (kvpool.proto SequenceInfo; apply_window_grow() applies it).
    window_blocks: List[BlockRef] = dataclasses.field(default_factory=list)
    window_released: Tuple[int, int] = (0, 0)

    @property
    def block_ids(self) -> List[int]:
        return [b.id for b in self.blocks]


@dataclasses.dataclass
class AllocateItem:
    """One sequence to allocate: `prompt` is matched against the prefix cache (of `cache_salt`'s
    sharing domain: kvpool.proto AllocateItem.cache_salt); `num_tokens` is the room to make (0:
    the prompt's length); `priority` the prefix-cache class [0, 4)."""

    prompt: Seq[int]
    num_tokens: int = 0
    priority: int = 0
    cache_salt: str = ""


def apply_grow(tail: Sequence, table: List[BlockRef]) -> None:
    """Applies a Grow tail to the table the caller holds: entry table_offset + i becomes
    tail.blocks[i]; earlier entries are unchanged. Raises INVALID_ARGUMENT (and leaves `table`
    unchanged) when table_offset > len(table): the held table is not the one the daemon grew."""
    if tail.table_offset < 0 or tail.table_offset > len(table):
        raise invalid_argument(
            f"grow tail starts at entry {tail.table_offset} of a {len(table)}-entry table"
        )
    # Replaces the entries the tail covers and appends those past the table's end.
    table[tail.table_offset : tail.table_offset + len(tail.blocks)] = tail.blocks


def apply_window_grow(tail: Sequence, window_table: List[BlockRef]) -> None:
    """apply_grow() for the window table the caller holds: the entries of the tail's released run
    become BlockRef(-1, 0) (the window slid past them since), then the tail applies. Raises
    INVALID_ARGUMENT (and leaves `window_table` unchanged) as apply_grow(), or when the tail lists
    blocks but no window table (a pool without a window group)."""
    if tail.blocks and not tail.window_blocks:
        raise invalid_argument(
            f"sequence {tail.id}: a grow tail without a window table (no window group?)"
        )
    if tail.table_offset < 0 or tail.table_offset > len(window_table):
        raise invalid_argument(
            f"grow tail starts at entry {tail.table_offset} of a {len(window_table)}-entry "
            "window table"
        )
    window_table[tail.table_offset : tail.table_offset + len(tail.window_blocks)] = (
        tail.window_blocks
    )
    begin, end = tail.window_released
    for entry in range(begin, min(end, len(window_table))):
        window_table[entry] = BlockRef(-1, 0)


def _window_refs(rpc: str, sequence_id: int, offset: int, n: int, ids, gens, begin: int,
                 end: int) -> List[BlockRef]:
    """A window tail checked as the C++ client does (client/block_ref.cc): as long as the block
    tail, the released run inside the table, -1 (generation 0) exactly inside it and in a
    trailing run of entries not allocated yet (a prefill in chunks takes them as it goes). Empty
    when there is none (no window group)."""
    if not ids and not gens and begin == 0 and end == 0:
        return []
    def malformed(what: str) -> KvPoolError:
        return internal(f"malformed {rpc} response from kvpoold: sequence {sequence_id}: {what}")
    if len(ids) != n or len(gens) != n:
        raise malformed(f"{n} blocks but {len(ids)} window block ids and {len(gens)} generations")
    if not 0 <= begin <= end <= offset + n:
        raise malformed(f"released window run [{begin}, {end}) outside {offset + n} entries")
    refs = []
    allocated = max((i + 1 for i, w in enumerate(ids) if w >= 0), default=0)
    for i, (w, g) in enumerate(zip(ids, gens)):
        released = begin <= offset + i < end or i >= allocated
        if (w != -1 or g != 0) if released else w < 0:
            raise malformed(f"window entry {offset + i} is {w} but the released run is "
                            f"[{begin}, {end})")
        refs.append(BlockRef(w, g))
    return refs


@contextlib.contextmanager
def building(what: str):
    """Turns protobuf's complaints about argument types and ranges into INVALID_ARGUMENT."""
    try:
        yield
    except KvPoolError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise invalid_argument(f"{what}: {e}") from None


def to_sequence(rpc: str, info) -> Sequence:
    if len(info.block_ids) != len(info.generations):
        raise internal(
            f"malformed {rpc} response from kvpoold: {len(info.block_ids)} block ids but "
            f"{len(info.generations)} generations"
        )
    if info.table_offset < 0 or any(b < 0 for b in info.block_ids):
        raise internal(f"malformed {rpc} response from kvpoold: negative offset or block id")
    released = (info.window_released_begin, info.window_released_end)
    return Sequence(
        id=info.sequence_id,
        num_tokens=info.num_tokens,
        matched_tokens=info.matched_tokens,
        table_offset=info.table_offset,
        blocks=[BlockRef(b, g) for b, g in zip(info.block_ids, info.generations)],
        state_slot=info.state_slot if info.HasField("state_slot") else None,
        window_blocks=_window_refs(rpc, info.sequence_id, info.table_offset, len(info.block_ids),
                                   info.window_block_ids, info.window_generations, *released),
        window_released=released,
    )


# --- Control ---

def allocate_request(items: Iterable[Union[AllocateItem, Seq[int]]]) -> kvpool_pb2.AllocateRequest:
    request = kvpool_pb2.AllocateRequest()
    with building("Allocate"):
        for item in items:
            out = request.items.add()
            if isinstance(item, AllocateItem):
                out.prompt.extend(item.prompt)
                out.num_tokens = item.num_tokens or len(item.prompt)
                out.priority = item.priority
                out.cache_salt = item.cache_salt
            else:  # a bare prompt
                out.prompt.extend(item)
                out.num_tokens = len(out.prompt)
    return request


def allocate_result(response, want: int) -> List[Sequence]:
    if len(response.sequences) != want:
        raise internal(f"malformed Allocate response: {len(response.sequences)} sequences for {want} items")
    return [to_sequence("Allocate", s) for s in response.sequences]


def grow_request(items: Iterable[Tuple[int, int]]) -> kvpool_pb2.GrowRequest:
    request = kvpool_pb2.GrowRequest()
    with building("Grow"):
        for sequence_id, num_tokens in items:
            request.sequence_ids.append(sequence_id)
            request.num_tokens.append(num_tokens)
    return request


def grow_result(request, response) -> List[Sequence]:
    n, r = len(request.sequence_ids), response
    window = bool(r.window_block_ids or r.window_generations or r.window_released_begin
                  or r.window_released_end)
    if (len(r.num_tokens) != n or len(r.table_offsets) != n or len(r.tail_lengths) != n
            or len(r.block_ids) != len(r.generations)
            or (window and (len(r.window_released_begin) != n or len(r.window_released_end) != n
                            or len(r.window_block_ids) != len(r.block_ids)
                            or len(r.window_generations) != len(r.block_ids)))):
        raise internal("malformed Grow response from kvpoold: arrays of the wrong length")
    out, start = [], 0
    for i in range(n):
        tail = r.tail_lengths[i]
        if tail < 0 or r.table_offsets[i] < 0 or start + tail > len(r.block_ids):
            raise internal("malformed Grow response from kvpoold: a tail outside the response")
        blocks = [BlockRef(b, g) for b, g in zip(r.block_ids[start : start + tail],
                                                  r.generations[start : start + tail])]
        seq = Sequence(id=request.sequence_ids[i], num_tokens=r.num_tokens[i],
                       table_offset=r.table_offsets[i], blocks=blocks)
        if window:
            seq.window_released = (r.window_released_begin[i], r.window_released_end[i])
            seq.window_blocks = _window_refs(
                "Grow", seq.id, seq.table_offset, tail, r.window_block_ids[start : start + tail],
                r.window_generations[start : start + tail], *seq.window_released)
        out.append(seq)
        start += tail
    if start != len(response.block_ids):
        raise internal("malformed Grow response from kvpoold: blocks left over")
    return out


def truncate_request(sequence_id: int, num_tokens: int):
    with building("Truncate"):
        return kvpool_pb2.TruncateRequest(sequence_id=sequence_id, num_tokens=num_tokens)


def fork_request(sequence_id: int):
    with building("Fork"):
        return kvpool_pb2.ForkRequest(sequence_id=sequence_id)


def commit_request(sequence_id: int, num_tokens: int, new_tokens: Seq[int] = ()):
    with building("Commit"):
        return kvpool_pb2.CommitRequest(
            sequence_id=sequence_id, num_tokens=num_tokens, new_tokens=list(new_tokens)
        )


def free_request(sequence_ids: Iterable[int], commit: bool):
    with building("Free"):
        return kvpool_pb2.FreeRequest(sequence_ids=list(sequence_ids), commit=bool(commit))


def match_prefix_request(tokens: Seq[int], cache_salt: str = ""):
    with building("MatchPrefix"):
        return kvpool_pb2.MatchPrefixRequest(tokens=list(tokens), cache_salt=cache_salt)


def pin_request(tokens: Seq[int] = (), sequence_id: int = 0, ttl_s: float = 0.0,
                priority: int = 0, cache_salt: str = ""):
    with building("Pin"):
        return kvpool_pb2.PinRequest(tokens=list(tokens), sequence_id=sequence_id,
                                     ttl_ms=int(ttl_s * 1000), priority=priority,
                                     cache_salt=cache_salt)


def renew_pin_request(pin_id: int, ttl_s: float):
    with building("RenewPin"):
        return kvpool_pb2.RenewPinRequest(pin_id=pin_id, ttl_ms=int(ttl_s * 1000))


# --- Compute ---

@dataclasses.dataclass
class Sampling:
    """How a step chooses the next token (kvpool.proto SamplingParams): OpenAI's parameters. All
    defaults: greedy. seed None: the daemon draws one per call (per stream for generate)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None


SamplingLike = Union[Sampling, dict, None]


def sampling_message(sampling: SamplingLike, what: str):
    """A SamplingParams message from a Sampling, a dict of its fields, or a message."""
    if isinstance(sampling, kvpool_pb2.SamplingParams):
        return sampling
    if isinstance(sampling, dict):
        unknown = set(sampling) - {f.name for f in dataclasses.fields(Sampling)}
        if unknown:
            raise invalid_argument(f"{what}: unknown sampling parameters {sorted(unknown)}")
        sampling = Sampling(**sampling)
    if not isinstance(sampling, Sampling):
        raise invalid_argument(f"{what}: sampling must be a kvpool.Sampling or a dict, "
                               f"not {type(sampling).__name__}")
    with building(what):
        message = kvpool_pb2.SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty)
        message.top_p = sampling.top_p
        if sampling.seed is not None:
            message.seed = sampling.seed
    return message


def prefill_request(tokens: Seq[int], sequence_id: int, top_k: int, priority: int,
                    cache_salt: str = "", sampling: SamplingLike = None, logprobs: bool = False):
    with building("Prefill"):
        request = kvpool_pb2.PrefillRequest(
            sequence_id=sequence_id, tokens=list(tokens), top_k=top_k, priority=priority,
            cache_salt=cache_salt, logprobs=logprobs,
        )
    if sampling is not None:
        request.sampling.CopyFrom(sampling_message(sampling, "Prefill"))
    return request


def decode_request(items: Iterable[Tuple[int, int]], top_k: int,
                   sampling: Union[SamplingLike, List[SamplingLike]] = None,
                   logprobs: bool = False):
    """`sampling`: None (greedy), one for every sequence, or a list with one per sequence."""
    request = kvpool_pb2.DecodeRequest()
    with building("Decode"):
        for sequence_id, token in items:
            request.sequence_ids.append(sequence_id)
            request.tokens.append(token)
        request.top_k = top_k
        request.logprobs = logprobs
    if sampling is not None:
        for one in (sampling if isinstance(sampling, (list, tuple)) else [sampling]):
            request.sampling.append(sampling_message(one, "Decode"))
    return request


def decode_result(request, response):
    if len(response.next_tokens) != len(request.sequence_ids):
        raise internal(
            f"Decode: {len(response.next_tokens)} tokens back for {len(request.sequence_ids)} sequences"
        )
    if request.logprobs and len(response.logprobs) != len(request.sequence_ids):
        raise internal(
            f"Decode: {len(response.logprobs)} log-probabilities back for "
            f"{len(request.sequence_ids)} sequences"
        )
    return response


def generate_request(prompt: Seq[int], max_tokens: int, sequence_id: int,
                     stop_tokens: Seq[int], priority: int, free_when_done: bool,
                     cache_salt: str = "", sampling: SamplingLike = None, logprobs: bool = False,
                     top_k: int = 0):
    with building("Generate"):
        request = kvpool_pb2.GenerateRequest(
            sequence_id=sequence_id, prompt=list(prompt), max_tokens=max_tokens,
            stop_tokens=list(stop_tokens), priority=priority, free_when_done=free_when_done,
            cache_salt=cache_salt, logprobs=logprobs, top_k=top_k,
        )
    if sampling is not None:
        request.sampling.CopyFrom(sampling_message(sampling, "Generate"))
    return request


# --- Admin ---

def list_sequences_result(response):
    if len(response.session_ids) != len(response.sequences):
        raise internal(
            f"malformed ListSequences response: {len(response.sequences)} sequences but "
            f"{len(response.session_ids)} owners"
        )
    for info in response.sequences:
        to_sequence("ListSequences", info)
    return response


def watch_request(from_seq: int, snapshot: bool, follow: bool, pool: str):
    with building("WatchEvents"):
        return kvpool_pb2.WatchEventsRequest(
            from_seq=from_seq, snapshot=snapshot, follow=follow, pool=pool
        )


def rpc_error(error: grpc.RpcError) -> KvPoolError:
    return KvPoolError.from_rpc_error(error)
