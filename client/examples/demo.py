"""Demo of KV reuse: warm a system prompt with a long document, ask questions, print TTFT and reuse.

The questions run in the service's default mode, exact reuse (prefix_cache): each answer is the one the model gives
without the cache, only sooner; the demo checks it on the first question against BASELINE. Approximate reuse of
chunks stored under another prefix (chunk_kv_reuse) is opt-in, and every answer that used it says approximate.

Run it against a running stack (`make up`, or `make run` which does both):
    python client/examples/demo.py [--address HOST:PORT] [--max-new-tokens N] [--gateway-url URL | --no-gateway]

The last question is asked once more through the OpenAI-compatible HTTP gateway, as any OpenAI client would.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from client import KVBoostClient, KVBoostError
from client.cli_format import shorten, table

DOCUMENT = Path(__file__).with_name("harbor_handbook.md")
SYSTEM_PROMPT = (
    "You are the customer assistant of the Lanterna Bay Ferry Company. Answer the passenger's question "
    "in one or two short sentences, using only the handbook below. If the handbook does not say, answer "
    "that you do not know.\n\n"
)
QUESTIONS = [
    "What time does the first ferry leave Castel Verde on weekdays?",
    "How much does it cost to take a bicycle on the ferry?",
    "Can I bring my dog to Sorbo in August?",
    "What happens if the last ferry to the mainland is cancelled?",
    "Is there wireless internet on the Aurora?",
]
# Follow-up questions share the whole system message with the first one: most tokens come from the cache.
MIN_FOLLOW_UP_REUSE = 0.8


def ask(client: KVBoostClient, system: dict, question: str, mode: str | None, max_new_tokens: int):
    """mode None: the service's default (exact reuse)."""
    messages = [system, {"role": "user", "content": question}]
    return client.generate(messages=messages, mode=mode, max_new_tokens=max_new_tokens).result


def ask_gateway(gateway_url: str, system: dict, question: str, max_new_tokens: int) -> dict:
    """One chat completion through the HTTP gateway, with plain urllib (any OpenAI client would do)."""
    body = {"messages": [system, {"role": "user", "content": question}], "max_tokens": max_new_tokens,
            "temperature": 0}
    request = urllib.request.Request(f"{gateway_url.rstrip('/')}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def show_gateway_call(gateway_url: str, system: dict, max_new_tokens: int) -> None:
    question = QUESTIONS[-1]
    try:
        reply = ask_gateway(gateway_url, system, question, max_new_tokens)
    except (urllib.error.URLError, OSError, ValueError) as error:
        print(f"\nthe HTTP gateway at {gateway_url} did not answer ({error}); `make up` starts it on 127.0.0.1:8000")
        return
    usage = reply["usage"]
    print(f"\nthrough the OpenAI-compatible HTTP gateway ({gateway_url}): {question!r}\n"
          f"  usage: {usage['prompt_tokens']} prompt tokens, {usage['prompt_tokens_details']['cached_tokens']} "
          f"cached (prompt_tokens_details.cached_tokens), {usage['completion_tokens']} generated, "
          f"approximate: {str(reply['kvboost']['approximate']).lower()}\n"
          f"  answer: {shorten(reply['choices'][0]['message']['content'], 100)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("KVBOOST_ADDRESS", "127.0.0.1:50051"))
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--gateway-url", default=os.environ.get("KVBOOST_GATEWAY_URL", "http://127.0.0.1:8000/v1"),
                        help="the HTTP gateway's OpenAI base URL (env KVBOOST_GATEWAY_URL, default %(default)s)")
    parser.add_argument("--no-gateway", dest="gateway", action="store_false",
                        help="skip the call through the HTTP gateway")
    args = parser.parse_args(argv)

    system = {"role": "system", "content": SYSTEM_PROMPT + DOCUMENT.read_text(encoding="utf-8")}
    with KVBoostClient(args.address, timeout=600) as client:
        try:
            client.wait_ready(timeout=30)
            info = client.model_info()
            print(f"model {info.model} on {info.device} ({info.dtype}), chunk size {info.chunk_size} tokens, "
                  f"default mode {info.default_mode.lower()}")
            warmed = client.warm(messages=[system])
            print(f"warmed the system prompt and the handbook: {warmed.token_count} tokens, "
                  f"{warmed.chunks_stored} chunks stored\n")
            rows = [("#", "mode", "question", "prompt", "cached", "reuse", "TTFT ms", "answer")]
            baseline = ask(client, system, QUESTIONS[0], "baseline", args.max_new_tokens)
            rows.append(_row("0", baseline, QUESTIONS[0]))
            results = []
            for number, question in enumerate(QUESTIONS, start=1):
                result = ask(client, system, question, None, args.max_new_tokens)
                results.append(result)
                rows.append(_row(str(number), result, question))
        except KVBoostError as error:
            print(f"demo: {error}\nIs the stack running? Start it with `make up`.", file=sys.stderr)
            return 1
    print(table(rows))
    mean_ttft = sum(result.ttft_ms for result in results) / len(results)
    print(f"\nbaseline TTFT {baseline.ttft_ms:.1f} ms, with the cache {mean_ttft:.1f} ms on average "
          f"({baseline.ttft_ms / max(mean_ttft, 1e-9):.1f}x faster)")
    same = results[0].output_token_ids == baseline.output_token_ids
    print(f"question 1 with the cache gives baseline's answer token for token: {'yes' if same else 'NO'}"
          f"{' (approximate reuse was used)' if results[0].approximate else ''}")
    if args.gateway:
        show_gateway_call(args.gateway_url, system, args.max_new_tokens)
    print("The stack is still running: stop it with `make down` (or `python -m client.stack down`).")
    if not same and not results[0].approximate:
        print("demo: the cached answer differs from baseline's in exact mode", file=sys.stderr)
        return 1
    low = [result for result in results[1:] if result.kv_reuse_ratio <= MIN_FOLLOW_UP_REUSE]
    if low:
        reason = " (the cache daemon is unreachable)" if any(result.degraded for result in low) else ""
        print(f"demo: {len(low)} follow-up question(s) reused {MIN_FOLLOW_UP_REUSE:.0%} of the prompt or less{reason}",
              file=sys.stderr)
        return 1
    return 0


def _row(number: str, result, question: str) -> tuple[str, ...]:
    return (number, result.mode.lower(), shorten(question, 40), str(result.prompt_tokens), str(result.cached_tokens),
            f"{result.kv_reuse_ratio:.2f}", f"{result.ttft_ms:.1f}", shorten(result.output_text, 70))


if __name__ == "__main__":
    sys.exit(main())
