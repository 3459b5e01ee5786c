"""Writing a response to an HTTP client that may stop reading: the stall bound.

A client that stops reading a stream would otherwise keep its daemon sequence (and its pool
blocks, and its admission slots) for as long as its connection lives: a write to it just waits
for buffer room that never comes. So every response the frontend writes goes through a
BoundedWriter:

  buffer  the connection's kernel send buffer is set to `buffer_bytes` (SO_SNDBUF; Linux keeps
          about twice that) and its transport pauses the writer past `buffer_bytes` queued. So
          the frontend holds at most about 3 x buffer_bytes that a client has not taken (plus
          what its own receive buffer holds), and it stops generating once that is full: the
          next token is decoded only after the last one was handed to the connection.
  time    a write that waits for room longer than `stall_timeout` seconds (no byte of the
          backlog taken in that time) ends the response: the connection is aborted and the
          caller gets ClientStalled, and frees the sequence.

A client that reads, however slowly, never waits more than stall_timeout for one drain (the
transport resumes below a quarter of buffer_bytes). Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web

log = logging.getLogger("kvpool.frontend")


class ClientStalled(Exception):
    """The client took nothing of the response for the stall timeout; the connection is closed."""


class BoundedWriter:
    """Writes one response under the bounds of the module docstring."""

    def __init__(self, request: web.Request, response: web.StreamResponse, buffer_bytes: int,
                 stall_timeout: float):
        self._request = request
        self._response = response
        self._stall_timeout = stall_timeout
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            transport.set_write_buffer_limits(high=buffer_bytes)

    async def write(self, data: bytes) -> None:
        """Writes `data`, waiting for room at most the stall timeout. Raises ClientStalled (the
        connection is aborted), ConnectionResetError (the client went away)."""
        await self._guard(self._write_and_drain(data))

    async def finish(self) -> None:
        """Ends the response (write_eof), under the same bound."""
        await self._guard(self._response.write_eof())

    async def _write_and_drain(self, data: bytes) -> None:
        await self._response.write(data)
        await self._request.writer.drain()  # returns at once unless the transport is paused

    async def _guard(self, coroutine) -> None:
        try:
            async with asyncio.timeout(self._stall_timeout):
                await coroutine
        except TimeoutError:
            transport = self._request.transport
            if transport is not None:
                transport.abort()
            peer = self._request.remote
            log.info("a client (%s) took nothing for %.1f s: response cancelled", peer,
                     self._stall_timeout)
            raise ClientStalled() from None
