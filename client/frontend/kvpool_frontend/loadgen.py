"""kvpool-http-loadgen: drives OpenAI-compatible frontends with real streaming HTTP requests and
reports what a user of the API sees: time to first token (request sent -> first token event),
inter-token latency (gaps between token events), tokens/s, and the prompt tokens the daemon's
prefix cache supplied (usage.prompt_tokens_details.cached_tokens).

    kvpool-http-loadgen --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 \
        --concurrency 4 --requests 32 --shared_prefix 400 --prompt 100 --max_tokens 64

Requests go round-robin to the URLs, `concurrency` at a time, with `Authorization: Bearer` and
the key of --api_key (default: $KVPOOL_API_KEY; none for a frontend run with --no_auth). Each
prompt is a shared prefix (the same for every request: a system prompt) and a part of its own, as
text of about that many characters. Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Dict, List, Optional

import aiohttp


def percentile(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def text_of(n: int, rng: random.Random) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < n:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))))
    return " ".join(words)[:n]


class Result:
    def __init__(self):
        self.ttft: Optional[float] = None
        self.gaps: List[float] = []
        self.tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.error: Optional[str] = None


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                      args) -> Result:
    r = Result()
    body = {"model": model, "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url + path, json=body) as response:
            if response.status != 200:
                r.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return r
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    r.error = event["error"]["message"]
                    return r
                if event.get("usage"):
                    r.prompt_tokens = event["usage"]["prompt_tokens"]
                    r.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                choices = event.get("choices") or []
                if not choices or choices[0].get("finish_reason") is not None:
                    continue
                if args.endpoint == "chat" and "content" not in choices[0]["delta"] or (
                        args.endpoint == "chat" and "role" in choices[0]["delta"]):
                    continue  # the role-only first event
                now = time.perf_counter()  # one event per generated token
                if last is None:
                    r.ttft = now - start
                else:
                    r.gaps.append(now - last)
                last = now
                r.tokens += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run(args) -> Dict:
    urls = [u.rstrip("/") for group in args.url for u in group.split(",")]
    rng = random.Random(args.seed)
    shared = text_of(args.shared_prefix, rng)
    prompts = [shared + " " + text_of(args.prompt, rng) for _ in range(args.requests)]
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        model = args.model
        if not model:
            async with session.get(urls[0] + "/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
        queue = list(enumerate(prompts))
        results: List[Result] = []

        async def worker():
            while queue:
                i, prompt = queue.pop(0)
                results.append(await one_request(session, urls[i % len(urls)], model, prompt, args))

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(args.concurrency)])
        wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "errors": len(errors),
        "first_errors": errors[:3], "seconds": wall, "tokens": tokens,
        "tokens_per_second": tokens / wall if wall else 0.0,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(gaps, 0.5), "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
        "itl_mean_ms": 1e3 * sum(gaps) / len(gaps) if gaps else 0.0,
        "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "cached_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
    }


def report(s: Dict) -> str:
    lines = [
        f"requests        {s['completed']}/{s['requests']} completed, {s['errors']} errors "
        f"in {s['seconds']:.2f} s",
        f"tokens          {s['tokens']} generated, {s['tokens_per_second']:.1f} tokens/s",
        f"TTFT            p50 {s['ttft_p50_ms']:.2f} ms   p99 {s['ttft_p99_ms']:.2f} ms",
        f"inter-token     p50 {s['itl_p50_ms']:.2f} ms   p99 {s['itl_p99_ms']:.2f} ms   "
        f"mean {s['itl_mean_ms']:.2f} ms",
        f"prefix cache    {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached "
        f"({100 * s['cached_fraction']:.1f}%)",
    ]
    lines += [f"error           {e}" for e in s["first_errors"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvpool-http-loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", required=True,
                   help="a frontend's base URL (repeat, or separate with commas)")
    p.add_argument("--model", default="", help="default: the first frontend's /v1/models")
    p.add_argument("--api_key", default=os.environ.get("KVPOOL_API_KEY", ""),
                   help="the API key to send (default: $KVPOOL_API_KEY)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--shared_prefix", type=int, default=400, help="characters shared by every prompt")
    p.add_argument("--prompt", type=int, default=100, help="characters of each prompt's own part")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sent with every request (0: greedy, so runs generate the same tokens; "
                        "the server's default is OpenAI's 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --requests and --max_tokens must be >= 1")
    summary = asyncio.run(run(args))
    print(json.dumps(summary) if args.json else report(summary), flush=True)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
