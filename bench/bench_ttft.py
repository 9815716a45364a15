"""TTFT of BASELINE, PREFIX_CACHE and CHUNK_KV_REUSE on SmolLM2 (CPU): a long shared context plus a new question.

The context (a whole number of chunks unless --unaligned) is warmed once per store; every run then
asks a question never seen before, so the cached modes reuse the context's full chunks and prefill
only the rest. TTFT counts everything from
request arrival: tokenize, hash, lookup, fetch, decode, assembly, prefill, first token. Modes are
interleaved within each run and ratios are taken against BASELINE of the same run set. Stores: an
in-process dict and the real cache daemon (started here unless --daemon-addr is given).

    python bench/bench_ttft.py             # 256/512/1024/1600/3000 tokens, 5 runs each
    python bench/bench_ttft.py --quick     # 512 and 1600 tokens, 5 runs
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from inference_service.store.grpc_store import GrpcStoreOptions, GrpcChunkStore# noqa: E402
from inference_service.store.memory import InMemoryStore# noqa: E402
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams# noqa: E402
from inference_service.model.weights import DEFAULT_MODEL# noqa: E402
from inference_service.model.loading import load_model# noqa: E402

MODES = ("baseline", "prefix_cache", "chunk_kv_reuse")
QUESTION_TOKENS = 30
PASSAGE = (
    "Section {n}. The maintenance handbook describes the pumping station in detail. Each of the four "
    "pumps is inspected weekly: bearings are checked for noise, seals for leaks, and the motor current is "
    "compared with the value on the nameplate. Valves are exercised monthly. The control room keeps a log "
    "of alarms, with the time, the operator on duty and the action taken. Spare parts are stored in the "
    "east building, sorted by pump number, and the inventory is counted at the end of every quarter.\n"
)
SUBJECTS = ("pump", "valve", "seal", "alarm", "bearing", "motor", "log", "operator", "inventory", "building")


def context_length(prompt_tokens: int, chunk_size: int, aligned: bool) -> int:
    """Tokens of shared context for a prompt of about prompt_tokens tokens: a whole number of chunks when
    aligned (what Warm's chunk_boundary_aligned asks for), else whatever the question leaves."""
    if not aligned:
        return prompt_tokens - QUESTION_TOKENS
    return max(chunk_size, round((prompt_tokens - QUESTION_TOKENS) / chunk_size) * chunk_size)


def build_context(tokenizer, num_tokens: int) -> str:
    """Handbook text that tokenizes to exactly num_tokens tokens, also when a question follows it."""
    text, section = "", 0
    while len(tokenizer(text)["input_ids"]) < num_tokens + 200:
        section += 1
        text += PASSAGE.format(n=section)
    ids = tokenizer(text)["input_ids"]
    for start in range(200):  # a cut whose tokens survive re-tokenizing next to the question
        context = tokenizer.decode(ids[start : start + num_tokens])
        if tokenizer(context + question(0))["input_ids"][:num_tokens] == ids[start : start + num_tokens]:
            return context
    raise RuntimeError(f"no cut of the handbook keeps its {num_tokens} tokens")


def question(run: int) -> str:
    """A question no earlier run asked (about QUESTION_TOKENS tokens), starting a new line."""
    subject = SUBJECTS[run % len(SUBJECTS)]
    return (f"\nQuestion {run * 7919 % 10007}: according to the handbook, how often is the {subject} checked, "
            "who records it, and where is it kept? Answer:")


def measure(engine: Engine, context: str, runs: int, modes: tuple[str, ...]) -> dict[str, list[float]]:
    engine.warm(context)
    ttft: dict[str, list[float]] = {mode: [] for mode in modes}
    cached: dict[str, int] = {}
    for run in range(runs):
        for mode in modes:  # interleaved, so drift hits every mode alike
            prompt = context + question(run * len(modes) + modes.index(mode))
            outcome = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=1, mode=mode))
            engine.flush_writes()  # write-back of the question's chunk never overlaps the next request
            assert not outcome.degraded, "the cache was unreachable during the benchmark"
            ttft[mode].append(outcome.ttft_ms)
            cached[mode] = outcome.cached_tokens
            cached["prompt"] = outcome.prompt_tokens
    return {"ttft_ms": ttft, "cached_tokens": cached}


def start_daemon_cache(stack: ExitStack, address: str | None) -> GrpcChunkStore | None:
    """A client for the given daemon, or for one started here; None when no daemon can run."""
    if address is None:
        try:
            from tests.conftest import pick_free_port
            from tests.e2e.daemon_process import start_daemon

            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ttft-"))) / "lmdb"
            daemon = start_daemon(data_dir, pick_free_port(), "--max-bytes", "8GB")
        except Exception as error:  # noqa: BLE001 - the benchmark still runs in-process
            print(f"cache daemon could not start ({error}); benchmarking the in-process store only")
            return None
        stack.callback(daemon.terminate)
        address = daemon.address
    cache = GrpcChunkStore(GrpcStoreOptions(address=address, fetch_timeout_s=60.0, store_timeout_s=60.0))
    stack.callback(cache.close)
    if not cache.check():
        print(f"cache daemon at {address} does not answer; benchmarking the in-process store only")
        return None
    return cache


