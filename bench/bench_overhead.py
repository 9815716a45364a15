"""The host's work per fully cached chat: a negligible model (random, hidden 64, 2 layers) behind SmolLM2's tokenizer
and template; a chat whose 2k / 8k / 32k-token system message was asked before is asked again with a new question.

Each part alternates this checkout with --baseline-tree's, request by request, medians: `in-process` (the engine as
`python -m inference_service` builds it, a child per tree; L0 auto and off, and cold; each host stage of the request
replayed alone: template + tokenize, keys, Lookup, placement; "rest" the TTFT they leave), `http` / `grpc` (`python
-m kvboost_server` per tree, TTFT at the client), `tokenizer` (the tokenization cache against apply_chat_template).

    flock /tmp/kvboost-heavy.lock python bench/bench_overhead.py --baseline-tree /tmp/before   # git worktree add
    python bench/bench_overhead.py --parts in-process --lengths 2048 --rounds 3       # the GPU check's part
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--worker" not in sys.argv:  # a worker imports the tree under test, first on its PYTHONPATH
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # this checkout's harness, whichever tree a worker runs

import harness  # noqa: E402

WORDS = ("cache chunk key value prefix token model answer question document system prompt layer head memory "
         "daemon tier request stream byte hash tenant budget eviction batch decode prefill slot router").split()
STAGES = ("tokenize", "keys", "lookup", "placement")


# ---- the workload ---------------------------------------------------------------------------------------------

def document(tokenizer, num_tokens: int, seed: int = 0) -> str:
    """Text of about num_tokens tokens (words of the cache's own vocabulary, sentences, paragraphs)."""
    rng = random.Random(seed)
    sentences = []
    while True:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + ".")
        if len(sentences) % 64 == 0 and len(tokenizer(" ".join(sentences))["input_ids"]) >= num_tokens:
            break
    text = " ".join(sentences)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:num_tokens])


def questions(again: bool):
    """Each request's question: a new one (the chat's new turn) or, with --again, the warmed chat itself."""
    return itertools.repeat(0) if again else itertools.count(1)


def messages(doc: str, question: int) -> list[tuple[str, str]]:
    return [("system", doc), ("user", f"Question {question}: which tier does part {question} name first?")]


