"""kvpool-frontend-keys: manage kvpool-frontend's keys file (auth.py says its format).

    kvpool-frontend-keys --keys_file=keys.json add alice [--group=ci] [--concurrent_requests=4]
        [--prompt_tokens=N] [--max_tokens=N] [--body_bytes=N]
    kvpool-frontend-keys --keys_file=keys.json remove alice
    kvpool-frontend-keys --keys_file=keys.json list

`add` draws a new random key, prints it once on stdout (it is not stored anywhere: only its
SHA-256 goes into the file) and writes the file anew (created with mode 0600 when absent; replaced
atomically, keeping its mode). A running frontend picks the change up on SIGHUP. Exits 0, 1 when
the file cannot be used or the name is taken or unknown, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys
import tempfile

from kvpool_frontend import auth

LIMIT_FLAGS = [f.name for f in dataclasses.fields(auth.Limits)]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="kvpool-frontend-keys",
                                description="Manage kvpool-frontend's API keys file.")
    p.add_argument("--keys_file", required=True)
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a key; prints the new key once")
    add.add_argument("name")
    add.add_argument("--group", default=None, help="share cached prompts with this group's keys")
    for name in LIMIT_FLAGS:
        add.add_argument(f"--{name}", type=int, default=None)
    remove = sub.add_parser("remove", help="remove a key by name")
    remove.add_argument("name")
    sub.add_parser("list", help="names, groups and limits (never keys)")
    return p.parse_args(argv)


def _read(path: str) -> dict:
    if not os.path.lexists(path):
        return {"keys": []}
    text = auth.read_keys_file(path)
    auth.KeyStore.parse(text, path)  # refuse to edit a file the frontend would refuse
    return json.loads(text)


def _write(path: str, doc: dict) -> None:
    """Replaces `path` atomically: a temporary file beside it (0600, or the old file's mode),
    fsync'd, renamed over it."""
    directory = os.path.dirname(os.path.abspath(path))
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o600
    fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=directory)
    try:
        os.fchmod(fd, mode & ~(stat.S_IWGRP | stat.S_IWOTH))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def add(path: str, args) -> int:
    doc = _read(path)
    if any(k.get("name") == args.name for k in doc.setdefault("keys", [])):
        print(f"kvpool-frontend-keys: {path} already has a key named {args.name!r}",
              file=sys.stderr)
        return 1
    key = auth.new_key()
    limits = {n: getattr(args, n) for n in LIMIT_FLAGS if getattr(args, n) is not None}
    doc["keys"].append(auth.entry_json(args.name, auth.hash_key(key), args.group, limits))
    auth.KeyStore.parse(json.dumps(doc), path)  # the new entry must be valid too
    _write(path, doc)
    print(key)
    return 0


def remove(path: str, args) -> int:
    doc = _read(path)
    keys = doc.get("keys", [])
    kept = [k for k in keys if k.get("name") != args.name]
    if len(kept) == len(keys):
        print(f"kvpool-frontend-keys: {path} has no key named {args.name!r}", file=sys.stderr)
        return 1
    doc["keys"] = kept
    _write(path, doc)
    return 0


def list_keys(path: str) -> int:
    doc = _read(path)
    for k in doc.get("keys", []):
        extras = [f"group={k['group']}"] if "group" in k else []
        extras += [f"{n}={v}" for n, v in sorted(k.get("limits", {}).items())]
        print(" ".join([k["name"], *extras]))
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "add":
            return add(args.keys_file, args)
        if args.command == "remove":
            return remove(args.keys_file, args)
        return list_keys(args.keys_file)
    except auth.KeysFileError as e:
        print(f"kvpool-frontend-keys: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvpool-frontend-keys: {args.keys_file}: {e.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
