#!/usr/bin/python3
"""The Python baseline of issue 16: SGLang's RadixCache algorithm
(python/sglang/srt/mem_cache/radix_cache.py: match_prefix with node splitting, insert,
evict over a heap of leaves by last_access_time, inc/dec_lock_ref, page_size) re-implemented
in plain Python, driving the same per-request work as `kvpool-replay` over a Mooncake trace:
match the longest cached prefix, lock it, allocate the rest (evicting as needed), insert the
page-aligned prompt (SGLang's cache_finished_req), unlock.

Written from the algorithm, not copied. Deviations from SGLang, each in SGLang's favour (they make
this baseline faster, so a ratio against it is conservative):
  - --value=tensor is SGLang's own layout: a node's value is a torch int64 tensor of per-token
    KV slot indices, and the allocator is its PagedTokenToKVPoolAllocator on the CPU (free
    pages in a tensor; alloc slices it and expands pages to slots; free takes
    torch.unique(slots // page_size) and concatenates it in front). Needs torch (Debian:
    python3-torch). --value=token keeps the same per-token indices in Python lists;
    --value=page keeps one index per page instead (same information for a paged allocator,
    less copying: the fastest baseline);
  - no torch, no metrics, no events (SGLang's enable_kv_cache_events is off by default);
  - eviction frees only the shortfall ("evicting as needed", the same work kvpool does). SGLang's
    scheduler asks evict() for the whole request (tree_cache.evict(num_tokens)); pass
    --evict=request for that, which evicts more and lowers the hit rate.
Hit accounting is kvpool-replay's: a 512-token trace block is a hit when every token of it
matched. A page-aligned cache never matches a prompt's last partial page, so the last trace block
of a prompt whose length is not a multiple of page_size is never a hit here (kvpool caches
partial blocks token-exactly): at page size 512 that lowers the hit rate visibly.

Only the cache operations are timed; the prompt's tokens are expanded (as kvpool's
workload::ExpandTokens does, token for token) before the clock starts.

  /usr/bin/python3 bench/sglang_radix_replay.py --trace=../shared/traces/mooncake/synthetic_trace.jsonl \
      --page_size=16 --capacity_blocks=1000
"""

import argparse
import heapq
import json
import sys
import time

import numpy as np

try:
    import torch
except ImportError:  # only --value=tensor needs it
    torch = None

TRACE_BLOCK_TOKENS = 512
VOCAB = 128000
_M64 = (1 << 64) - 1


def _splitmix_np(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _splitmix(x):
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_J = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)


def expand_tokens(request):
    """workload::ExpandTokens: token j of block id h = SplitMix(SplitMix(h) + j) % vocab."""
    ids = request["hash_ids"]
    bases = np.array([_splitmix(h & _M64) for h in ids], dtype=np.uint64)
    with np.errstate(over="ignore"):
        toks = _splitmix_np(bases[:, None] + _J[None, :]) % np.uint64(VOCAB)
    return toks.reshape(-1)[: request["input_length"]].astype(np.int64).tolist()


def read_trace(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- SGLang's RadixCache, re-implemented -------------------------------------------------


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time",
                 "hit_count")

    def __init__(self):
        self.children = {}
        self.parent = None
        self.key = None
        self.value = None  # KV slot indices: one per token (or per page, --value=page)
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.hit_count = 0

    def __lt__(self, other):
        return self.last_access_time < other.last_access_time


