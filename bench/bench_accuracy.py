"""Answer accuracy, agreement and TTFT by reuse mode: RAG questions over 4-6 documents (bench/rag_dataset.py) each
warmed alone and presented in a new order, every column its own engine, columns interleaved per question; and whole
prompts reused by prefix at 16, 8 and 4 bits (the identity table). Agreement and first-token KL against full prefill.

The fidelity guard is tuned on a development half of the questions (the largest threshold whose guarded answers stay
within 0.02 of full prefill's accuracy) and checked on the held-out half; accuracy with a 95% bootstrap interval.

    python bench/bench_accuracy.py            # 100 questions, all 52 identity prompts
    python bench/bench_accuracy.py --model qwen2.5-coder-0.5b --no-identity --questions 120 \
        --columns "full prefill,reuse none,selective,cacheblend 15%,cacheblend 30%"
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from inference_service import mkl_dispatch  # noqa: E402

MKL_DISPATCH = mkl_dispatch.apply()  # before torch: the service's default (KVBOOST_MKL_DISPATCH=vendor to compare)

import torch  # noqa: E402

from bench import harness  # noqa: E402
from inference_service.kv import codec  # noqa: E402
from inference_service.store.memory import InMemoryStore# noqa: E402
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams# noqa: E402
from inference_service.model.weights import DEFAULT_MODEL# noqa: E402
from inference_service.model.loading import load_model# noqa: E402
from inference_service.engine_parts.verification import first_token_kl# noqa: E402
from inference_service.engine_parts.verification import matching_prefix_tokens# noqa: E402
from tests.inference_service.test_identity import identity_cases  # noqa: E402
from rag_dataset import build_documents, build_questions, chat_segments, document_segment  # noqa: E402


GUARD_COLUMN = "cacheblend 15%"  # the column the fidelity guard is tuned on and checked with
GUARD_TARGET = 0.02  # accuracy the guarded answers may lose against full prefill on the development split
DEV_FRACTION = 0.5  # the share of the questions that tunes the guard; the rest is held out
IDENTITY_CHUNK_SIZE = 128  # the identity part's chunk: the service default, where int8's scales cost least
IDENTITY_NEW_TOKENS = 16


@dataclass(slots=True, frozen=True)
class Column:
    name: str
    mode: str
    bits: int = 16
    strategy: str | None = None  # repair of content hits (CHUNK_KV_REUSE columns)
    ratio: float | None = None  # cacheblend recompute ratio; 0.0 plots `none`
    guard: float = 0.0  # the fidelity guard's threshold (0: off)


def columns() -> list[Column]:
    def blend(ratio: float, bits: int = 16, name: str | None = None) -> Column:
        return Column(name or f"cacheblend {round(ratio * 100)}%", "chunk_kv_reuse", bits, "cacheblend", ratio)

    return [
        Column("full prefill", "baseline"),
        Column("prefix cache", "prefix_cache"),
        Column("reuse none", "chunk_kv_reuse", strategy="none", ratio=0.0),
        Column("selective", "chunk_kv_reuse", strategy="selective"),
        blend(0.05), blend(0.15), blend(0.30),
        blend(0.15, 8, "int8 (cb 15%)"), blend(0.15, 4, "int4 (cb 15%)"),
    ]


def make_engine(loaded, bits: int, chunk_size: int, keys_before_rope: bool = False, guard: float = 0.0) -> Engine:
    """An engine with its own in-process store (so columns never share chunks), warmed up once."""
    config = EngineConfig(chunk_size=chunk_size, kv_cache_bits=bits, kv_keys_before_rope=keys_before_rope,
                          guard_threshold=guard)
    engine = Engine(loaded.model, loaded.tokenizer, config, InMemoryStore(), model_id=loaded.model_id)
    engine.generate(GenerationParams(prompt="Warm-up.", max_new_tokens=1, mode="baseline"))
    return engine


def ask(engine: Engine, column: Column, max_new_tokens: int, **prompt):
    """(outcome, first-token logits [vocab]) of one greedy request; write-back finished before returning."""
    params = GenerationParams(**prompt, max_new_tokens=max_new_tokens, mode=column.mode,
                              recompute_strategy=column.strategy,
                              recompute_ratio=column.ratio if column.strategy == "cacheblend" else None)
    outcome, first_logits = engine.generate_with_first_logits(params)
    engine.flush_writes()
    assert not outcome.degraded, "the store was unreachable"
    return outcome, first_logits


def run_questions(loaded, documents, questions, chunk_size: int, max_new_tokens: int,
                  cols: list[Column] | None = None) -> dict:
    cols = cols or columns()
    assert cols[0].name == "full prefill", "full prefill runs first: it is every column's reference"
    engines = [make_engine(loaded, column.bits, chunk_size, guard=column.guard) for column in cols]
    for engine in engines:
        for document in documents:
            engine.warm(document_segment(document), content_addressed=True)
    rows = {column.name: {"correct": [], "agree": [], "kl": [], "ttft_ms": [], "reuse": [], "recomputed": [],
                          "risk": [], "guarded": []}
            for column in cols}
    for number, question in enumerate(questions):
        segments = chat_segments(loaded.tokenizer, documents, question)
        reference = None
        for column, engine in zip(cols, engines):
            outcome, logits = ask(engine, column, max_new_tokens, segments=tuple(segments))
            if reference is None:  # full prefill comes first
                reference = (outcome.output_token_ids, logits)
            row = rows[column.name]
            row["correct"].append(question.answer.lower() in outcome.output_text.lower())
            row["agree"].append(outcome.output_token_ids == reference[0])
            row["kl"].append(first_token_kl(reference[1], logits))
            row["ttft_ms"].append(outcome.ttft_ms)
            row["reuse"].append(outcome.kv_reuse_ratio)
            row["recomputed"].append(outcome.recomputed_tokens / max(1, outcome.cached_tokens))
            row["risk"].append(outcome.repair_risk)
            row["guarded"].append(outcome.fidelity_guard)
        if (number + 1) % 10 == 0:
            print(f"  {number + 1}/{len(questions)} questions", flush=True)
    for engine in engines:
        engine.close()
    return {"columns": cols, "rows": rows}


def identity_prompts(loaded, documents, questions, limit: int | None) -> list[dict]:
    """The identity test's prompts (tests/inference_service/test_identity.py: short, chunk-aligned, one past a boundary,
    mixed, chats) and every RAG question's whole prompt: requests for exact prefix reuse."""
    cases = identity_cases(loaded.tokenizer)
    if limit:  # spread over the kinds
        cases = cases[:: max(1, len(cases) // limit)][:limit]
    rag = [{"segments": tuple(chat_segments(loaded.tokenizer, documents, question))} for question in questions]
    return cases + rag


def run_identity(loaded, cases: list[dict], chunk_size: int, max_new_tokens: int) -> dict:
    """Prompts reused by exact prefix after one write-back, stored at 16, 8 and 4 bits (quantized keys before
    and after RoPE): greedy agreement with full prefill (whole outputs, and tokens before the first
    difference) over the prompts that had prefix hits, and bytes stored."""
    full, reference_engine = Column("full prefill", "baseline"), make_engine(loaded, 16, chunk_size)
    references, reference_logits = [], []
    for case in cases:
        outcome, logits = ask(reference_engine, full, max_new_tokens, **case)
        references.append(outcome.output_token_ids)
        reference_logits.append(logits)
    reference_engine.close()
    results = {}
    for name, bits, keys_before_rope in STORAGE:
        engine = make_engine(loaded, bits, chunk_size, keys_before_rope)
        column = Column(name, "prefix_cache", bits)
        same_output = same_tokens = total_tokens = with_hits = 0
        kls, differing = [], []
        for number, (case, reference, logits) in enumerate(zip(cases, references, reference_logits)):
            ask(engine, column, 1, **case)  # stores the prompt's full chunks
            outcome, first_logits = ask(engine, column, max_new_tokens, **case)
            if outcome.cached_tokens == 0:
                continue  # shorter than a chunk: nothing reused, agreement would be free
            with_hits += 1
            same_output += outcome.output_token_ids == reference
            if outcome.output_token_ids != reference:
                differing.append(number)
            same_tokens += matching_prefix_tokens(reference, outcome.output_token_ids)
            total_tokens += len(reference)
            kls.append(first_token_kl(logits, first_logits))
        stats = engine.stats()
        engine.close()
        # 16-bit storage keeps the model's dtype (4 bytes an element on CPU fp32); the fp16 size is what
        # the same chunks take from a bf16/fp16 model, the usual baseline for "x fewer bytes".
        element_bytes = loaded.model.dtype.itemsize
        payload = stats["bytes_stored"] - codec.HEADER_SIZE * stats["chunks_stored"]
        fp16_bytes = payload * 2 // element_bytes + codec.HEADER_SIZE * stats["chunks_stored"]
        results[name] = {"bits": bits, "keys_before_rope": engine.config.keys_before_rope, "prompts": len(cases), "prompts_with_hits": with_hits, "fp16_equivalent_bytes": fp16_bytes,
                         "output_agreement": same_output / max(1, with_hits),
                         "token_agreement": same_tokens / max(1, total_tokens),
                         "first_token_kl": statistics.mean(kls) if kls else 0.0, "differing_prompts": differing,
                         "bytes_stored": stats["bytes_stored"], "chunks_stored": stats["chunks_stored"]}
    return results


# (row name, bits, keys before RoPE) of the identity table
STORAGE = (("16-bit", 16, False), ("8-bit", 8, False), ("8-bit, keys before RoPE", 8, True),
           ("4-bit", 4, False), ("4-bit, keys before RoPE", 4, True))


def bootstrap_interval(values: list[bool], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of values (questions resampled with replacement)."""
    import random

    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def guarded_answers(full: dict, blend: dict, threshold: float) -> tuple[list[bool], list[float], float]:
    """(correct, TTFT ms, share fallen back) had the guard run at threshold on these questions: full prefill's
    answer and TTFT where the risk exceeds it (an upper bound on the guarded request's cost), cacheblend's
    elsewhere."""
    fired = [0.0 < threshold < risk for risk in blend["risk"]]
    correct = [f_ok if fire else b_ok for fire, f_ok, b_ok in zip(fired, full["correct"], blend["correct"])]
    ttft = [f_ms if fire else b_ms for fire, f_ms, b_ms in zip(fired, full["ttft_ms"], blend["ttft_ms"])]
    return correct, ttft, sum(fired) / max(1, len(fired))


def guard_curve(rows: dict, column: str) -> list[dict]:
    """The trade-off of the guard over every threshold that changes a decision on these questions."""
    full, blend = rows["full prefill"], rows[column]
    full_ttft = harness.median(full["ttft_ms"])
    thresholds = sorted({risk for risk in blend["risk"] if risk > 0}) + [float("inf")]
    curve = []
    for threshold in [t * (1 - 1e-9) for t in thresholds[:-1]] + [thresholds[-1]]:
        correct, ttft, fallen = guarded_answers(full, blend, threshold)
        curve.append({"threshold": threshold, "accuracy": statistics.mean(correct), "fallback_share": fallen,
                      "ttft_ratio": harness.median(ttft) / full_ttft})
    return curve


def tune_guard(rows: dict, column: str, target: float) -> float:
    """The largest threshold (fewest fallbacks) whose guarded accuracy is within target of full prefill's."""
    floor = statistics.mean(rows["full prefill"]["correct"]) - target
    passing = [point["threshold"] for point in guard_curve(rows, column) if point["accuracy"] >= floor]
    return max(passing) if passing else min(r for r in rows[column]["risk"] if r > 0) * 0.5


def summarize(run: dict) -> list[dict]:
    rows = run["rows"]
    full_ttft = harness.median(rows["full prefill"]["ttft_ms"])
    table = []
    for column in run["columns"]:
        row = rows[column.name]
        ttft = harness.median(row["ttft_ms"])
        low, high = bootstrap_interval(row["correct"])
        table.append({
            "column": column.name, "ratio": column.ratio, "accuracy_ci": [low, high],
            "fallback_share": statistics.mean(row["guarded"]) if row["guarded"] else 0.0,
            "accuracy": statistics.mean(row["correct"]), "agreement": statistics.mean(row["agree"]),
            "first_token_kl": statistics.mean(row["kl"]), "ttft_ms": ttft, "ttft_ratio": ttft / full_ttft,
            "reused": statistics.mean(row["reuse"]), "recomputed": statistics.mean(row["recomputed"]),
        })
    return table


def print_tables(table: list[dict], identity: dict) -> None:
    if table:
        print_questions(table)
    if identity:
        print_identity(identity)


def print_questions(table: list[dict]) -> None:
    rows = [{**row, "ci": "[{:.3f}, {:.3f}]".format(*row["accuracy_ci"]), "kl": f"{row['first_token_kl']:.4f}"}
            for row in table]
    print(harness.table(rows, ["column", "accuracy", ("ci", "95% CI"), ("agreement", "agree"), ("kl", "1st-tok KL"),
                               ("ttft_ms", "TTFT ms"), ("ttft_ratio", "x full"), "reused", ("recomputed", "recomp"),
                               ("fallback_share", "guarded")], digits=3))


def print_identity(identity: dict) -> None:
    exact = identity["16-bit"]
    rows = [{**row, "stored_as": name, "kl": f"{row['first_token_kl']:.2e}",
             "fewer": exact["bytes_stored"] / row["bytes_stored"],
             "fewer_fp16": exact["fp16_equivalent_bytes"] / row["bytes_stored"] if row["bits"] != 16 else 1.0}
            for name, row in identity.items()]
    print("\nidentity prompts: agreement over the prompts with prefix hits")
    print(harness.table(rows, [("stored_as", "stored as"), "prompts", ("prompts_with_hits", "w/ hits"),
                               ("output_agreement", "same output"), ("token_agreement", "same tokens"),
                               ("kl", "1st-tok KL"), ("bytes_stored", "bytes stored"), ("fewer", "x fewer"),
                               ("fewer_fp16", "x fewer than fp16")], digits=3))


def write_plot(table: list[dict], path: Path, model_name: str = "SmolLM2-135M") -> None:
    plt = harness.pyplot()
    by_name = {r["column"]: r for r in table}
    blend = sorted((r for r in table if r["ratio"] is not None), key=lambda r: r["ratio"])
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, label in ((axes[0], "accuracy", "answer accuracy"), (axes[1], "ttft_ratio", "TTFT / full prefill")):
        axis.plot([r["ratio"] for r in blend], [r[key] for r in blend], marker="o", label="content reuse + cacheblend")
        for name, style in (("full prefill", "k--"), ("prefix cache", "c:"), ("selective", "m-.")):
            if name in by_name:
                axis.axhline(by_name[name][key], color=style[0], linestyle=style[1:], label=name)
        for name, marker in (("int8 (cb 15%)", "s"), ("int4 (cb 15%)", "^")):
            if name in by_name:
                axis.plot([0.15], [by_name[name][key]], marker=marker, linestyle="", label=name)
        axis.set_xlabel("recompute ratio (0 = repair none)")
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    figure.suptitle(f"{model_name}, RAG questions over documents reused in new orders")
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--identity-prompts", type=int, default=None,
                        help="first N of tests/inference_service/test_identity.py's prompts (default: all 52); the RAG "
                             "questions' prompts are always added")
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--no-identity", action="store_true", help="only the questions table (skips the "
                        "quantized-storage agreement on the identity prompts)")
    parser.add_argument("--no-questions", action="store_true", help="only the identity table (skips the RAG "
                        "questions' columns)")
    parser.add_argument("--columns", help="comma-separated column names to run (default: all); full prefill always "
                        "runs first: " + ", ".join(column.name for column in columns()).replace("%", "%%"))
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, device="cpu", dtype="float32")
    documents = build_documents()
    questions = build_questions(documents, args.questions)
    started = time.perf_counter()
    cols = columns()
    if args.columns:
        wanted = {name.strip() for name in args.columns.split(",")} | {"full prefill"}
        unknown = wanted - {column.name for column in cols}
        if unknown:
            parser.error(f"unknown columns {sorted(unknown)}; choose from {[column.name for column in cols]}")
        cols = [column for column in cols if column.name in wanted]
    guard_column = next((column for column in cols if column.name == GUARD_COLUMN), None)
    run, guard = None, {}
    if not args.no_questions and guard_column is not None:
        split = max(1, min(len(questions) - 1, round(len(questions) * DEV_FRACTION)))
        print(f"development split: {split} questions; held out: {len(questions) - split}", flush=True)
        dev = run_questions(loaded, documents, questions[:split], args.chunk_size, args.max_new_tokens, cols)
        threshold = tune_guard(dev["rows"], guard_column.name, GUARD_TARGET)
        curve = guard_curve(dev["rows"], guard_column.name)
        guarded = Column(f"{guard_column.name} + guard", guard_column.mode, guard_column.bits, guard_column.strategy,
                         guard_column.ratio, guard=threshold)
        print(f"guard threshold tuned on the development split: {threshold:.4g}", flush=True)
        run = run_questions(loaded, documents, questions[split:], args.chunk_size, args.max_new_tokens,
                            cols + [guarded])
        guard = {"threshold": threshold, "target": GUARD_TARGET, "column": guard_column.name,
                 "dev_questions": split, "held_out_questions": len(questions) - split,
                 "dev_table": summarize(dev), "dev_curve": curve}
    elif not args.no_questions:
        run = run_questions(loaded, documents, questions, args.chunk_size, args.max_new_tokens, cols)
    identity = {} if args.no_identity else run_identity(
        loaded, identity_prompts(loaded, documents, questions, args.identity_prompts), IDENTITY_CHUNK_SIZE,
        IDENTITY_NEW_TOKENS)
    table = [] if run is None else summarize(run)
    print(f"\n{loaded.model_id}, CPU fp32, {torch.get_num_threads()} threads, chunk_size {args.chunk_size}, "
          f"{args.questions} questions over 4-6 of {len(documents)} documents, greedy {args.max_new_tokens} tokens, "
          f"TTFT median, {time.perf_counter() - started:.0f} s\n")
    if guard:
        print(f"development split ({guard['dev_questions']} questions):")
        print_questions(guard["dev_table"])
        print(f"\nthe guard on {guard['column']}, development split: threshold -> accuracy, share fallen back, "
              f"TTFT x full (fallbacks at full prefill's TTFT)")
        for point in guard["dev_curve"][:: max(1, len(guard["dev_curve"]) // 12)] + guard["dev_curve"][-1:]:
            print(f"  {point['threshold']:>10.4g}  {point['accuracy']:.3f}  {point['fallback_share']:.2f}  "
                  f"{point['ttft_ratio']:.2f}")
        print(f"kept: {guard['threshold']:.4g} (largest within {guard['target']:.2f} of full prefill)\n")
        print(f"held-out split ({guard['held_out_questions']} questions):")
    print_tables(table, identity)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    harness.write_json(args.out / f"accuracy-{stamp}.json", {"table": table, "identity": identity, "guard": guard})
    if table:
        write_plot(table, args.out / f"accuracy-{stamp}.png", loaded.model_id)
    print(f"\nwrote {args.out}/accuracy-{stamp}.json and .png")


if __name__ == "__main__":
    main()