def print_table(results: list[dict]) -> None:
    header = (f"{'store':<10} {'prompt':>6} {'cached':>6} {'BASELINE ms':>11} {'PREFIX ms':>9} {'x':>6} "
              f"{'CHUNK_KV ms':>11} {'x':>6} {'vs in-proc':>10}")
    print(header)
    print("-" * len(header))
    in_process = {r["length"]: r for r in results if r["store"] == "in-process"}
    for r in results:
        medians = r["median_ms"]
        base = medians["baseline"]
        relative = ""
        if r["store"] == "daemon" and r["length"] in in_process:
            relative = f"{medians['prefix_cache'] / in_process[r['length']]['median_ms']['prefix_cache']:.2f}x"
        print(f"{r['store']:<10} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} {base:>11.1f} "
              f"{medians['prefix_cache']:>9.1f} {base / medians['prefix_cache']:>5.1f}x "
              f"{medians['chunk_kv_reuse']:>11.1f} {base / medians['chunk_kv_reuse']:>5.1f}x {relative:>10}")


def write_plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4))
    for store in sorted({r["store"] for r in results}):
        rows = [r for r in results if r["store"] == store]
        for mode in MODES if store == "in-process" else MODES[1:]:
            axis.plot([r["prompt_tokens"] for r in rows], [r["median_ms"][mode] for r in rows], marker="o",
                      label=f"{mode} ({store})")
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("median TTFT (ms)")
    axis.set_yscale("log")
    axis.set_title("SmolLM2-135M TTFT, CPU")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 1600, 3000])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--daemon-addr", help="a running cache daemon (default: start one here)")
    parser.add_argument("--no-daemon", action="store_true", help="in-process store only")
    parser.add_argument("--quick", action="store_true", help="512 and 1600 tokens only")
    parser.add_argument("--unaligned", action="store_true",
                        help="context of prompt length minus the question, not a whole number of chunks")
    parser.add_argument("--kv-cache-bits", type=int, choices=(16, 8, 4), default=16, help="storage width")
    parser.add_argument("--kv-keys-before-rope", action="store_true",
                        help="at 8 and 4 bits, store keys un-rotated (RoPE redone on every hit)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [512, 1600] if args.quick else args.lengths
    assert args.runs >= 5, "medians need at least 5 runs"

    loaded = load_model(args.model, device="cpu", dtype="float32")
    config = EngineConfig(chunk_size=args.chunk_size, kv_cache_bits=args.kv_cache_bits,
                          kv_keys_before_rope=args.kv_keys_before_rope)
    results = []
    with ExitStack() as stack:
        stores = {"in-process": InMemoryStore()}
        daemon = None if args.no_daemon else start_daemon_cache(stack, args.daemon_addr)
        if daemon is not None:
            stores["daemon"] = daemon
        for length in lengths:
            context = build_context(loaded.tokenizer, context_length(length, args.chunk_size, not args.unaligned))
            for store, cache in stores.items():
                engine = Engine(loaded.model, loaded.tokenizer, config, cache, model_id=loaded.model_id)
                # Warm-up request: first-call allocations and lazy imports stay out of the medians.
                engine.generate(GenerationParams(prompt="Warm-up.", max_new_tokens=1, mode="baseline"))
                measured = measure(engine, context, args.runs, MODES)
                engine.close()
                results.append({
                    "store": store, "length": length, "prompt_tokens": measured["cached_tokens"]["prompt"],
                    "cached_tokens": measured["cached_tokens"]["prefix_cache"],
                    "median_ms": {mode: statistics.median(v) for mode, v in measured["ttft_ms"].items()},
                    "ttft_ms": measured["ttft_ms"],
                })
                print(f"  {store} {length}: " + ", ".join(
                    f"{mode} {statistics.median(v):.1f} ms" for mode, v in measured["ttft_ms"].items()), flush=True)
    keys = "" if args.kv_cache_bits == 16 else (", keys before RoPE" if config.keys_before_rope else ", keys after RoPE")
    print(f"\n{loaded.model_id}, CPU fp32, {torch.get_num_threads()} threads, chunk_size {args.chunk_size}, "
          f"{args.kv_cache_bits}-bit storage{keys}, "
          f"median of {args.runs} runs, new ~{QUESTION_TOKENS}-token question per run\n")
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"ttft-{stamp}.json").write_text(json.dumps(results, indent=2))
    write_plot(results, args.out / f"ttft-{stamp}.png")


if __name__ == "__main__":
    main()