class PagedAllocator:
    """SGLang's paged token-to-KV allocator, reduced to its free list of pages. Values are
    per-token slot indices (page p holds slots p*ps .. p*ps+ps-1), or page indices when
    `per_page`."""

    def __init__(self, num_pages, page_size, per_page=False):
        self.ps = page_size
        self.per_page = per_page
        self.free_pages = list(range(num_pages))
        self._slots = None if per_page else [
            list(range(p * page_size, (p + 1) * page_size)) for p in range(num_pages)]

    def available_pages(self):
        return len(self.free_pages)

    def alloc(self, n):
        """n pages, as a value (slot or page indices), or None."""
        if n > len(self.free_pages):
            return None
        pages = self.free_pages[-n:] if n else []
        del self.free_pages[len(self.free_pages) - n:]
        if self.per_page:
            return pages
        out = []
        for p in pages:
            out += self._slots[p]
        return out

    def free(self, value):
        if self.per_page:
            self.free_pages.extend(value)
        else:
            ps = self.ps
            self.free_pages.extend([v // ps for v in value[::ps]])


class TensorPagedAllocator:
    """SGLang's PagedTokenToKVPoolAllocator on the CPU (no staging, no free groups): free pages
    in an int64 tensor; values are per-token slot tensors."""

    def __init__(self, num_pages, page_size):
        self.ps = page_size
        self.per_page = False
        self.tensor = True
        self.free_pages = torch.arange(1, num_pages + 1, dtype=torch.int64)
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def available_pages(self):
        return len(self.free_pages)

    def alloc(self, n):
        if n > len(self.free_pages):
            return None
        out_pages = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return (out_pages[:, None] * self.ps + self._offsets).reshape(-1)

    def free(self, value):
        if value.numel() == 0:
            return
        self.free_pages = torch.cat((torch.unique(value // self.ps), self.free_pages))


class RadixCache:
    def __init__(self, allocator, page_size):
        self.allocator = allocator
        self.page_size = page_size
        self.unit = page_size if allocator.per_page else 1  # tokens per value entry
        self.tensor = getattr(allocator, "tensor", False)
        self.reset()

    def reset(self):
        self.root = TreeNode()
        self.root.key = []
        self.root.value = torch.empty((0,), dtype=torch.int64) if self.tensor else []
        self.root.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def _child_key(self, key):
        return tuple(key[: self.page_size])

    def _key_match(self, key0, key1):
        ps = self.page_size
        n = min(len(key0), len(key1))
        i = 0
        while i < n:
            if key0[i:i + ps] != key1[i:i + ps]:
                break
            i += ps
        return i

    def match_prefix(self, key):
        """Returns (page indices of the longest cached page-aligned prefix, its last node)."""
        key = key[: len(key) // self.page_size * self.page_size]
        empty = torch.empty((0,), dtype=torch.int64) if self.tensor else []
        if not key:
            return empty, self.root
        value, node = self._match_prefix_helper(self.root, key)
        if self.tensor:
            return (torch.cat(value) if value else empty), node
        out = []
        for v in value:
            out += v
        return out, node

    def _match_prefix_helper(self, node, key):
        now = time.monotonic()
        node.last_access_time = now
        value = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            prefix_len = self._key_match(child.key, key)
            if prefix_len < len(child.key):
                new_node = self._split_node(child.key, child, prefix_len)
                value.append(new_node.value)
                node = new_node
                break
            value.append(child.value)
            node = child
            key = key[prefix_len:]
        return value, node

    def _split_node(self, key, child, split_len):
        u = self.unit
        new_node = TreeNode()
        new_node.children = {self._child_key(key[split_len:]): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.value = child.value[: split_len // u]
        child.parent = new_node
        child.key = child.key[split_len:]
        child.value = child.value[split_len // u:]
        if self.tensor:  # SGLang clones both halves
            new_node.value = new_node.value.clone()
            child.value = child.value.clone()
        new_node.parent.children[self._child_key(key)] = new_node
        return new_node

    def insert(self, key, value):
        """Inserts page-aligned `key` with its pages; returns how many tokens were cached."""
        node = self.root
        now = time.monotonic()
        node.last_access_time = now
        total = 0
        u = self.unit
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            node = child
            node.last_access_time = now
            prefix_len = self._key_match(node.key, key)
            total += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len // u:]
            if prefix_len < len(node.key):
                node = self._split_node(node.key, node, prefix_len)
        if key:
            new_node = TreeNode()
            new_node.parent = node
            new_node.key = key
            new_node.value = value.clone() if self.tensor else value
            node.children[self._child_key(key)] = new_node
            self.evictable_size_ += len(key)
        return total

    def _collect_leaves(self):
        out = []
        stack = [self.root]
        while stack:
            cur = stack.pop()
            if not cur.children:
                out.append(cur)
            else:
                stack.extend(cur.children.values())
        return out

    def evict(self, num_tokens):
        leaves = self._collect_leaves()
        heapq.heapify(leaves)
        evicted = 0
        while evicted < num_tokens and leaves:
            x = heapq.heappop(leaves)
            if x is self.root:
                break
            if x.lock_ref > 0:
                continue
            self.allocator.free(x.value)
            evicted += len(x.key)
            self._delete_leaf(x)
            if not x.parent.children and x.parent.lock_ref == 0:
                heapq.heappush(leaves, x.parent)
        return evicted

    def _delete_leaf(self, node):
        del node.parent.children[self._child_key(node.key)]
        self.evictable_size_ -= len(node.key)

    def inc_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
            node.lock_ref -= 1
            node = node.parent


# ---- the replay ---------------------------------------------------------------------------


class HitAccounting:
    """kvpool-replay's hit accounting over a replay's requests: a prompt block is a hit when the
    matched tokens reach its end (or the prompt's); only the cache calls' time is counted."""

    def __init__(self):
        self.requests = self.skipped = self.prompt_blocks = self.hit_blocks = 0
        self.prompt_tokens = self.hit_tokens = 0
        self.seconds = 0.0

    def record(self, request, num_tokens, matched, seconds):
        """One request; `matched` None: it could not be served (larger than the pool)."""
        self.seconds += seconds
        if matched is None:
            self.skipped += 1
            matched = 0
        self.requests += 1
        self.prompt_tokens += num_tokens
        self.hit_tokens += matched
        nb = len(request["hash_ids"])
        self.prompt_blocks += nb
        for b in range(nb):
            if matched >= min(num_tokens, (b + 1) * TRACE_BLOCK_TOKENS):
                self.hit_blocks += 1

    def result(self):
        return {
            "requests": self.requests,
            "skipped": self.skipped,
            "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_rate": self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0,
            "token_hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "seconds": self.seconds,
            "requests_per_s": self.requests / self.seconds if self.seconds else 0.0,
        }


class Replay(HitAccounting):
    def __init__(self, page_size, capacity_blocks, evict_mode="shortfall", value="token"):
        self.ps = page_size
        pages = capacity_blocks * TRACE_BLOCK_TOKENS // page_size
        if value == "tensor":
            self.allocator = TensorPagedAllocator(pages, page_size)
        else:
            self.allocator = PagedAllocator(pages, page_size, value == "page")
        self.cache = RadixCache(self.allocator, page_size)
        self.unit = self.cache.unit
        self.evict_mode = evict_mode
        HitAccounting.__init__(self)

    def serve(self, request, tokens):
        """One request, timed: match + lock, allocate (evicting), insert, unlock."""
        ps, u = self.ps, self.unit
        cache = self.cache
        t0 = time.perf_counter()
        prefix, last = cache.match_prefix(tokens)
        cache.inc_lock_ref(last)
        matched = len(prefix) * u
        need = -(-(len(tokens) - matched) // ps)  # pages, the partial last one included
        short = need - self.allocator.available_pages()
        if short > 0:
            cache.evict((need if self.evict_mode == "request" else short) * ps)
        value = self.allocator.alloc(need)
        if value is None:  # larger than the whole pool
            cache.dec_lock_ref(last)
            matched = None
        else:
            # cache_finished_req: free the unaligned tail page, insert the aligned prompt, free
            # what someone else cached meanwhile, unlock.
            aligned = len(tokens) // ps * ps
            if cache.tensor:
                # cache_finished_req: the request's slots, its aligned part copied for the tree
                all_value = torch.cat((prefix, value))
                aligned_value = all_value[: aligned // u].to(dtype=torch.int64, copy=True)
            else:
                all_value = prefix + value
                aligned_value = all_value[: aligned // u]
            if aligned < len(tokens):
                self.allocator.free(all_value[aligned // u:])
            cached = cache.insert(tokens[:aligned], aligned_value)
            if cached // u > len(prefix):
                self.allocator.free(all_value[len(prefix): cached // u])
            cache.dec_lock_ref(last)
        self.record(request, len(tokens), matched, time.perf_counter() - t0)


def replay(trace, page_size, capacity_blocks, limit=0, evict_mode="shortfall", value="token"):
    r = Replay(page_size, capacity_blocks, evict_mode, value)
    for k, request in enumerate(trace):
        if limit and k >= limit:
            break
        r.serve(request, expand_tokens(request))
    return r.result()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--capacity_blocks", type=int, default=1000,
                   help="cache capacity in 512-token blocks")
    p.add_argument("--limit", type=int, default=0, help="replay only this many requests")
    p.add_argument("--evict", choices=["shortfall", "request"], default="shortfall")
    p.add_argument("--value", choices=["tensor", "token", "page"], default="token",
                   help="a node's value: per-token slot indices in a torch tensor (SGLang's "
                        "layout and allocator) or a list, or page indices in a list")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.value == "tensor" and torch is None:
        print("--value=tensor needs torch (Debian: python3-torch)", file=sys.stderr)
        return 2
    res = replay(read_trace(a.trace), a.page_size, a.capacity_blocks, a.limit, a.evict, a.value)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
