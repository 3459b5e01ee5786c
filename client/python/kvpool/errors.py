"""KvPoolError: the one exception type of the kvpool package.

Every failure of an RPC, of the attach handshake, of the mapping or of an argument check raises
KvPoolError with the canonical code (grpc.StatusCode: the same numbering as absl and
google.rpc.Code) and, for RESOURCE_EXHAUSTED, the daemon's shortfall (kvpool.proto: trailing
metadata "kvpool-shortfall" = "<resource>:<blocks>"). A failed call changed nothing in the daemon.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import grpc

StatusCode = grpc.StatusCode

SHORTFALL_KEY = "kvpool-shortfall"

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def code_from_number(number: int) -> grpc.StatusCode:
    """The canonical code numbered `number`; UNKNOWN for a number outside them (or OK's 0)."""
    code = _BY_NUMBER.get(number)
    if code is None or code == grpc.StatusCode.OK:
        return grpc.StatusCode.UNKNOWN
    return code


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """What ran out (as the daemon names it, e.g. "pool", "session quota") and by how many blocks."""

    resource: str
    blocks: int

    @staticmethod
    def parse(text: str) -> Optional["Shortfall"]:
        """"<resource>:<blocks>" (the resource may contain ':'); None when it does not parse."""
        resource, colon, number = text.rpartition(":")
        if not colon or not resource:
            return None
        try:
            blocks = int(number)
        except ValueError:
            return None
        return Shortfall(resource, blocks)


class KvPoolError(Exception):
    """A failed kvpool operation.

    code: the canonical grpc.StatusCode. message: the daemon's (or this library's) explanation.
    shortfall: for RESOURCE_EXHAUSTED, what ran out and by how many blocks (None otherwise, or
    when the daemon sent none). metadata: the call's trailing metadata (structured details).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        shortfall: Optional[Shortfall] = None,
        metadata: Optional[Mapping[str, str]] = None,
    ):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.shortfall = shortfall
        self.metadata = dict(metadata or {})

    @property
    def code_name(self) -> str:
        return self.code.name

    @staticmethod
    def from_rpc_error(error: grpc.RpcError) -> "KvPoolError":
        """The error of a failed call (sync grpc.RpcError or grpc.aio.AioRpcError)."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        if not isinstance(code, grpc.StatusCode) or code == grpc.StatusCode.OK:
            code = grpc.StatusCode.UNKNOWN
        message = (error.details() if hasattr(error, "details") else None) or str(error)
        metadata = {}
        trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        for key, value in trailing or ():
            metadata[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        shortfall = None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and SHORTFALL_KEY in metadata:
            shortfall = Shortfall.parse(metadata[SHORTFALL_KEY])
        return KvPoolError(code, message, shortfall, metadata)


def invalid_argument(message: str) -> KvPoolError:
    return KvPoolError(grpc.StatusCode.INVALID_ARGUMENT, message)


def internal(message: str) -> KvPoolError:
    return KvPoolError(grpc.StatusCode.INTERNAL, message)
