"""A stand-in for kvpool.aio.AsyncClient, and a kvpool-frontend server over it in this process,
for the tests that drive the HTTP handlers without a daemon (test_frontend_properties.py).

FakeClient keeps a prefix cache per cache salt, as the daemon does across salts: a prompt's
reused_tokens is the longest prefix of it published under the same salt (at most all tokens but
the last), exact to the token, so the frontend's rounding to whole blocks is what the tests see.
Every generated token is 65 ("A").
"""

from __future__ import annotations

import asyncio
import types
from typing import Dict, List, Tuple

from aiohttp import test_utils

from kvpool_frontend.server import Frontend, Options
from kvpool_frontend.tokenizer import ByteTokenizer

BLOCK_SIZE = 16


class FakeClient:
    model_name = "tiny"
    model_vocab_size = 8192
    model_max_position = 4096
    session_id = 1
    runtime_dir = "/nonexistent/fake"

    def __init__(self, num_blocks: int = 1024):
        self.layout = types.SimpleNamespace(block_size=BLOCK_SIZE, num_blocks=num_blocks)
        self.published: Dict[str, List[Tuple[int, ...]]] = {}
        self.live: Dict[int, Tuple[str, List[int]]] = {}  # sequence id -> (salt, tokens)
        self.salts: List[str] = []                         # of every Prefill, in order
        self.samplings: list = []                          # of every Prefill, in order
        self.prefills = 0
        self.decodes = 0
        self._next_id = 1

    async def prefill(self, tokens, sequence_id=0, top_k=0, priority=0, timeout=None,
                      cache_salt="", sampling=None, logprobs=False):
        await asyncio.sleep(0)
        self.prefills += 1
        self.salts.append(cache_salt)
        self.samplings.append(sampling)
        tokens = list(tokens)
        reused = 0
        for done in self.published.get(cache_salt, []):
            n = 0
            while n < min(len(done), len(tokens) - 1) and done[n] == tokens[n]:
                n += 1
            reused = max(reused, n)
        sid, self._next_id = self._next_id, self._next_id + 1
        self.live[sid] = (cache_salt, tokens)
        return types.SimpleNamespace(sequence_id=sid, next_token=65, reused_tokens=reused,
                                     logprob=-0.5 if logprobs else 0.0,
                                     top=types.SimpleNamespace(tokens=self._top(top_k)))

    async def decode(self, items, top_k=0, timeout=None, sampling=None, logprobs=False):
        await asyncio.sleep(0)
        self.decodes += 1
        items = list(items)
        for sid, token in items:
            self.live[sid][1].append(token)
        return types.SimpleNamespace(next_tokens=[65] * len(items),
                                     logprobs=[-0.5] * len(items) if logprobs else [],
                                     top=[types.SimpleNamespace(tokens=self._top(top_k))
                                          for _ in items])

    async def free(self, sequence_ids, commit=False):
        for sid in sequence_ids:
            salt, tokens = self.live.pop(sid)
            if commit:
                self.published.setdefault(salt, []).append(tuple(tokens))

    async def ping(self):
        pass

    async def close(self):
        pass

    @staticmethod
    def _top(k):
        return [types.SimpleNamespace(token=65 + i, logprob=-0.5 * (i + 1)) for i in range(k)]


class InProcessFrontend:
    """A Frontend over a FakeClient behind aiohttp's test server on 127.0.0.1, on a loop of its
    own that the (synchronous) tests drive with run()."""

    def __init__(self, options: Options, client: FakeClient = None):
        self.loop = asyncio.new_event_loop()
        self.client = client or FakeClient()
        self.frontend = Frontend(self.client, ByteTokenizer(8192), "kvpool", "tiny", {}, options)

        async def start():
            server = test_utils.TestServer(self.frontend.app())
            http = test_utils.TestClient(server)
            await http.start_server()
            return http
        self.http = self.run(start())

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def request(self, method: str, path: str, **kwargs):
        """(status, headers, body bytes) of one request."""
        async def go():
            async with self.http.request(method, path, **kwargs) as response:
                return response.status, response.headers, await response.read()
        return self.run(go())

    def settle(self):
        """Lets the frees the handlers started finish."""
        self.run(asyncio.sleep(0))
        if self.frontend._frees:
            self.run(asyncio.gather(*self.frontend._frees, return_exceptions=True))

    def close(self):
        self.run(self.http.close())
        self.loop.close()
