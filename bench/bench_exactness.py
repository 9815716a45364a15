"""Exactness on a device: cached answers against uncached ones, bitwise, over prompt lengths, tiers and prefill pieces.

A random-weight model (bench/gpu_model.py: near-ties everywhere, the harsher test) answers one prompt per length (a
document, then a question) with every prefill in pieces of each --pieces size (the scheduler's plan wrapped: a
bench-only hook), on the paths `uncached`, `daemon` (the document warmed, L0 off), `l0-fill` / `l0` (first and second
ask with L0), `host-fill` / `host` (the host tier, L0 off). Each cached answer against the uncached one at its piece
size, and every answer against the first size's: first-token logits torch.equal and greedy tokens identical; each piece
size stores under its own salt. The uncached answer also against plain model.generate at the shortest lengths. A
mismatch is a measurement: the exit code stays 0 and the line says MISMATCH (--perturb shows one).

--sweep PROMPTS: the invariant path (prefill and decode step, also on a CPU; --variant the default path) over many
prompts of --words tokens: daemon, L0, host tier, then batches of 8 at once (uncached and from L0), each against the
prompt's uncached answer alone.

    python bench/bench_exactness.py --json out.json                      # 8B shape, bf16, 100..32k (H100: ~1.5 min)
    python bench/bench_exactness.py --shape tiny --device cpu --lengths 100 300 --dtype float32   # a CPU dry run
    python bench/bench_exactness.py --invariant-prefill --invariant-piece-chunks 4   # forwards of 4 chunks
    python bench/bench_exactness.py --sweep 200 --device cpu --dtype bfloat16 --shape tiny --words 40 1200
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.gpu_model import (CHUNK, QUESTION_WORDS, SHAPES, colocated_daemon, kv_bytes_per_token, log,  # noqa: E402
                             random_model, tier_engines, word_tokenizer, words)
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402

Plain = tuple[list[int], torch.Tensor]  # a sweep's answer: greedy tokens, the first token's logits [vocab] float32
SWEEP_BATCH = 8  # prompts submitted at once in the sweep's batched paths
PATHS = ("uncached", "daemon", "l0-fill", "l0", "host-fill", "host")
EXPECTED_TIER = {"daemon": "daemon", "l0": "l0", "host": "host"}  # where a path's K/V must come from (tier_loads)
HAS_HOST_TIER = "host_tier_bytes" in getattr(EngineConfig, "__dataclass_fields__", {})


@dataclasses.dataclass(slots=True)
class Answer:
    length: int
    path: str
    piece: int
    logits: torch.Tensor  # [vocab] float32, on the CPU: what the first token was chosen from
    token_ids: list[int]
    cached_tokens: int
    prompt_tokens: int
    tiers: dict  # {tier: chunks it placed for this answer}
    ttft_ms: float


def pieces_of(engine: Engine) -> list[int]:
    """Wraps the engine's scheduler so that every prefill (a lone one too, which the scheduler runs whole) runs in
    pieces of at most size[0] tokens; returns size, a one-element list the caller sets (0: the scheduler's own)."""
    scheduler = engine.core.scheduler
    plan = scheduler.plan
    size = [0]

    def planned():
        step = plan()
        if not size[0]:
            return step
        remaining = {state.seq_id: state.num_remaining for state in scheduler.prefilling
                     if state.num_computed is not None}
        pieces = [(seq_id, min(take, size[0])) for seq_id, take in step.pieces]
        groups = []
        for group in step.groups:  # short prefills run whole in one forward: the longer ones become pieces
            pieces += [(seq_id, size[0]) for seq_id in group if remaining.get(seq_id, 0) > size[0]]
            kept = tuple(seq_id for seq_id in group if remaining.get(seq_id, 0) <= size[0])
            groups += [kept] if kept else []
        return dataclasses.replace(step, pieces=tuple(pieces), groups=tuple(groups))

    scheduler.plan = planned
    return size


@contextmanager
def perturbed(model, on: bool):
    """Doubles layer 0's values while on, in every forward of the path (its weights in place, which the decode step
    reads too, so a prompt cached to its last token is perturbed as well): a path that must then be reported
    MISMATCH (the check that the comparison can fail). Halved back after: doubling and halving are exact."""
    if not on:
        yield
        return
    v_proj = model.model.layers[0].self_attn.v_proj
    held = [v_proj.weight] + ([v_proj.bias] if v_proj.bias is not None else [])
    with torch.inference_mode():
        for tensor in held:
            tensor.data.mul_(2)
    try:
        yield
    finally:
        with torch.inference_mode():
            for tensor in held:
                tensor.data.div_(2)


def ask(engine: Engine, prompt: str, length: int, path: str, piece: int, tokens: int, salt: str,
        mode: str | None = None) -> Answer:
    before = engine.stats()["tier_loads"]
    outcome, logits = engine.generate_with_first_logits(GenerationParams(
        prompt=prompt, max_new_tokens=tokens, ignore_eos=True, mode=mode, cache_salt=salt))
    engine.flush_writes()  # its write-back never overlaps the next answer
    assert not outcome.degraded, f"{path}: the cache was unreachable"
    after = engine.stats()["tier_loads"]
    tiers = {tier: counts["chunks"] - before.get(tier, {}).get("chunks", 0) for tier, counts in after.items()}
    return Answer(length, path, piece, logits.detach().float().cpu(), list(outcome.output_token_ids),
                  outcome.cached_tokens, outcome.prompt_tokens, {t: n for t, n in tiers.items() if n}, outcome.ttft_ms)


def compare(answer: Answer, reference: Answer) -> dict:
    """The first token's logits torch.equal and the tokens identical; where not, by how much and where."""
    equal = torch.equal(answer.logits, reference.logits)
    diverges = next((i for i, (a, b) in enumerate(zip(answer.token_ids, reference.token_ids)) if a != b),
                    None if len(answer.token_ids) == len(reference.token_ids) else
                    min(len(answer.token_ids), len(reference.token_ids)))
    return {"against": f"{reference.path}@{reference.piece}", "logits_equal": equal,
            "max_abs_diff": 0.0 if equal else float((answer.logits - reference.logits).abs().max()),
            "argmax_equal": int(answer.logits.argmax()) == int(reference.logits.argmax()),
            "tokens_identical": diverges is None, "first_divergence": diverges,
            "tokens_at_divergence": None if diverges is None else
            (answer.token_ids[diverges:diverges + 1], reference.token_ids[diverges:diverges + 1]),
            "bitwise": equal and diverges is None}


def describe(check: dict, tokens: int) -> str:
    if check["bitwise"]:
        return f"vs {check['against']}: bitwise, {tokens}/{tokens} tokens"
    where = ("tokens identical" if check["tokens_identical"] else
             f"tokens diverge at {check['first_divergence']} (ours {check['tokens_at_divergence'][0]} vs "
             f"{check['tokens_at_divergence'][1]})")
    logits = "logits equal" if check["logits_equal"] else (
        f"logits max |diff| {check['max_abs_diff']:.3g} (argmax {'same' if check['argmax_equal'] else 'differs'})")
    return f"vs {check['against']}: MISMATCH {logits}, {where}"


def answer_piece(document: str, prompt: str, length: int, piece: int, args, model, engines: dict) -> list[Answer]:
    """Every path's answer to the prompt with prefills in pieces of `piece` tokens (the uncached one first)."""
    salt = f"exactness-piece-{piece}"  # this piece size's K/V are stored apart from the others'
    log(f"  {length} tokens in pieces of {piece}: uncached, warm-up, daemon, l0-fill, l0{', host' * ('host' in engines)}")
    answers = []

    def run(engine_name: str, path: str, mode: str | None = None) -> None:
        with perturbed(model, args.perturb == path):
            answers.append(ask(engines[engine_name], prompt, length, path, piece, args.tokens, salt, mode))

    run("daemon", "uncached", mode="baseline")
    with perturbed(model, args.perturb == "daemon"):  # the daemon path's cached K/V are the warm-up's
        engines["daemon"].warm(document, cache_salt=salt)
    engines["daemon"].flush_writes()
    run("daemon", "daemon")
    run("l0", "l0-fill")
    run("l0", "l0")
    if "host" in engines:
        try:
            run("host", "host-fill")
            run("host", "host")
        except Exception as error:  # the newest tier: its failure ends its path, not the other paths' measurement
            log(f"host tier: skipped from here on, it failed: {type(error).__name__}: {error}")
            engines.pop("host")  # closed with the others at the end
    return answers


def answer_length(length: int, args, model, engines: dict, sizes: dict, references: dict) -> list[dict]:
    """Every path at every piece size for one prompt length; returns its rows (each with its comparisons)."""
    vocab = model.config.vocab_size
    document = words(length - QUESTION_WORDS, seed=length, vocab_size=vocab)
    prompt = document + " " + words(QUESTION_WORDS, seed=1, vocab_size=vocab)
    rows = []
    for piece in args.pieces:
        for size in sizes.values():
            size[0] = piece
        answers = answer_piece(document, prompt, length, piece, args, model, engines)
        references[(length, piece)] = answers[0]
        for answer in answers:
            checks = []
            if answer.path != "uncached":
                checks.append(compare(answer, answers[0]))
            if piece != args.pieces[0]:
                checks.append(compare(answer, references[(length, args.pieces[0])]))
            rows.append({"length": length, "path": answer.path, "piece": piece, "cached": answer.cached_tokens,
                         "prompt": answer.prompt_tokens, "tiers": answer.tiers, "ttft_ms": answer.ttft_ms,
                         "checks": checks})
            tiers = ",".join(f"{tier} {n}" for tier, n in sorted(answer.tiers.items())) or "-"
            wanted = EXPECTED_TIER.get(answer.path)
            if wanted and not any(tier.startswith(wanted) for tier in answer.tiers):
                tiers += f"; NOTE: none from {wanted}"  # e.g. a prompt under one chunk: L0 keeps whole chunks only
            log(f"  {length:6d} {answer.path:9s} piece {piece:5d}  cached {answer.cached_tokens:6d}/"
                f"{answer.prompt_tokens} ({tiers})  TTFT {answer.ttft_ms:8.1f} ms  " + ("reference" if not checks else
                                                          "; ".join(describe(c, args.tokens) for c in checks)))
    return rows


def against_generate(model, tokenizer, reference: Answer, tokens: int) -> dict:
    """The engine's uncached answer against plain model.generate (SDPA, the whole prompt in one forward)."""
    prompt_ids = tokenizer(words(reference.length - QUESTION_WORDS, seed=reference.length,
                                 vocab_size=model.config.vocab_size) + " " +
                           words(QUESTION_WORDS, seed=1, vocab_size=model.config.vocab_size))["input_ids"]
    ids = torch.tensor([prompt_ids], device=model.device)
    ours = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            output = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                                    min_new_tokens=tokens, output_logits=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation(ours)
    theirs = Answer(reference.length, "model.generate", 0, output.logits[0][0].float().cpu(),
                    output.sequences[0, ids.shape[1]:].tolist(), 0, ids.shape[1], {}, 0.0)
    return compare(reference, theirs)


def build_engines(model, tokenizer, store, stack: ExitStack, args, longest: int, kv_per_token: int) -> dict:
    slots_bytes = 2 * (longest + 320) * kv_per_token + (1 << 28)
    # L0 and the host tier hold every prompt at every piece size: none is evicted or refused before it is asked again
    tier_bytes = int((sum(args.lengths) + 2 * CHUNK * len(args.lengths)) * len(args.pieces) * kv_per_token * 1.1)
    common = dict(chunk_size=CHUNK, max_prompt_tokens=longest, max_new_tokens_limit=max(64, args.tokens),
                  max_running_requests=2, kv_cache_bytes=slots_bytes, recompute_when_faster=False,
                  invariant_prefill=args.invariant_prefill)
    if args.invariant_piece_chunks != 1:  # named only when asked: a tree from before the option has no such field
        common["invariant_piece_chunks"] = args.invariant_piece_chunks
    no_host = {"host_tier_bytes": 0} if HAS_HOST_TIER else {}
    configs = {"daemon": EngineConfig(l0_bytes=0, **no_host, **common),
               "l0": EngineConfig(l0_bytes=tier_bytes, **no_host, **common)}
    if HAS_HOST_TIER:
        configs["host"] = EngineConfig(l0_bytes=0, host_tier_bytes=tier_bytes, **common)
    else:
        log("host tier: skipped (this engine's EngineConfig has no host_tier_bytes)")
    return tier_engines(model, tokenizer, configs, store, stack, f"random-{args.shape}",
                        f"kvboost-bench-random-{args.shape}-{args.dtype}-seed0")


def summarize(rows: list[dict], generated: list[dict]) -> dict:
    checks = [check for row in rows for check in row["checks"]]
    bitwise = sum(check["bitwise"] for check in checks)
    logits = sum(check["logits_equal"] for check in checks)
    tokens = sum(check["tokens_identical"] for check in checks)
    log(f"summary: {bitwise}/{len(checks)} bitwise (first-token logits torch.equal and every greedy token identical); "
        f"logits {logits}/{len(checks)}, tokens {tokens}/{len(checks)}"
        + ("" if bitwise == len(checks) else f"; MISMATCH in {len(checks) - bitwise}"))
    same = sum(check["tokens_identical"] for check in generated)
    if generated:
        log(f"summary: uncached vs model.generate: {same}/{len(generated)} token-identical, "
            f"{sum(check['logits_equal'] for check in generated)}/{len(generated)} first logits bitwise")
    return {"bitwise": bitwise, "checks": len(checks), "logits_equal": logits, "tokens_identical": tokens,
            "generate_identical": same, "generate_checks": len(generated)}


def ask_plain(engine: Engine, prompt: str, tokens: int, mode: str | None = None) -> Plain:
    outcome, logits = engine.generate_with_first_logits(GenerationParams(
        prompt=prompt, max_new_tokens=tokens, ignore_eos=True, mode=mode))
    return list(outcome.output_token_ids), logits.detach().float().cpu()


def ask_together(engine: Engine, prompts: list[str], tokens: int, mode: str | None = None) -> list[Plain]:
    """The prompts submitted at once from as many threads; their answers in prompt order."""
    return harness.at_once(lambda index: ask_plain(engine, prompts[index], tokens, mode), len(prompts))[0]


def same(answer: Plain, reference: Plain) -> bool:
    return answer[0] == reference[0] and torch.equal(answer[1], reference[1])


def sweep_engines(model, tokenizer, store, stack: ExitStack, args, longest: int) -> dict[str, Engine]:
    common = dict(chunk_size=CHUNK, max_prompt_tokens=longest, max_new_tokens_limit=max(64, args.tokens),
                  max_running_requests=SWEEP_BATCH, recompute_when_faster=False)
    if not args.variant:
        common |= dict(invariant_prefill=True, invariant_decode=True, invariant_piece_chunks=args.invariant_piece_chunks)
    tier_bytes = 4 << 30
    configs = {"daemon": dict(l0_bytes=0), "l0": dict(l0_bytes=tier_bytes), "host": dict(l0_bytes=0,
                                                                                      host_tier_bytes=tier_bytes)}
    return tier_engines(model, tokenizer, {name: EngineConfig(**common, **config) for name, config in configs.items()},
                        store, stack, f"random-{args.shape}", f"kvboost-sweep-{args.shape}-{args.dtype}")


def sweep(engines: dict[str, Engine], prompts: list[tuple[str, str]], args) -> Counter:
    """Every path of every prompt against its uncached answer alone; returns (path, bitwise) counts."""
    counts: Counter = Counter()
    references = []
    for index, (document, prompt) in enumerate(prompts):
        reference = ask_plain(engines["daemon"], prompt, args.tokens, mode="baseline")
        references.append(reference)
        engines["daemon"].warm(document)
        engines["daemon"].flush_writes()
        found = {"daemon": ask_plain(engines["daemon"], prompt, args.tokens)}
        for tier in ("l0", "host"):
            if tier in engines:
                ask_plain(engines[tier], prompt, args.tokens)
                engines[tier].flush_writes()
                found[tier] = ask_plain(engines[tier], prompt, args.tokens)
        for path, answer in found.items():
            counts[path, same(answer, reference)] += 1
        if (index + 1) % 20 == 0:
            log(f"  {index + 1}/{len(prompts)} prompts alone")
    for start in range(0, len(prompts), SWEEP_BATCH):
        batch = [prompt for _, prompt in prompts[start:start + SWEEP_BATCH]]
        for path, engine, mode in (("uncached, batched", engines["daemon"], "baseline"),
                                   ("l0, batched", engines["l0"], None)):
            for answer, reference in zip(ask_together(engine, batch, args.tokens, mode), references[start:]):
                counts[path, same(answer, reference)] += 1
    return counts


def run_sweep(args) -> int:
    """The --sweep run: every prompt on every path, alone and batched, against its uncached answer alone."""
    started = time.perf_counter()
    draw = random.Random(args.seed)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-sweep-")))
        longest = args.words[1] + 4 * CHUNK * args.invariant_piece_chunks
        log(f"building a random-weight {args.shape}-shaped model on {args.device} in {args.dtype}")
        model = random_model(args.shape, args.device, getattr(torch, args.dtype), longest + 512)
        tokenizer = word_tokenizer(model.config.vocab_size)
        vocab = model.config.vocab_size
        prompts = []
        for index in range(args.sweep):
            document = words(draw.randint(*args.words) - QUESTION_WORDS, seed=1000 + index, vocab_size=vocab)
            prompts.append((document, document + " " + words(QUESTION_WORDS, seed=5000 + index, vocab_size=vocab)))
        store = colocated_daemon(stack, workdir, 64)
        engines = sweep_engines(model, tokenizer, store, stack, args, longest)
        log(f"engines ready ({', '.join(engines)}; decode step {engines['daemon'].stats()['decode_step']}); "
            f"{args.sweep} prompts of {args.words[0]}-{args.words[1]} tokens, batches of {SWEEP_BATCH}")
        counts = sweep(engines, prompts, args)
    paths = sorted({path for path, _ in counts})
    total = sum(counts.values())
    bitwise = sum(n for (_, ok), n in counts.items() if ok)
    for path in paths:
        log(f"  {path:18s} {counts[path, True]}/{counts[path, True] + counts[path, False]} bitwise")
    log(f"summary ({'variant' if args.variant else 'invariant'} path, {args.shape} {args.dtype} on {args.device}): "
        f"{bitwise}/{total} bitwise (first-token logits torch.equal and every greedy token identical)"
        + ("" if bitwise == total else f"; MISMATCH in {total - bitwise}")
        + f"; {time.perf_counter() - started:.0f} s")
    harness.write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "bitwise": bitwise, "total": total,
                                   "paths": {path: [counts[path, True], counts[path, False]] for path in paths}})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (random weights)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 2048 + 37, 8192 + 5, 32768 - 3],
                        help="prompt tokens (a document, then a question of %d)" % QUESTION_WORDS)
    parser.add_argument("--pieces", type=int, nargs="+", default=[512, 2048], help="prefill piece sizes, tokens")
    parser.add_argument("--tokens", type=int, help="greedy tokens per answer (default: 32; with --sweep 16)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a dry run")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--generate-lengths", type=int, default=2, help="the shortest N lengths also compared with "
                        "plain model.generate (0: none)")
    parser.add_argument("--perturb", choices=PATHS, help="double layer 0's values in this path's prefills (a "
                        "check that a difference is reported MISMATCH)")
    parser.add_argument("--invariant-prefill", action="store_true", help="engines with invariant prefill (every "
                        "prefill forward one whole chunk at chunk-aligned positions): the service's "
                        "--invariant-prefill")
    parser.add_argument("--invariant-piece-chunks", type=int, default=1, help="with --invariant-prefill: whole "
                        "chunks per prefill forward (the service's --invariant-piece-chunks)")
    parser.add_argument("--sweep", type=int, default=0, metavar="PROMPTS", help="the invariant path's sweep instead: "
                        "PROMPTS prompts of --words tokens on every path, alone and batched (--tokens 16 there)")
    parser.add_argument("--words", type=int, nargs=2, default=[200, 2200], metavar=("MIN", "MAX"),
                        help="with --sweep: prompt length range in tokens, a question of %d included" % QUESTION_WORDS)
    parser.add_argument("--variant", action="store_true", help="with --sweep: the default (variant) path instead of "
                        "the invariant one: what the invariant path is measured against")
    parser.add_argument("--seed", type=int, default=0, help="with --sweep: the prompts' lengths")
    parser.add_argument("--json", type=Path, help="write every row here (rewritten after each length)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu --shape tiny for a dry run")
    if args.tokens is None:
        args.tokens = 16 if args.sweep else 32
    if args.sweep:
        if args.words[0] <= QUESTION_WORDS + 1 or args.words[1] < args.words[0]:
            parser.error(f"--words needs {QUESTION_WORDS + 1} < MIN <= MAX")
        return run_sweep(args)
    if args.invariant_piece_chunks != 1 and not args.invariant_prefill:
        parser.error("--invariant-piece-chunks needs --invariant-prefill")
    if min(args.lengths) <= QUESTION_WORDS + 1:
        parser.error(f"--lengths must exceed {QUESTION_WORDS + 1} (the question's tokens)")
    started = time.perf_counter()
    results: dict = {"shape": args.shape, "dtype": args.dtype, "invariant_prefill": args.invariant_prefill,
                     "invariant_piece_chunks": args.invariant_piece_chunks, "lengths": args.lengths, "pieces": args.pieces,
                     "tokens": args.tokens, "torch": torch.__version__, "host_tier": HAS_HOST_TIER,
                     "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                     "rows": [], "generate": []}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-exactness-")))
        longest = max(args.lengths) + 2 * CHUNK
        log(f"building a random-weight {args.shape}-shaped model on {args.device} in {args.dtype}")
        model = random_model(args.shape, args.device, getattr(torch, args.dtype), longest + 512)
        tokenizer = word_tokenizer(model.config.vocab_size)
        kv_per_token = kv_bytes_per_token(model)
        store_gb = int(kv_per_token * sum(args.lengths) * len(args.pieces) * 1.3 / 1e9) + 2
        store = colocated_daemon(stack, workdir, store_gb)
        engines = build_engines(model, tokenizer, store, stack, args, longest, kv_per_token)
        sizes = {name: pieces_of(engine) for name, engine in engines.items()}
        log(f"engines ready ({', '.join(engines)}; decode step {engines['daemon'].stats().get('decode_step')}) "
            f"in {time.perf_counter() - started:.0f} s")
        references: dict = {}
        try:
            for index, length in enumerate(sorted(args.lengths)):
                log(f"{length} tokens")
                results["rows"] += answer_length(length, args, model, engines, sizes, references)
                if index < args.generate_lengths:
                    check = against_generate(model, tokenizer, references[(length, args.pieces[0])], args.tokens)
                    results["generate"].append({"length": length, **check})
                    log(f"  {length:6d} uncached@{args.pieces[0]} against model.generate: "
                        + describe({**check, "against": "model.generate"}, args.tokens))
                harness.write_json(args.json, results)  # so far: a run cut short keeps what it measured
        finally:
            results["summary"] = summarize(results["rows"], results["generate"])
            results["seconds"] = time.perf_counter() - started
            log(f"{results['seconds']:.0f} s in all")
            harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still prints what ran, summed up
    sys.exit(main())
