"""Repetitive long documents as a public long-document QA benchmark asks them, our stack against llama-server (same CPU,
weights, streamed chat at temperature 0), and the exact default's own targets.

Part `rounds` (--kinds words,logs,csv): a warm-up round asks each document once, a query round each --repeats times in
a seeded order, --in-flight at once; per server, medians over alternating --runs (documents of their own): each
round's mean TTFT, the query round's wall time and cached tokens; `ours-approx` asks for `chunk_kv_reuse`. Part
`repeat` (ours, through the gateway): a repetitive ~2k-token prompt cold, cached, and again; an ordinary document
twice; a ~5.8k-token log twice.

    flock /tmp/kvboost-bench.lock python bench/bench_long_doc.py --other-runs 2 --json /tmp/long_doc.json   # ~30 min
    python bench/bench_long_doc.py --kinds words --runs 1 --parts rounds                      # a quicker look
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

from bench import harness  # noqa: E402
from bench.bench_peers import OurStack, Server, documents, start_peer  # noqa: E402

KINDS = ("words", "logs", "csv")
PARTS = ("rounds", "repeat")
WORDS = ("apple river stone cloud paper green table music light water horse bread chair phone money glass house "
         "train sugar plant dream smile voice field ocean sound metal forest bridge garden window winter summer "
         "yellow silver orange animal doctor letter number island market castle rocket pencil camera").split()
LOG_TEMPLATES = ("2026-11-26 10:{m:02d}:{s:02d} INFO heartbeat ok from worker-{w}\n",
                 "2026-11-26 10:{m:02d}:{s:02d} WARN retrying upload of part {w}: connection reset\n",
                 "2026-11-26 10:{m:02d}:{s:02d} INFO heartbeat ok from worker-{w}\n",
                 "2026-11-26 10:{m:02d}:{s:02d} ERROR disk /dev/vda1 is 97% full\n")
QUESTION = "\n\nQuestion: which word or line occurs most often above? Answer in a few words."
LOG_LINE = "2026-11-26 10:00:00 ERROR worker-3 lost connection to db-1; retrying in 5 s\n"


def tokenizer():
    from transformers import AutoTokenizer

    from inference_service.model.weights import prepare_default_model

    return AutoTokenizer.from_pretrained(prepare_default_model())


def fit(text_of, num_tokens: int, count_tokens) -> str:
    """The longest text_of(n) whose token count stays within num_tokens (n grows by halving steps)."""
    low, high = 1, num_tokens * 2
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if count_tokens(text_of(middle)) <= num_tokens else (low, middle - 1)
    return text_of(low)


def document(kind: str, tag: str, rng: random.Random, num_tokens: int, count_tokens) -> str:
    """A document of about num_tokens tokens, distinct from every other by its tag."""
    if kind == "words":
        word = tag
        return fit(lambda n: f"{word} " * n, num_tokens, count_tokens)
    if kind == "logs":
        lines = [rng.choice(LOG_TEMPLATES).format(m=i // 60 % 60, s=i % 60, w=rng.randint(1, 3)) for i in range(800)]
        return fit(lambda n: f"Log of host {tag}\n" + "".join(lines[:n]), num_tokens, count_tokens)
    rows = [f"{rng.randint(1, 4)},{rng.choice(['bolt', 'nut', 'washer'])},{rng.choice([10, 20, 50])},ok\n"
            for _ in range(1200)]
    return fit(lambda n: f"Table {tag}\nid,part,qty,status\n" + "".join(rows[:n]), num_tokens, count_tokens)


def document_tags(seed: int):
    """Every document's word (words) or label, never the same twice: the words in a seeded order, then in other
    spellings, then with a number."""
    words = random.Random(seed).sample(WORDS, len(WORDS))
    yield from words
    yield from (word.capitalize() for word in words)
    yield from (word.upper() for word in words)
    yield from (f"{word}{number}" for number in itertools.count(2) for word in words)


def run_rounds(server: Server, texts: list[str], repeats: int, in_flight: int, seed: int,
               client: httpx.Client) -> dict:
    """The warm-up round (each document once, in order), then the query round (each `repeats` times, shuffled)."""
    def ask(text: str):
        return server.chat([{"role": "user", "content": text + QUESTION}], 16, client)

    figures = {}
    for name, order in (("warmup", list(texts)), ("query", random.Random(seed).sample(texts * repeats,
                                                                                    len(texts) * repeats))):
        started = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            replies = list(pool.map(ask, order))
        figures[name] = {"mean_ttft_ms": statistics.mean(reply.ttft_ms for reply in replies),
                         "round_s": time.perf_counter() - started,
                         "mean_cached": statistics.mean(reply.cached_tokens for reply in replies),
                         "mean_prompt": statistics.mean(reply.prompt_tokens for reply in replies)}
    return figures


def part_rounds(servers: list[Server], approx: Server, args, count_tokens, client: httpx.Client) -> dict:
    results: dict = {}
    tags = document_tags(args.seed)
    for kind in args.kinds:
        kind_servers = servers[:1] + [approx] + servers[1:] if kind in args.approx_kinds else servers
        runs = args.runs if kind == args.kinds[0] else args.other_runs or args.runs
        samples: dict[str, list[dict]] = {server.name: [] for server in kind_servers}
        for run in range(runs):
            for server in harness.in_turn(kind_servers, run):
                rng = random.Random(f"{args.seed}-{kind}-{run}-{server.name}")
                texts = [document(kind, next(tags), rng, args.tokens, count_tokens) for _ in range(args.documents)]
                samples[server.name].append(run_rounds(server, texts, args.repeats, args.in_flight, args.seed + run,
                                                       client))
                print(f"  {kind} run {run + 1} {server.name}: {json.dumps(samples[server.name][-1])}", flush=True)
        results[kind] = {"runs": runs, "servers": {
            name: {round_name: harness.summarize([sample[round_name] for sample in samples_of])
                   for round_name in ("warmup", "query")}
            for name, samples_of in samples.items()}}
    return results


def part_repeat(ours: Server, args, count_tokens, client: httpx.Client) -> dict:
    """The exact default's own targets, alternating within each run; medians over runs."""
    baseline = Server(ours.name, ours.base_url, ours.model, {"kvboost": {"mode": "baseline"}})
    ordinary = "\n".join(documents(2 * args.runs + 2, seed=args.seed))  # fact sheets: ~1k-4k tokens each
    rows: dict[str, list[float]] = {}

    def ask(server: Server, text: str, name: str) -> None:
        reply = server.chat([{"role": "user", "content": text + QUESTION}], 16, client)
        rows.setdefault(f"{name}_ttft_ms", []).append(reply.ttft_ms)
        rows.setdefault(f"{name}_cached", []).append(reply.cached_tokens)
        rows.setdefault(f"{name}_prompt", []).append(reply.prompt_tokens)

    for run in range(args.runs):
        rng = random.Random(f"repeat-{args.seed}-{run}")
        lead = f"Run {run} {time.time_ns()}.\n"
        ask(baseline, lead + "A " + document("words", "hi", rng, 2000, count_tokens), "baseline")
        repetitive = lead + "B " + document("words", "hi", rng, 2000, count_tokens)
        ask(ours, repetitive, "first")
        ask(ours, repetitive, "again")
        window = ordinary[run * 10_000:]
        plain = lead + fit(lambda n, window=window: window[:n * 8], 2000, count_tokens)
        ask(ours, plain, "ordinary_first")
        ask(ours, plain, "ordinary_again")
        log = lead + LOG_LINE * 180
        ask(ours, log, "log_first")
        ask(ours, log, "log_again")
        print(f"  repeat run {run + 1}: " + ", ".join(f"{key} {values[-1]:.0f}" for key, values in rows.items()),
              flush=True)
    return {key: harness.median(values) for key, values in rows.items()}


