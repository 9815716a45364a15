"""The invariant path's sweep: many prompts, every tier, alone and in batches of unrelated requests, bitwise.

A random-weight model (bench/gpu_model.py) answers --prompts prompts (a document then a question, lengths drawn from
--words) with the engine's invariant path (--invariant-prefill, and the invariant decode step: on by default here,
also on a CPU, where the service leaves it off unless asked). Per prompt:
  uncached       the cache off (mode baseline), the prompt alone: the reference
  daemon         its document warmed into the daemon's LMDB map (L0 off), then the prompt asked
  l0             an engine with L0 asks twice: the second answer's K/V come from L0
  host           (where the engine has a host tier) the same with L0 off: the second from the host tier
Then the prompts in batches of --batch, submitted at once (each batch decodes together, its rows joining the step
loop as they come): uncached (mode baseline) and from L0. Every answer is compared with the prompt's reference: the
first token's logits torch.equal and every greedy token identical. A mismatch is a measurement: the exit code stays
0 and the summary says MISMATCH. `--variant` runs the default path instead (the comparison the invariant path fixes).

    python bench/bench_invariant_sweep.py --device cpu --dtype bfloat16 --shape tiny --prompts 200
    python bench/bench_invariant_sweep.py --prompts 64 --json out.json                 # 8B shape on CUDA
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.gpu_model import (CHUNK, QUESTION_WORDS, SHAPES, colocated_daemon, log, random_model,  # noqa: E402
                             tier_engines, word_tokenizer, words)
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402

Answer = tuple[list[int], torch.Tensor]  # greedy tokens, the first token's logits [vocab] float32 on the CPU


def ask(engine: Engine, prompt: str, tokens: int, mode: str | None = None) -> Answer:
    outcome, logits = engine.generate_with_first_logits(GenerationParams(
        prompt=prompt, max_new_tokens=tokens, ignore_eos=True, mode=mode))
    return list(outcome.output_token_ids), logits.detach().float().cpu()


def ask_together(engine: Engine, prompts: list[str], tokens: int, mode: str | None = None) -> list[Answer]:
    """The prompts submitted at once from as many threads; their answers in prompt order."""
    answers: list[Answer | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            answers[index] = ask(engine, prompts[index], tokens, mode)
        except BaseException as error:  # reported after the join: a failed row must not look like a mismatch
            errors.append(error)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return answers


def same(answer: Answer, reference: Answer) -> bool:
    return answer[0] == reference[0] and torch.equal(answer[1], reference[1])


def build_engines(model, tokenizer, store, stack: ExitStack, args, longest: int) -> dict[str, Engine]:
    common = dict(chunk_size=CHUNK, max_prompt_tokens=longest, max_new_tokens_limit=max(64, args.tokens),
                  max_running_requests=args.batch, recompute_when_faster=False)
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
        reference = ask(engines["daemon"], prompt, args.tokens, mode="baseline")
        references.append(reference)
        engines["daemon"].warm(document)
        engines["daemon"].flush_writes()
        found = {"daemon": ask(engines["daemon"], prompt, args.tokens)}
        for tier in ("l0", "host"):
            if tier in engines:
                ask(engines[tier], prompt, args.tokens)
                engines[tier].flush_writes()
                found[tier] = ask(engines[tier], prompt, args.tokens)
        for path, answer in found.items():
            counts[path, same(answer, reference)] += 1
        if (index + 1) % 20 == 0:
            log(f"  {index + 1}/{len(prompts)} prompts alone")
    for start in range(0, len(prompts), args.batch):
        batch = [prompt for _, prompt in prompts[start:start + args.batch]]
        for path, engine, mode in (("uncached, batched", engines["daemon"], "baseline"),
                                   ("l0, batched", engines["l0"], None)):
            for answer, reference in zip(ask_together(engine, batch, args.tokens, mode), references[start:]):
                counts[path, same(answer, reference)] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (random weights)")
    parser.add_argument("--prompts", type=int, default=64, help="prompts in the sweep")
    parser.add_argument("--words", type=int, nargs=2, default=[200, 2200], metavar=("MIN", "MAX"),
                        help="prompt length range in tokens (one per word), a question of %d included" % QUESTION_WORDS)
    parser.add_argument("--batch", type=int, default=8, help="prompts submitted at once in the batched paths")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per answer")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--invariant-piece-chunks", type=int, default=1, help="whole chunks per invariant prefill "
                        "forward (the service's --invariant-piece-chunks)")
    parser.add_argument("--variant", action="store_true", help="the default (variant) path instead: what the "
                        "invariant path is measured against")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu --shape tiny on a CPU")
    if args.words[0] <= QUESTION_WORDS + 1 or args.words[1] < args.words[0]:
        parser.error(f"--words needs {QUESTION_WORDS + 1} < MIN <= MAX")
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
        for index in range(args.prompts):
            document = words(draw.randint(*args.words) - QUESTION_WORDS, seed=1000 + index, vocab_size=vocab)
            prompts.append((document, document + " " + words(QUESTION_WORDS, seed=5000 + index, vocab_size=vocab)))
        store = colocated_daemon(stack, workdir, 64)
        engines = build_engines(model, tokenizer, store, stack, args, longest)
        log(f"engines ready ({', '.join(engines)}; decode step {engines['daemon'].stats()['decode_step']}); "
            f"{args.prompts} prompts of {args.words[0]}-{args.words[1]} tokens, batches of {args.batch}")
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
    harness.write_json(args.json, {"args": vars(args), "bitwise": bitwise, "total": total,
                                   "paths": {path: [counts[path, True], counts[path, False]] for path in paths}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
