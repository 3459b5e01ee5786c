"""kvpool-frontend [--socket_dir DIR] [--host H] [--port P] [--tenant T] [--served_model_name N]
                [--tokenizer auto|bytes|PATH] [--chat_template auto|kvpool|llama-2]

Attaches to kvpoold (compute-only), then serves the OpenAI-compatible API (server.py) until
SIGTERM or SIGINT: it then drains (new requests get 503, those in flight finish, at most
--drain_timeout seconds), says goodbye to the daemon and exits 0. Prints one line when it
listens: "kvpool-frontend: serving MODEL at http://HOST:PORT ...". Exits 1 when it cannot attach
or the tokenizer does not fit the model, 2 for bad flags.
"""

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

import kvpool
import kvpool.aio
from kvpool_frontend import chat, tokenizer
from kvpool_frontend.server import Frontend

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
    return p.parse_args(argv)


async def serve(args) -> int:
    connect_args = dict(socket_dir=args.socket_dir, tenant=args.tenant, kv_access=False,
                        client_name=f"kvpool-frontend-{os.getpid()}", timeout=args.timeout)
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
    frontend = Frontend(client, tok, template, served, connect_args)

    runner = web.AppRunner(frontend.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"kvpool-frontend: serving {served} at http://{args.host}:{port} (kvpoold "
          f"{client.runtime_dir}, session {client.session_id}, tokenizer {tok.name}, chat "
          f"template {template})", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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
