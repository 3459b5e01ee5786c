#!/usr/bin/python3
"""Replays a Mooncake trace through SGLang's own RadixCache (its real radix_cache.py, not a
re-implementation) with a fast paged allocator, doing the same per-request work as
`kvpool-replay` and bench/sglang_radix_replay.py: match the longest cached prefix and lock it,
allocate the rest (evicting the shortfall), insert the page-aligned prompt as SGLang's
cache_finished_req does (free the unaligned tail and the duplicates), unlock. Only these cache
calls are timed; the prompt's tokens are expanded before the clock starts.

SGLang's code is not part of kvpool and is never copied into it: --sglang_path names a directory
from which `import sglang.srt.mem_cache.radix_cache` works, e.g. an SGLang checkout's python/
directory with SGLang's dependencies installed, or a scratch copy of radix_cache.py and
evict_policy.py beside stand-ins for the modules it imports only for events, metrics and host
caching. The calls follow SGLang's params API (MatchPrefixParams, InsertParams, EvictParams; late
2025 on). Needs torch (Debian: python3-torch).

The allocator keeps SGLang's value layout (a node's value is an int64 tensor of per-token slot
indices) but its free pages in a Python list: alloc slices the list and expands pages to slots,
free takes every page's first slot. That is cheaper than SGLang's PagedTokenToKVPoolAllocator
(torch.unique and torch.cat on every free), so the tree's own cost dominates the baseline.
Hit accounting is kvpool-replay's (see sglang_radix_replay.py).

  /usr/bin/python3 bench/sglang_real_replay.py --sglang_path=/tmp/sglang/python \\
      --trace=../shared/traces/mooncake/conversation_trace.jsonl --page_size=16 \\
      --capacity_blocks=1000 --json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_radix_replay as ours  # noqa: E402  (trace expansion and reading)

TRACE_BLOCK_TOKENS = ours.TRACE_BLOCK_TOKENS


class FastPagedAllocator:
    """Free pages in a Python list; values are per-token int64 slot tensors, as SGLang's."""

    def __init__(self, torch, num_pages, page_size):
        self.torch = torch
        self.page_size = page_size
        self.device = torch.device("cpu")
        self.free_pages = list(range(1, num_pages + 1))  # page 0 is SGLang's padding page
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def available_pages(self):
        return len(self.free_pages)

    def alloc(self, need_size):
        n = need_size // self.page_size
        if n > len(self.free_pages):
            return None
        pages = self.free_pages[len(self.free_pages) - n:]
        del self.free_pages[len(self.free_pages) - n:]
        pages = self.torch.tensor(pages, dtype=self.torch.int64)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, free_index):
        if free_index.numel() == 0:
            return
        self.free_pages.extend((free_index[:: self.page_size] // self.page_size).tolist())


class Replay(ours.HitAccounting):
    def __init__(self, sglang_path, page_size, capacity_blocks):
        sys.path.insert(0, sglang_path)
        import torch
        from sglang.srt.mem_cache import base_prefix_cache, cache_init_params, radix_cache
        self.torch = torch
        self.api = base_prefix_cache
        self.key = radix_cache.RadixKey
        self.ps = page_size
        self.allocator = FastPagedAllocator(
            torch, capacity_blocks * TRACE_BLOCK_TOKENS // page_size, page_size)
        self.cache = radix_cache.RadixCache(cache_init_params.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
            page_size=page_size))
        ours.HitAccounting.__init__(self)

    def _cache_ops(self, tokens):
        """One request's cache calls; returns the tokens matched (0 when it did not fit)."""
        ps, cache, allocator, api = self.ps, self.cache, self.allocator, self.api
        match = cache.match_prefix(api.MatchPrefixParams(key=self.key(tokens)))
        prefix, last = match.device_indices, match.last_device_node
        cache.inc_lock_ref(last)
        matched = len(prefix)
        need = -(-(len(tokens) - matched) // ps)  # pages, the partial last one included
        short = need - allocator.available_pages()
        if short > 0:
            cache.evict(api.EvictParams(num_tokens=short * ps))
        value = allocator.alloc(need * ps)
        if value is None:  # larger than the whole pool
            cache.dec_lock_ref(last)
            return None
        # cache_finished_req: the aligned part copied for the tree, the tail and the duplicates
        # (what another request cached meanwhile) freed, the lock released.
        aligned = len(tokens) // ps * ps
        all_value = self.torch.cat((prefix, value))
        values = all_value[:aligned].to(dtype=self.torch.int64, copy=True)
        if aligned < len(tokens):
            allocator.free(all_value[aligned:])
        result = cache.insert(api.InsertParams(key=self.key(tokens[:aligned]), value=values))
        allocator.free(all_value[matched:result.prefix_len])
        cache.dec_lock_ref(last)
        return matched

    def serve(self, request, tokens):
        t0 = time.perf_counter()
        matched = self._cache_ops(tokens)
        self.record(request, len(tokens), matched, time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sglang_path", required=True,
                   help="directory from which `import sglang.srt.mem_cache.radix_cache` works")
    p.add_argument("--trace", required=True)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--capacity_blocks", type=int, default=1000,
                   help="cache capacity in 512-token blocks")
    p.add_argument("--limit", type=int, default=0, help="replay only this many requests")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    r = Replay(a.sglang_path, a.page_size, a.capacity_blocks)
    for k, request in enumerate(ours.read_trace(a.trace)):
        if a.limit and k >= a.limit:
            break
        r.serve(request, ours.expand_tokens(request))
    res = r.result()
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