def negligible_model(folder: Path) -> Path:
    """A random 2-layer Llama of hidden 64 with SmolLM2's tokenizer and template, saved once."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from inference_service.model.weights import prepare_default_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---- in process (a child per tree) ---------------------------------------------------------------------------

def in_process_worker(args) -> None:
    """Runs in a child whose sys.path starts with the tree under test; prints one JSON line per measurement."""
    from inference_service.__main__ import load_engine, make_store
    from inference_service.engine.engine import GenerationParams
    from inference_service.serving.config import parse_config

    flags = ["--model", args.model, "--cache-addr", args.daemon, "--device", args.device]
    if args.l0[0] == "off":
        flags += ["--l0-bytes", "0"]
    config = parse_config(flags)
    engine = load_engine(config, make_store(config))
    docs = {length: document(engine.tokenizer, length, seed=length) for length in args.lengths}
    question = questions(args.again)
    for length in args.lengths:  # asked once before: its chunks are stored (and in L0 when L0 is on)
        engine.generate(GenerationParams(messages=tuple(messages(docs[length], 0)), max_new_tokens=1))
        engine.flush_writes(60)

    def measure(request: dict) -> dict:  # one measurement per request line, the trees alternating
        params = GenerationParams(messages=tuple(messages(docs[request["length"]], next(question))),
                                  max_new_tokens=1, mode=request["mode"])
        outcome = engine.generate(params)
        result = {"ttft_ms": outcome.ttft_ms, "cached_tokens": outcome.cached_tokens,
                  "prompt_tokens": outcome.prompt_tokens}
        return result | (replay_stages(engine, params) if request["mode"] == "prefix_cache" else {})

    harness.serve_worker(measure)
    engine.flush_writes(60)


def replay_stages(engine, params) -> dict:
    """Each host stage of the request (a prompt or a chat), run again alone and timed (ms)."""
    import torch

    from inference_service.engine_parts import planning
    from inference_service.reuse import assembler
    from kvboost_keys import prompts

    parts = planning.for_request(engine.parts, params)
    cache = getattr(parts, "token_cache", None)
    start = time.perf_counter()
    if cache is not None:
        segments = prompts.tokenize_request(parts.tokenizer, params.prompt, params.messages, None, cache,
                                            parts.namespace)
    else:
        segments = prompts.tokenize_request(parts.tokenizer, params.prompt, params.messages, None)
    tokenized = time.perf_counter()
    plan = prompts.plan_prompt(parts.namespace, segments, parts.config.chunk_size)
    keyed = time.perf_counter()
    if hasattr(assembler, "look_up"):  # the request's own Lookup (with what continues the run)
        assembler.look_up(parts.store, parts.namespace, plan, False)
    else:  # the tree's first Lookup (its second, for a partial chunk, falls in placement)
        parts.store.lookup(parts.namespace, list(plan.prefix_keys))
    looked_up = time.perf_counter()
    geometry = parts.geometry
    shape = (geometry.num_layers, geometry.num_kv_heads, plan.num_tokens + 1, geometry.head_dim)
    buffers = (torch.zeros(shape, dtype=parts.dtype, device=parts.device),
               torch.zeros(shape, dtype=parts.dtype, device=parts.device))
    placing = time.perf_counter()
    host = getattr(parts.writeback, "host", None)  # the host tier (CUDA), placed after L0 as a request's would be
    context = assembler.assemble_context(parts.store, parts.namespace, plan, buffers, False, parts.key_rope, parts.l0,
                                         host=host)
    if parts.device.type == "cuda":
        torch.cuda.synchronize()
    placed = time.perf_counter()
    return {"tokenize": (tokenized - start) * 1e3, "keys": (keyed - tokenized) * 1e3,
            "lookup": (looked_up - keyed) * 1e3,
            # assemble_context runs the Lookup(s) and places; the Lookup measured alone is taken out
            "placement": max(0.0, (placed - placing) - (looked_up - keyed)) * 1e3,
            "replayed_cached_tokens": context.num_cached_tokens}


# ---- through kvboost_server ----------------------------------------------------------------------------------

def start_server(stack: ExitStack, tree: Path, model: str, work: Path, label: str, device: str) -> tuple[str, str]:
    """(HTTP base URL, gRPC address) of `python -m kvboost_server` of that tree, beside a daemon of its own."""
    from tests.e2e.one_process import start_one_process

    daemon = harness.start_daemon(stack, work, name=f"lmdb-{label}", tree=tree)
    server, grpc_address = start_one_process(model, daemon.address, work / f"server-{label}.log", device=device,
                                             tree=tree, timeout_s=180)
    stack.callback(server.terminate)
    return server.address, grpc_address


_MODEL_IDS: dict[str, str] = {}


def http_ttft(client, base: str, chat: list[tuple[str, str]]) -> float:
    """ms from sending a streamed chat completion to its first content."""
    body = {"model": client.get(f"{base}/v1/models").json()["data"][0]["id"] if base not in _MODEL_IDS else
            _MODEL_IDS[base], "stream": True, "max_tokens": 2,
            "messages": [{"role": role, "content": content} for role, content in chat]}
    start = time.perf_counter()
    with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data:") and '"content"' in line and '"content":""' not in line.replace(" ", ""):
                first = time.perf_counter()
                for _ in lines:  # the rest of the stream
                    pass
                return (first - start) * 1e3
    raise RuntimeError("the stream ended without content")


def grpc_ttft(stub, chat: list[tuple[str, str]]) -> float:
    """ms from sending a streamed Generate to its first token event."""
    from kvboost.v1 import inference_pb2 as pb

    request = pb.GenerateRequest(messages=[pb.ChatMessage(role=role, content=content) for role, content in chat],
                                 max_new_tokens=2)
    start = time.perf_counter()
    first = None
    for event in stub.Generate(request, timeout=300):
        if first is None and event.token_ids:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("no token came back")
    return (first - start) * 1e3


# ---- the run ---------------------------------------------------------------------------------------------------

def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    trees = harness.trees(args.baseline_tree)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as folder, ExitStack() as stack:
        work = Path(folder) if args.work_dir is None else args.work_dir
        work.mkdir(parents=True, exist_ok=True)
        from inference_service.model.weights import prepare_default_model

        model = str(prepare_default_model() if args.smollm2 else negligible_model(args.model_dir or work / "negligible"))
        tokenizer = AutoTokenizer.from_pretrained(model)
        if "tokenizer" in args.parts:
            print_tokenizer(tokenizer, args)
        if "in-process" in args.parts:
            rows += run_in_process(stack, trees, model, work, args)
            print_rows(rows, args)
        if {"http", "grpc"} & set(args.parts):
            rows += run_served(stack, trees, model, work, tokenizer, args)
    return rows


def run_in_process(stack: ExitStack, trees: dict, model: str, work: Path, args) -> list[dict]:
    samples: dict[tuple, list[dict]] = {}
    for l0 in args.l0:
        workers = {}
        for label, tree in trees.items():
            daemon = harness.start_daemon(stack, work, name=f"lmdb-ip-{label}-{l0}", tree=tree)
            worker = harness.TreeWorker(Path(__file__).resolve(), tree, [
                "--model", model, "--daemon", daemon.address, "--device", args.device, "--l0", l0,
                "--lengths", *map(str, args.lengths), *(["--again"] if args.again else [])], work / f"worker-{label}.log")
            stack.callback(worker.close)
            workers[label] = worker
        for length in args.lengths:
            modes = ["prefix_cache"] + (["baseline"] if length in args.cold_lengths and l0 == args.l0[0] else [])
            for mode in modes:
                for turn in range(args.rounds if mode == "prefix_cache" else max(1, args.rounds // 2)):
                    for label in harness.in_turn(workers, turn):  # alternating: one request each, in turn
                        samples.setdefault((label, l0, length, mode), []).append(
                            workers[label].ask({"length": length, "mode": mode}))
        for worker in workers.values():
            worker.close()
    rows = []
    for (label, l0, length, mode), measured in samples.items():
        row = harness.summarize(measured, part="in-process", tree=label, length=length,
                                source="cold" if mode == "baseline" else f"L0 {l0}")
        row.update(prompt_tokens=measured[0]["prompt_tokens"], cached_tokens=measured[0]["cached_tokens"])
        if mode == "prefix_cache":
            row["host"] = sum(row[stage] for stage in STAGES)
        rows.append(row)
    return rows


def wait_for_write_backs(stub, timeout_s: float = 120.0) -> None:
    """Until the service reports no write-back in flight and its stored-chunk count is non-zero and unchanged over
    0.3 s: a tree older than the `writebacks_in_flight` field reads 0 for it, and the count still tells."""
    from kvboost.v1 import inference_pb2 as pb

    from tests.conftest import wait_for

    seen = [-1]

    def settled() -> bool:
        stats = stub.Stats(pb.ServiceStatsRequest(), timeout=30)
        stored = stats.chunks_stored
        done, seen[0] = stored > 0 and stored == seen[0] and stats.writebacks_in_flight == 0, stored
        return done

    wait_for(settled, "the first answers' write-backs", timeout_s=timeout_s, interval_s=0.3)


def run_served(stack: ExitStack, trees: dict, model: str, work: Path, tokenizer, args) -> list[dict]:
    import grpc
    import httpx

    from kvboost.v1 import inference_pb2_grpc

    servers = {label: start_server(stack, tree, model, work, label, args.device) for label, tree in trees.items()}
    client = stack.enter_context(httpx.Client())
    stubs = {}
    for label, (_, address) in servers.items():
        channel = stack.enter_context(grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]))
        stubs[label] = inference_pb2_grpc.InferenceServiceStub(channel)
    docs = {length: document(tokenizer, length, seed=length) for length in args.lengths}
    for base, _ in servers.values():  # asked once before
        _MODEL_IDS[base] = client.get(f"{base}/v1/models").json()["data"][0]["id"]
        for length in args.lengths:
            http_ttft(client, base, messages(docs[length], 0))
    for stub in stubs.values():  # the first answers' write-backs land before any timed request
        wait_for_write_backs(stub)
    question = questions(args.again)
    samples: dict[tuple, list[float]] = {}
    for length in args.lengths:
        for turn in range(args.rounds):
            for part in [p for p in ("http", "grpc") if p in args.parts]:
                for label in harness.in_turn(servers, turn):
                    base = servers[label][0]
                    chat = messages(docs[length], next(question))
                    ttft = http_ttft(client, base, chat) if part == "http" else grpc_ttft(stubs[label], chat)
                    samples.setdefault((part, label, length), []).append(ttft)
    return [{"part": part, "tree": label, "source": "L0 auto", "length": length,
             "ttft_ms": harness.median(values), "p90_ms": harness.percentile(values, 0.9)}
            for (part, label, length), values in samples.items()]


def print_tokenizer(tokenizer, args) -> None:
    """Template + tokenize of a chat whose system message is new (a cache miss) and repeated (a hit), against the
    tokenizer's own apply_chat_template, alternating, medians (ms)."""
    from kvboost_keys.token_cache import TokenCache

    rows = []
    for length in args.lengths:
        doc = document(tokenizer, length, seed=length)
        own, new, repeated = [], [], []
        for round_index in range(args.rounds):
            cache = TokenCache(tokenizer, 256 << 20)
            conversation = [{"role": r, "content": c} for r, c in messages(doc + f" ({round_index})", 1)]
            start = time.perf_counter()
            expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
            middle = time.perf_counter()
            ids = cache.encode_chat(conversation, b"scope", True)
            end = time.perf_counter()
            conversation[-1]["content"] = "Another question?"
            again = time.perf_counter()
            cache.encode_chat(conversation, b"scope", True)
            repeated.append((time.perf_counter() - again) * 1e3)
            assert ids == list(expected), "the cache's ids differ from the tokenizer's"
            own.append((middle - start) * 1e3)
            new.append((end - middle) * 1e3)
        own_ms, new_ms = harness.median(own), harness.median(new)
        rows.append({"tokens": len(expected), "own": own_ms, "new": new_ms, "ratio": f"{new_ms / own_ms:.2f}x",
                     "repeated": harness.median(repeated)})
    print(harness.table(rows, ["tokens", ("own", "apply_chat_template ms"), ("new", "cache, new document ms"), "ratio",
                               ("repeated", "cache, repeated ms")]))


