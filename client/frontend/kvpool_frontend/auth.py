"""Who is asking: API keys, the keys file, and each key's sharing domain and limits.

Every request to /v1/* carries `Authorization: Bearer <key>` (unless the frontend runs with
--no_auth). The frontend stores no key, only its SHA-256: the key's hash is compared with every
stored hash in constant time (hmac.compare_digest, no early exit), so neither the answer's
content nor its timing says which stored hash came close.

The keys file (JSON, UTF-8; docs/frontend.md), read at start and again on SIGHUP:

    {
      "defaults": {"concurrent_requests": 4, "max_tokens": 1024},
      "keys": [
        {"name": "alice", "sha256": "<64 hex digits>"},
        {"name": "build-bot", "sha256": "<64 hex digits>", "group": "ci",
         "limits": {"concurrent_requests": 16, "prompt_tokens": 2048}}
      ]
    }

  name    [A-Za-z0-9._-], 1 to 64 characters, unique: how logs and errors name the key
  sha256  lowercase hex SHA-256 of the key's UTF-8 bytes, unique (kvpool-frontend-keys add)
  group   optional, same alphabet: keys of one group share cached prompts with each other
  limits  optional, per key, over "defaults", over the built-in DEFAULT_LIMITS (Limits below)

The file must be a regular file that no one but its owner may write (a writable keys file is a
way in): anything else, or any malformed entry, is refused as a whole with one line saying why.

Sharing domains (kvpool.proto cache_salt): a key's requests run under the salt "key:<sha256>",
or "group:<group>" when it has a group; --no_auth requests under "anonymous". A request's own
`cache_salt` field narrows that to "<salt>/<field>". Names and hashes never contain ':' or '/'
where it would matter, so no two (key or group, field) pairs share a salt: two keys share cached
blocks only through a group the file names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from typing import Dict, List, Optional

from kvpool_frontend.protocol import ApiError

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}", re.ASCII)
HASH = re.compile(r"[0-9a-f]{64}", re.ASCII)
# RFC 6750 b64token, at most 512 characters: what a Bearer header may carry.
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9\-._~+/]{1,512}=*) *", re.ASCII)
MAX_REQUEST_SALT_BYTES = 128  # "group:" + 64 + "/" + 128 stays within the daemon's 256 bytes
ANONYMOUS_SALT = "anonymous"
KEY_PREFIX = "kvp-"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one key may ask for. Every field is a positive integer."""

    concurrent_requests: int = 8      # its requests in flight at once; one more: 429
    prompt_tokens: int = 32768        # tokens of one prompt (after the chat template); more: 400
    max_tokens: int = 4096            # max_tokens one request may ask for; more: 400
    body_bytes: int = 1 << 20         # bytes of one request body; more: 413, before it is read

    @staticmethod
    def parse(obj, base: "Limits", where: str) -> "Limits":
        """`base` overridden by the JSON object `obj`. Raises KeysFileError."""
        if obj is None:
            return base
        if not isinstance(obj, dict):
            raise KeysFileError(f"{where}: limits must be an object")
        fields = {f.name for f in dataclasses.fields(Limits)}
        unknown = sorted(set(obj) - fields)
        if unknown:
            raise KeysFileError(f"{where}: unknown limit {unknown[0]!r} (known: "
                                f"{', '.join(sorted(fields))})")
        for name, value in obj.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KeysFileError(f"{where}: {name} must be an integer >= 1, not {value!r}")
        return dataclasses.replace(base, **obj)


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class Principal:
    """An authenticated caller: a key of the file, or the anonymous user of --no_auth."""

    name: str
    salt: str          # its sharing domain (module docstring)
    limits: Limits


class KeysFileError(Exception):
    """The keys file cannot be used; the message is one line naming the file and the problem."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random key: 256 bits, URL-safe, recognizable by its prefix."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="kvpool"'})


def bearer_token(header: Optional[str]) -> str:
    """The key of an `Authorization` header value. Raises ApiError 401 for a missing header, another
    scheme, or a token outside RFC 6750's alphabet or over 512 characters."""
    if header is None:
        raise unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
    match = _BEARER.fullmatch(header)
    if match is None:
        raise unauthorized("malformed Authorization header: expected 'Bearer <key>'")
    return match.group(1)


def request_salt(base: str, field) -> str:
    """The salt of a request of a caller whose salt is `base`, with the request's optional
    `cache_salt` field. Raises ApiError 400 for a field that is not a non-empty string of at most
    MAX_REQUEST_SALT_BYTES bytes of UTF-8."""
    if field is None:
        return base
    if not isinstance(field, str) or not field:
        raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
    try:
        size = len(field.encode("utf-8"))
    except UnicodeEncodeError:
        raise ApiError(400, "cache_salt is not valid Unicode", param="cache_salt") from None
    if size > MAX_REQUEST_SALT_BYTES:
        raise ApiError(400, f"cache_salt is {size} bytes; at most {MAX_REQUEST_SALT_BYTES}",
                       param="cache_salt")
    return f"{base}/{field}"


