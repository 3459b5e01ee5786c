"""kvpool-frontend --keys_file FILE | --no_auth [--socket_dir DIR] [--host H] [--port P]
                [--tenant T] [--served_model_name N] [--tokenizer auto|bytes|PATH]
                [--chat_template auto|kvpool|llama-2] [limits and bounds: --help]

Attaches to kvpoold (compute-only), then serves the OpenAI-compatible API (server.py) to the
holders of the API keys of --keys_file (auth.py; re-read on SIGHUP) until SIGTERM or SIGINT: it
then drains (new requests get 503, those in flight finish, at most --drain_timeout seconds),
says goodbye to the daemon and exits 0. Prints one line when it listens: "kvpool-frontend:
serving MODEL at http://HOST:PORT ...". Exits 1 when it cannot attach, the keys file cannot be
used, or the tokenizer does not fit the model, 2 for bad flags.
"""

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys

from aiohttp import web

import kvpool
import kvpool.aio
from kvpool_frontend import auth, chat, tokenizer
from kvpool_frontend.server import Frontend, Options

log = logging.getLogger("kvpool.frontend")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="kvpool-frontend", description=__doc__.split("\n\n")[1])
    p.add_argument("--socket_dir", default=None,
                   help="kvpoold's runtime directory (default: $XDG_RUNTIME_DIR/kvpool, else "
                        "/tmp/kvpool-$UID)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--tenant", default="default",
                   help="the tenant to attach as: frontends of one tenant and model share the "
                        "daemon's prefix cache")
    p.add_argument("--served_model_name", default=None,
                   help="the model name clients send (default: the daemon's model, or the "
                        "checkpoint directory's name)")
    p.add_argument("--tokenizer", default="auto",
                   help="auto (the checkpoint's tokenizer.model when there is one, else bytes), "
                        "bytes, or a tokenizer.model file or directory")
    p.add_argument("--chat_template", default="auto", choices=("auto",) + chat.TEMPLATES,
                   help="auto: llama-2 with a SentencePiece tokenizer, kvpool otherwise")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="deadline of each daemon call, seconds")
    p.add_argument("--drain_timeout", type=float, default=30.0)
    p.add_argument("--log_level", default="warning")
    p.add_argument("--trusted_daemon_uid", type=int, action="append", default=[],
                   help="a uid kvpoold may run as beyond root and ours (repeatable): the runtime "
                        "directory and the attach socket are checked against it")
    who = p.add_argument_group("who may ask (docs/frontend.md)")
    who.add_argument("--keys_file", default=None,
                     help="the API keys (JSON, SHA-256 of each key; kvpool-frontend-keys adds "
                          "them); re-read on SIGHUP")
    who.add_argument("--no_auth", action="store_true",
                     help="serve anyone who can reach the port, as one anonymous user: local "
                          "development only")
    bounds = p.add_argument_group("bounds (kvpool_frontend/admission.py says how to size them)")
    bounds.add_argument("--max_running", type=int, default=Options.max_running,
                        help="generations at once, at most the daemon's limits.decode_width "
                             "(default max_step_tokens, 512) and 4096; one more gets 429")
    bounds.add_argument("--kv_budget_blocks", type=int, default=0,
                        help="KV blocks the running generations may hold at most, counted as "
                             "ceil((prompt + max_tokens) / block_size) each; at most what the "
                             "tenant can hold (its quota_blocks). 0: the pool's blocks")
    bounds.add_argument("--daemon_calls", type=int, default=Options.daemon_calls,
                        help="Prefill and Decode calls in flight, below the daemon's "
                             "limits.queued_calls_per_session (64); more wait here")
    bounds.add_argument("--stream_buffer_bytes", type=int, default=Options.stream_buffer_bytes,
                        help="bytes of a response a client may leave unread before the "
                             "frontend stops generating for it")
    bounds.add_argument("--stall_timeout", type=float, default=Options.stall_timeout,
                        help="seconds a response may wait for its client to read before it is "
                             "cancelled and its sequence freed")
    bounds.add_argument("--body_timeout", type=float, default=Options.body_timeout,
                        help="seconds a request body may take to arrive (408 after)")
    args = p.parse_args(argv)
    if (args.keys_file is None) == (not args.no_auth):
        p.error("give --keys_file FILE (API keys) or, for local development, --no_auth")
    if not 1 <= args.max_running <= 4096:
        p.error("--max_running must be in [1, 4096] (the daemon's cache_salts_per_session)")
    for name in ("kv_budget_blocks",):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0")
    for name in ("daemon_calls", "stream_buffer_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    for name in ("stall_timeout", "body_timeout", "timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be > 0")
    return args


def options(args) -> Options:
    """The server's options from the flags. Raises auth.KeysFileError."""
    keys = auth.KeyStore.load(args.keys_file) if args.keys_file else None
    if keys is None:
        log.warning("--no_auth: anyone who can reach %s:%d is served, as one user sharing one "
                    "prefix cache; use --keys_file for more than local development", args.host,
                    args.port)
    return Options(
        keys=keys,
        anonymous_limits=dataclasses.replace(auth.DEFAULT_LIMITS,
                                             concurrent_requests=args.max_running),
        max_running=args.max_running, kv_budget_blocks=args.kv_budget_blocks,
        daemon_calls=args.daemon_calls, stream_buffer_bytes=args.stream_buffer_bytes,
        stall_timeout=args.stall_timeout, body_timeout=args.body_timeout)


def reload_keys(frontend: Frontend, path: str) -> None:
    """SIGHUP: the keys file again; a file that cannot be used leaves the old keys serving."""
    try:
        keys = auth.KeyStore.load(path)
    except auth.KeysFileError as e:
        log.error("SIGHUP: keeping the keys loaded before: %s", e)
        return
    frontend.reload_keys(keys)
    log.warning("SIGHUP: %d API keys loaded from %s", len(keys.names), path)


async def serve(args) -> int:
    try:
        opts = options(args)
    except auth.KeysFileError as e:
        print(f"kvpool-frontend: {e}", file=sys.stderr)
        return 1
    connect_args = dict(socket_dir=args.socket_dir, tenant=args.tenant, kv_access=False,
                        client_name=f"kvpool-frontend-{os.getpid()}", timeout=args.timeout,
                        trusted_daemon_uids=args.trusted_daemon_uid)
    try:
        probe = await kvpool.aio.AsyncClient.connect(**connect_args)
    except kvpool.KvPoolError as e:
        print(f"kvpool-frontend: cannot attach to kvpoold: {e}", file=sys.stderr)
        return 1
    if not probe.model_name:
        await probe.close()
        print("kvpool-frontend: kvpoold runs no model (model { name: \"none\" })", file=sys.stderr)
        return 1
    served = args.served_model_name or os.path.basename(probe.model_name.rstrip("/"))
    # The namespace is tenant + model: frontends serving the same model share prefixes.
    connect_args["model"] = served
    await probe.close()
    client = await kvpool.aio.AsyncClient.connect(**connect_args)
    try:
        tok = tokenizer.load(args.tokenizer, client.model_name, client.model_vocab_size)
    except tokenizer.TokenizerError as e:
        await client.close()
        print(f"kvpool-frontend: {e}", file=sys.stderr)
        return 1
    template = args.chat_template
    if template == "auto":
        template = "llama-2" if tok.name == "sentencepiece" else "kvpool"
    frontend = Frontend(client, tok, template, served, connect_args, opts)

    runner = web.AppRunner(frontend.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"kvpool-frontend: serving {served} at http://{args.host}:{port} (kvpoold "
          f"{client.runtime_dir}, session {client.session_id}, tokenizer {tok.name}, chat "
          f"template {template}, "
          f"{'no auth' if opts.keys is None else f'{len(opts.keys.names)} API keys'})",
          flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.keys_file:
        loop.add_signal_handler(signal.SIGHUP, reload_keys, frontend, args.keys_file)
    await stop.wait()
    drained = await frontend.drain(args.drain_timeout)
    if not drained:
        log.warning("drain timed out with %d requests in flight", frontend.in_flight)
    await runner.cleanup()
    await frontend.close()
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s] [%(name)s] [%(levelname)s] %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
