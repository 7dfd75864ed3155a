#!/usr/bin/env python3
"""The load of scripts/serve-bench.sh: N concurrent clients of one OpenAI-compatible server
on this machine, with the `openai` Python package, streaming completions.

What it takes: the server's base URL (a loopback address only: anything else is refused),
the model name to send, the number of clients, the number of requests in all, the prompt
length in words, the tokens per completion and a time limit in seconds.

What it gives: one JSON line on stdout with the counts, output tokens/s over the
measured window (first request sent to last response done), and p50/p99 of time to first
token (request sent to the first chunk with text) and of inter-token latency (per request,
(last chunk - first chunk) / (completion tokens - 1), the usual TPOT: a server that sends
several tokens in one chunk is not favoured). Token counts are the server's own `usage`.

What it guarantees: it stops by itself. Exactly `--requests` requests are sent unless the
time limit passes first; no request is sent after it, and each request's timeout ends at
the limit, so the whole load takes at most `--time-limit` seconds plus one connect. A
warm-up request (not counted) goes first, so the first measured request does not pay for
the server's first touch of its weights. The prompts are the same for every server: words
drawn from a fixed list with a fixed seed, one prompt per request index.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import random
import sys
import threading
import time
import urllib.parse

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been would more "
    "when if will who so no time out up about into than them can only other new some what "
    "could these two may first then do any like my now over such our man me even most made "
    "after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three expert model token memory layer weight schedule stream copy batch"
).split()


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-len(ordered) * q // 100)))
    return ordered[int(rank) - 1]


def prompt_for(index: int, words: int, seed: int, system: str = "") -> str:
    rng = random.Random(seed * 1_000_003 + index)
    return system + " ".join(rng.choice(WORDS) for _ in range(words))


def system_prompt(words: int, seed: int) -> str:
    """The prefix every request shares (--system-words): the same words for every server."""
    if words <= 0:
        return ""
    rng = random.Random(seed * 7_000_001 - 1)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


def system_prompt_of_tokens(tokens: int, seed: int, tokenizer_json: str) -> tuple[str, int, int]:
    """The shared prefix of --system-tokens: the fewest of system_prompt's words (the same
    words, in the same order, as --system-words draws) whose text is at least `tokens`
    tokens by the model's own tokenizer (its tokenizer.json, special tokens not counted).
    Returns the text, its word count and its token count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    count = lambda words: len(tok.encode(system_prompt(words, seed), add_special_tokens=False).ids)
    # Words are at least one token each here, so `tokens` words is an upper bound.
    lo, hi = 1, max(1, tokens)
    if count(hi) < tokens:
        raise ValueError(f"{tokens} words come to fewer than {tokens} tokens")
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return system_prompt(lo, seed), lo, count(lo)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument(
        "--system-words",
        type=int,
        default=0,
        help="a prefix of this many words shared by every request (a system prompt); "
        "`cache_prompt` is asked for, which llama-server honours and moec ignores (its "
        "prefix cache is always on where the schedule allows it)",
    )
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=0,
        help="instead of --system-words: a shared prefix of the same words, as few as make "
        "at least this many tokens by --tokenizer (the model's tokenizer.json)",
    )
    parser.add_argument("--tokenizer", help="the model's tokenizer.json (for --system-tokens)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--label", default="server")
    parser.add_argument(
        "--trace",
        help="append one JSON line per measured request to this file: its index and when it "
        "was sent, got its first text and ended, in wall-clock seconds since the Unix epoch "
        "(the clock of `moec serve`'s MOEC_SERVE_TRACE lines, so the two line up)",
    )
    args = parser.parse_args()

    host = urllib.parse.urlparse(args.base_url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        print(f"serve-bench: {args.base_url} is not a loopback address; refusing", file=sys.stderr)
        return 2

    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key="serve-bench", max_retries=0)
    system = system_prompt(args.system_words, args.seed)
    system_tokens = None
    if args.system_tokens > 0:
        if args.system_words > 0 or not args.tokenizer:
            print("serve-bench: --system-tokens takes --tokenizer and no --system-words",
                  file=sys.stderr)
            return 2
        system, words, system_tokens = system_prompt_of_tokens(
            args.system_tokens, args.seed, args.tokenizer)
        print(f"serve-bench: a shared prefix of {words} words, {system_tokens} tokens",
              file=sys.stderr)

    def one(index: int, deadline: float) -> dict:
        """One streaming completion; its timings and the server's token counts."""
        sent = time.monotonic()
        first = last = None
        usage = None
        chunks = 0
        stream = client.completions.create(
            model=args.model,
            prompt=prompt_for(index, args.prompt_words, args.seed, system),
            max_tokens=args.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            timeout=max(1.0, deadline - sent),
            extra_body={"cache_prompt": True} if system else None,
        )
        for chunk in stream:
            now = time.monotonic()
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].text:
                chunks += 1
                if first is None:
                    first = now
                last = now
        done = time.monotonic()
        if usage is None or first is None:
            raise RuntimeError(f"request {index}: no usage or no text in the stream")
        tokens = usage.completion_tokens
        return {
            "index": index,
            "sent": sent,
            "done": done,
            "ttft": first - sent,
            "itl": (last - first) / (tokens - 1) if tokens > 1 else None,
            "completion_tokens": tokens,
            "prompt_tokens": usage.prompt_tokens,
            "chunks": chunks,
        }

    # The warm-up: not counted.
    one(10**6, time.monotonic() + args.time_limit)

    start = time.monotonic()
    deadline = start + args.time_limit
    lock = threading.Lock()
    next_index = [0]
    results: list[dict] = []
    errors: list[str] = []

    def client_loop() -> None:
        while True:
            with lock:
                index = next_index[0]
                if index >= args.requests or time.monotonic() >= deadline:
                    return
                next_index[0] += 1
            try:
                r = one(index, deadline)
                with lock:
                    results.append(r)
            except Exception as e:  # a failed request is counted and said, not fatal
                with lock:
                    errors.append(f"request {index}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    if args.trace:
        # The monotonic clock times the requests; one offset maps it to wall-clock time.
        offset = time.time() - time.monotonic()
        with open(args.trace, "a") as f:
            for r in sorted(results, key=lambda r: r["sent"]):
                line = {k: r[k] + offset for k in ("sent", "done")}
                line["first"] = r["sent"] + r["ttft"] + offset
                line.update(index=r["index"], label=args.label)
                f.write(json.dumps(line) + "\n")

    for e in errors[:5]:
        print(f"serve-bench: {args.label}: {e}", file=sys.stderr)
    out = {
        "system": args.label,
        "clients": args.clients,
        "requests_asked": args.requests,
        "requests_done": len(results),
        "requests_failed": len(errors),
        "timed_out": next_index[0] < args.requests,
        "system_tokens": system_tokens,
    }
    if results:
        window = max(r["done"] for r in results) - min(r["sent"] for r in results)
        tokens = sum(r["completion_tokens"] for r in results)
        ttft = [r["ttft"] for r in results]
        itl = [r["itl"] for r in results if r["itl"] is not None]
        out.update(
            {
                "seconds": window,
                "output_tokens": tokens,
                "output_tokens_per_s": tokens / window,
                "mean_prompt_tokens": sum(r["prompt_tokens"] for r in results) / len(results),
                "mean_tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in results)),
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99),
                "itl_p50_s": percentile(itl, 50),
                "itl_p99_s": percentile(itl, 99),
            }
        )
    print(json.dumps(out))
    return 0 if results and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