def print_report(results: dict) -> None:
    print(f"\n{results['header']}\nllama-server: {results['peer_command']}\n")
    for kind, figures in results.get("rounds", {}).items():
        servers = figures["servers"]
        harness.print_table(f"{kind}: {results['shape']}, medians of {figures['runs']} alternating runs", [
            {"server": name, "warmup": rounds["warmup"]["mean_ttft_ms"], "query": rounds["query"]["mean_ttft_ms"],
             "round_s": rounds["query"]["round_s"],
             "cached": f"{rounds['query']['mean_cached']:.0f}/{rounds['query']['mean_prompt']:.0f}"}
            for name, rounds in servers.items()], ["server", ("warmup", "warm-up TTFT ms"), ("query", "query TTFT ms"),
                                                   ("round_s", "query round s"), ("cached", "query cached/prompt")])
    repeat = results.get("repeat")
    if repeat:
        print("\nrepeat (ours through the gateway, medians):")
        print(f"  BASELINE {repeat['baseline_ttft_ms']:.1f} ms; first ask with the cache {repeat['first_ttft_ms']:.1f} ms "
              f"({repeat['first_ttft_ms'] / repeat['baseline_ttft_ms']:.3f}x BASELINE)")
        print(f"  the same {repeat['again_prompt']:.0f}-token repetitive prompt again: {repeat['again_cached']:.0f} "
              f"cached, {repeat['again_ttft_ms']:.1f} ms; an ordinary {repeat['ordinary_again_prompt']:.0f}-token "
              f"document again: {repeat['ordinary_again_cached']:.0f} cached, {repeat['ordinary_again_ttft_ms']:.1f} "
              f"ms ({repeat['again_ttft_ms'] / repeat['ordinary_again_ttft_ms']:.2f}x)")
        print(f"  a {repeat['log_first_prompt']:.0f}-token log (one line x180): {repeat['log_first_ttft_ms']:.1f} ms, "
              f"then {repeat['log_again_ttft_ms']:.1f} ms ({repeat['log_again_cached']:.0f} cached)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {', '.join(PARTS)}")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"documents, comma-separated among {', '.join(KINDS)}")
    parser.add_argument("--documents", type=int, default=6, help="documents per round (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per document (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="times each document is asked in the query round")
    parser.add_argument("--in-flight", type=int, default=2, help="requests in flight (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per server (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of both servers (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=11, help="documents and orders (default: %(default)s)")
    parser.add_argument("--no-peer", action="store_true", help="our side only")
    parser.add_argument("--daemon-bytes", default="48GB",
                        help="our daemon's --max-bytes (default: %(default)s, never reached; 1GiB: make run's)")
    parser.add_argument("--approx-kinds", default="words",
                        help="kinds that also run ours-approx (chunk_kv_reuse asked for), comma-separated; empty: none")
    parser.add_argument("--other-runs", type=int, default=0,
                        help="runs of every kind but the first (0: --runs), to keep a full run short")
    harness.add_arguments(parser, rounds=None)
    args = parser.parse_args(argv)
    args.kinds = [kind for kind in args.kinds.split(",") if kind]
    args.approx_kinds = [kind for kind in args.approx_kinds.split(",") if kind]
    parts = [part for part in args.parts.split(",") if part]
    if set(args.kinds) - set(KINDS) or set(parts) - set(PARTS):
        parser.error(f"--kinds among {', '.join(KINDS)}; --parts among {', '.join(PARTS)}")
    names = tokenizer()
    count_tokens = lambda text: len(names(text)["input_ids"])  # noqa: E731
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results: dict = {"date": date, "shape": f"{args.documents} documents x ~{args.tokens} tokens, {args.repeats} "
                     f"repeats, {args.in_flight} in flight, 16 new tokens, our daemon's budget {args.daemon_bytes}"}
    with ExitStack() as stack:
        work_dir = Path(tempfile.mkdtemp(prefix="kvboost-long-doc-"))
        print(f"logs in {work_dir}", flush=True)
        stack.callback(shutil.rmtree, work_dir / "lmdb", ignore_errors=True)
        # By default a budget no run comes near (~1.2 GB of K/V a run and server): the daemon's eviction is not what
        # is measured; --daemon-bytes 1GiB is `make run`'s (L0 then answers for what the daemon evicts).
        ours_stack = OurStack(work_dir, args.threads, max_bytes=args.daemon_bytes).start()
        stack.callback(ours_stack.stop)
        ours = Server("ours", ours_stack.base_url, "SmolLM2-135M-Instruct")
        context = args.tokens + 256
        peer, results["peer_command"] = (None, "llama-server skipped: --no-peer") if args.no_peer else start_peer(
            work_dir, args.threads, max(8, args.documents), context, ("-cram", "0"))
        if peer is not None:
            stack.callback(peer.stop)
        print(results["peer_command"], flush=True)
        approx = Server("ours-approx", ours.base_url, ours.model, {"kvboost": {"mode": "chunk_kv_reuse"}})
        servers = [ours] + [Server("llama-server", peer.base_url, extra={"cache_prompt": True})] if peer else [ours]
        results["header"] = (f"SmolLM2-135M-Instruct, CPU, {args.threads} threads each; ours fp32, default mode "
                             f"(exact); llama-server F32 GGUF; temperature 0; {date}")
        with httpx.Client() as client:
            for server in servers:  # load paths, allocators
                server.chat([{"role": "user", "content": "Hello."}], 4, client)
            if "rounds" in parts:
                # ours-approx (the old default) beside them on the --approx-kinds only: each row costs minutes.
                results["rounds"] = part_rounds(servers, approx, args, count_tokens, client)
            if "repeat" in parts:
                results["repeat"] = part_repeat(ours, args, count_tokens, client)
    print_report(results)
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