def print_rows(rows: list[dict], args) -> None:
    if not rows:
        return
    shown = [{**row, "tokens": row.get("prompt_tokens", row["length"]),
              **({"rest": row["ttft_ms"] - row["host"]} if "host" in row else {})} for row in rows]
    model = "SmolLM2-135M-Instruct" if args.smollm2 else "negligible model (random, hidden 64, 2 layers, SmolLM2 tokenizer + template)"
    harness.print_table(f"bench_overhead: {model}, {'the same chat again' if args.again else 'a new question'}, "
                        f"{args.rounds} rounds, medians, device {args.device}", shown,
                        ["part", "tree", "source", "tokens", ("cached_tokens", "cached"), ("ttft_ms", "TTFT ms"),
                         *STAGES, "host", "rest"])
    harness.print_ratios(rows, "ttft_ms", ("part", "source", "length"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["tokenizer", "in-process", "http", "grpc"],
                        choices=["tokenizer", "in-process", "http", "grpc"],
                        help="what to measure (default: all); tokenizer: the tokenization cache against the "
                             "tokenizer's own encode, new and repeated documents (this tree only)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192, 32768],
                        help="system-message lengths in tokens")
    parser.add_argument("--cold-lengths", nargs="*", type=int, default=[2048, 8192],
                        help="lengths also measured cold, BASELINE mode (32k cold takes ~20 s a request on a CPU)")
    parser.add_argument("--rounds", type=int, default=7, help="requests per length, part and tree")
    parser.add_argument("--l0", nargs="+", default=["auto", "off"], choices=["auto", "off"],
                        help="in process: L0 at its default (auto) and off (every chunk from the daemon)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--smollm2", action="store_true", help="the embedded SmolLM2 instead of the negligible model")
    parser.add_argument("--again", action="store_true",
                        help="ask the warmed chat itself again (cached to its last token), not a new question")
    parser.add_argument("--model-dir", type=Path, help="where to keep the negligible model (default: a temp folder)")
    parser.add_argument("--work-dir", type=Path, help="keep the daemons' data and the logs here (default: a temp folder)")
    harness.add_arguments(parser, rounds=None, baseline=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--daemon", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        in_process_worker(args)
        return
    rows = run(args)
    print_rows([row for row in rows if row["part"] != "in-process"], args)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
