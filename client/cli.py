"""`kvboost`: generate, warm, stats, verify against the inference service; `kvboost cache` against the daemon."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from client import cli_format
from client.cache_client import DEFAULT_DAEMON_ADDRESS, CacheClient
from client.errors import InvalidArgumentError, KVBoostError
from client.library import DEFAULT_ADDRESS, DEFAULT_TIMEOUT_S, KVBoostClient

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
MODES = ("baseline", "prefix_cache", "chunk_kv_reuse")
STRATEGIES = ("none", "selective", "cacheblend")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost",
                                     description="Client of the KVBoost inference service and cache daemon.")
    parser.add_argument("--address", default=os.environ.get("KVBOOST_ADDRESS", DEFAULT_ADDRESS),
                        help="inference service host:port (env KVBOOST_ADDRESS, default %(default)s)")
    parser.add_argument("--daemon-address", default=os.environ.get("KVBOOST_DAEMON_ADDRESS", DEFAULT_DAEMON_ADDRESS),
                        help="cache daemon host:port for `kvboost cache` "
                             "(env KVBOOST_DAEMON_ADDRESS, default %(default)s)")
    parser.add_argument("--token", default=os.environ.get("KVBOOST_TOKEN"),
                        help="bearer token sent with every call (env KVBOOST_TOKEN)")
    parser.add_argument("--token-file", default=os.environ.get("KVBOOST_AUTH_TOKEN_FILE"),
                        help="read the bearer token from this file (env KVBOOST_AUTH_TOKEN_FILE)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds before a call fails (default %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="generate text, streaming it to stdout")
    generate.add_argument("prompt", help="the prompt, or - to read it from stdin")
    generate.add_argument("--chat", action="store_true",
                          help="send the prompt as a user chat message (chat template applied)")
    generate.add_argument("--system", help="with --chat: a system message before the prompt")
    generate.add_argument("--max-new-tokens", type=int, help="tokens to generate (server default 64)")
    generate.add_argument("--mode", choices=MODES, help="cache mode (default: the server's --default-mode, prefix_cache unless it opted in): prefix_cache reuses "
                               "exactly (the same answer as baseline); chunk_kv_reuse also reuses chunks stored under "
                               "another prefix, approximately (the result says approximate)")
    generate.add_argument("--recompute-strategy", choices=STRATEGIES, help="repair of content hits (server default)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--json", action="store_true", help="print the GenerationResult as one JSON object")
    generate.set_defaults(run=_run_generate)

    warm = commands.add_parser("warm", help="store the K/V chunks of files' text in the cache")
    warm.add_argument("files", nargs="+", metavar="FILE", help="text files to warm (- reads stdin)")
    warm.add_argument("--content-addressed", action="store_true",
                      help="also index chunks by content, so they hit wherever the text appears as a segment, in "
                           "chunk_kv_reuse mode only (opt-in: approximate, labelled); the default prefix_cache mode "
                           "reuses them where the text starts a prompt")
    warm.add_argument("--pin", action="store_true", help="pin the stored chunks (never evicted)")
    warm.add_argument("--json", action="store_true", help="print one JSON WarmResult per file")
    warm.set_defaults(run=_run_warm)

    stats = commands.add_parser("stats", help="inference service counters")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(run=_run_stats)

    info = commands.add_parser("info", help="the served model and cache layout")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_run_info)

    verify = commands.add_parser("verify", help="compare BASELINE with a cached mode; exit 1 unless all identical")
    verify.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to check (default: built-in ones)")
    verify.add_argument("--max-new-tokens", type=int)
    verify.add_argument("--mode", choices=MODES, help="cached mode to compare (server default prefix_cache)")
    verify.add_argument("--json", action="store_true")
    verify.set_defaults(run=_run_verify)

    _add_cache_commands(commands)
    return parser


def _add_cache_commands(commands) -> None:
    cache = commands.add_parser("cache", help="administer the cache daemon (at --daemon-address)")
    actions = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    stats = actions.add_parser("stats", help="entries, bytes and counters")
    stats.add_argument("--namespace", help="only this namespace (64 hex characters)")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(run=_run_cache_stats)
    delete = actions.add_parser("delete", help="delete keys, or a whole namespace")
    delete.add_argument("keys", nargs="*", metavar="KEY", help="prefix keys (64 hex characters)")
    delete.add_argument("--namespace", help="delete every entry of this namespace instead")
    delete.add_argument("--json", action="store_true")
    delete.set_defaults(run=_run_cache_delete)
    for name, help_text in (("pin", "pin keys (never evicted)"), ("unpin", "unpin keys")):
        pin = actions.add_parser(name, help=help_text)
        pin.add_argument("keys", nargs="+", metavar="KEY", help="prefix keys (64 hex characters)")
        pin.add_argument("--json", action="store_true")
        pin.set_defaults(run=_run_cache_pin, unpin=name == "unpin")


def _run_generate(args, client: KVBoostClient) -> int:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.system and not args.chat:
        raise InvalidArgumentError("--system needs --chat")
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt_form = {"messages": messages + [{"role": "user", "content": text}]}
    else:
        prompt_form = {"prompt": text}
    stream = client.generate(
        **prompt_form, max_new_tokens=args.max_new_tokens, mode=args.mode, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
        recompute_strategy=args.recompute_strategy,
    )
    if args.json:
        _print_json(stream.result.to_dict())
        return EXIT_OK
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(cli_format.generation_summary(stream.result), file=sys.stderr)
    return EXIT_OK


def _run_warm(args, client: KVBoostClient) -> int:
    from tqdm import tqdm

    texts = [(name, _read_text(name)) for name in args.files]  # all read first: a typo fails before any work
    total_chunks = total_tokens = 0
    with tqdm(total=len(texts), unit="file", desc="warming", file=sys.stderr, disable=None) as bar:
        for name, text in texts:
            result = client.warm(text, content_addressed=args.content_addressed, pin=args.pin)
            total_chunks += result.chunks_stored
            total_tokens += result.token_count
            bar.update(1)
            bar.set_postfix(chunks=total_chunks, tokens=total_tokens)
            if args.json:
                _print_json({"file": name, **result.to_dict()})
            else:
                bar.write(cli_format.warm_line(name, result), file=sys.stdout)
    if not args.json:
        print(f"warmed {len(texts)} file(s): {total_chunks} chunks, {total_tokens} tokens")
    return EXIT_OK


def _run_stats(args, client: KVBoostClient) -> int:
    values = client.stats().to_dict()
    print(json.dumps(values) if args.json else cli_format.key_value_lines(values))
    return EXIT_OK


def _run_info(args, client: KVBoostClient) -> int:
    values = client.model_info().to_dict()
    print(json.dumps(values) if args.json else cli_format.key_value_lines(values))
    return EXIT_OK


def _run_verify(args, client: KVBoostClient) -> int:
    report = client.verify_correctness(args.prompts, max_new_tokens=args.max_new_tokens, mode=args.mode)
    print(json.dumps(report.to_dict()) if args.json else cli_format.verify_text(report))
    return EXIT_OK if report.identical == report.total else EXIT_FAILED


def _run_cache_stats(args, cache: CacheClient) -> int:
    stats = cache.stats(args.namespace)
    print(json.dumps(stats.to_dict()) if args.json else cli_format.cache_stats_text(stats))
    return EXIT_OK


def _run_cache_delete(args, cache: CacheClient) -> int:
    result = cache.delete(args.keys, namespace=args.namespace)
    summary = f"deleted {result.deleted} entries, {result.bytes_freed} bytes freed"
    print(json.dumps(result.to_dict()) if args.json else summary)
    return EXIT_OK


def _run_cache_pin(args, cache: CacheClient) -> int:
    result = cache.unpin(args.keys) if args.unpin else cache.pin(args.keys)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"{'unpinned' if args.unpin else 'pinned'} {result.updated} key(s)")
        for key in result.missing:
            print(f"missing: {key}")
    return EXIT_OK


def _read_text(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    try:
        return Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"cannot read {name}: {error}") from None


def _read_token(args) -> str | None:
    if args.token:
        return args.token
    if args.token_file:
        try:
            return Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise InvalidArgumentError(f"cannot read the token file {args.token_file}: {error}") from None
    return None


def _print_json(values: dict) -> None:
    print(json.dumps(values), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        token = _read_token(args)
        if args.command == "cache":
            with CacheClient(args.daemon_address, token=token, timeout=args.timeout) as cache:
                return args.run(args, cache)
        with KVBoostClient(args.address, token=token, timeout=args.timeout) as client:
            return args.run(args, client)
    except KVBoostError as error:
        print(f"kvboost: error: {error}", file=sys.stderr)
        # A value refused before any call is a usage error; anything the server said is a failure.
        return EXIT_USAGE if error.code is None and isinstance(error, InvalidArgumentError) else EXIT_FAILED
    except KeyboardInterrupt:
        print("kvboost: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