@dataclasses.dataclass(frozen=True)
class _Entry:
    digest: bytes     # the stored hash as ASCII hex
    principal: Principal


class KeyStore:
    """The keys of one keys file, immutable once loaded (a reload builds a new one)."""

    def __init__(self, entries: List[_Entry]):
        self._entries = entries

    @property
    def names(self) -> List[str]:
        return [e.principal.name for e in self._entries]

    def max_body_bytes(self) -> int:
        return max((e.principal.limits.body_bytes for e in self._entries),
                   default=DEFAULT_LIMITS.body_bytes)

    def authenticate(self, header: Optional[str]) -> Principal:
        """The principal whose key the `Authorization` header value carries. Raises ApiError 401.
        Every stored hash is compared, in constant time each, whatever matched."""
        digest = hash_key(bearer_token(header)).encode("ascii")
        found = None
        for entry in self._entries:
            if hmac.compare_digest(entry.digest, digest):
                found = entry.principal
        if found is None:
            raise unauthorized("invalid API key")
        return found

    @staticmethod
    def parse(text: str, where: str = "keys file") -> "KeyStore":
        """Builds the store from the file's text. Raises KeysFileError."""
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise KeysFileError(f"{where}: not JSON: {e}") from None
        if not isinstance(doc, dict) or set(doc) - {"defaults", "keys"}:
            raise KeysFileError(f'{where}: expected an object with "keys" (and "defaults")')
        defaults = Limits.parse(doc.get("defaults"), DEFAULT_LIMITS, f"{where}: defaults")
        keys = doc.get("keys", [])
        if not isinstance(keys, list):
            raise KeysFileError(f'{where}: "keys" must be a list')
        entries: List[_Entry] = []
        seen_names, seen_hashes = set(), set()
        for i, obj in enumerate(keys):
            entry = _parse_entry(obj, defaults, f"{where}: keys[{i}]")
            name, digest = entry.principal.name, entry.digest
            if name in seen_names:
                raise KeysFileError(f"{where}: keys[{i}]: the name {name!r} is used twice")
            if digest in seen_hashes:
                raise KeysFileError(f"{where}: keys[{i}] ({name}): the same sha256 as another key")
            seen_names.add(name)
            seen_hashes.add(digest)
            entries.append(entry)
        return KeyStore(entries)

    @staticmethod
    def load(path: str) -> "KeyStore":
        """Reads and parses the keys file `path`. Raises KeysFileError."""
        return KeyStore.parse(read_keys_file(path), path)


def _parse_entry(obj, defaults: Limits, where: str) -> _Entry:
    if not isinstance(obj, dict):
        raise KeysFileError(f"{where}: each key must be an object")
    unknown = sorted(set(obj) - {"name", "sha256", "group", "limits"})
    if unknown:
        raise KeysFileError(f"{where}: unknown field {unknown[0]!r}")
    name, digest, group = obj.get("name"), obj.get("sha256"), obj.get("group")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise KeysFileError(f"{where}: name must be 1 to 64 of [A-Za-z0-9._-], not {name!r}")
    if not isinstance(digest, str) or not HASH.fullmatch(digest):
        raise KeysFileError(f"{where} ({name}): sha256 must be 64 lowercase hex digits")
    if group is not None and (not isinstance(group, str) or not NAME.fullmatch(group)):
        raise KeysFileError(f"{where} ({name}): group must be 1 to 64 of [A-Za-z0-9._-]")
    limits = Limits.parse(obj.get("limits"), defaults, f"{where} ({name})")
    salt = f"group:{group}" if group is not None else f"key:{digest}"
    return _Entry(digest.encode("ascii"), Principal(name, salt, limits))


def read_keys_file(path: str) -> str:
    """The text of the keys file, which must be a regular file no one but its owner may write.
    Raises KeysFileError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise KeysFileError(f"keys file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise KeysFileError(f"keys file {path}: not a regular file")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise KeysFileError(f"keys file {path}: others may write to it (mode "
                                f"{stat.S_IMODE(st.st_mode):o}): chmod go-w")
        raw = f.read(16 << 20)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KeysFileError(f"keys file {path}: not UTF-8") from None


def anonymous(limits: Limits) -> Principal:
    return Principal("anonymous", ANONYMOUS_SALT, limits)


def entry_json(name: str, digest: str, group: Optional[str], limits: Dict[str, int]) -> dict:
    """A keys-file entry (for the keys CLI)."""
    out = {"name": name, "sha256": digest}
    if group is not None:
        out["group"] = group
    if limits:
        out["limits"] = dict(limits)
    return out
