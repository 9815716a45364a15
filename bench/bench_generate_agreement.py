"""Real weights in half precision: how often the engine's greedy tokens equal plain `model.generate`'s (measured, not
promised: docs/engine.md). SmolLM2-135M-Instruct answers --prompts RAG prompts (bench/rag_dataset.py) by `generate`
(the reference), `uncached` (mode baseline) and `cached` (the engine's second answer); per path the share of tokens
equal to generate's at the same position and the prompts answered identically. --invariant: the invariant path.

    python bench/bench_generate_agreement.py --dtype bfloat16 --prompts 200
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.gpu_model import log  # noqa: E402
from bench.rag_dataset import build_documents, build_questions, chat_segments  # noqa: E402
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from inference_service.store.memory import InMemoryStore  # noqa: E402


def reference(model, tokenizer, prompt: str, tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens)
    return output[0, ids.shape[1]:].tolist()


def agreement(expected: list[int], got: list[int]) -> int:
    """Positions of generate's answer where ours has the same token (an answer that ends early has none after)."""
    return sum(a == b for a, b in zip(expected, got))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per answer at most (each stops at EOS, as generate does)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--invariant", action="store_true", help="the engine's invariant path (--invariant-prefill)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference_service.model.weights import prepare_default_model

    started = time.perf_counter()
    path = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    documents = build_documents()
    prompts = ["".join(chat_segments(tokenizer, documents, question))
               for question in build_questions(documents, args.prompts)]
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=128, invariant_prefill=args.invariant), InMemoryStore(),
                    model_id=f"agreement-{args.dtype}")
    equal = {"uncached": 0, "cached": 0}
    total = 0
    identical = {"uncached": 0, "cached": 0}
    num_cached = 0
    try:
        for index, prompt in enumerate(prompts):
            expected = reference(model, tokenizer, prompt, args.tokens)
            total += len(expected)
            for path_name, mode in (("uncached", "baseline"), ("fill", None), ("cached", None)):
                outcome = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=args.tokens,
                                                           mode=mode))
                engine.flush_writes()  # the fill's chunks are stored before the cached answer is asked
                if path_name == "fill":
                    continue
                got = list(outcome.output_token_ids)
                equal[path_name] += agreement(expected, got)
                identical[path_name] += got == expected
                num_cached += outcome.cached_tokens if path_name == "cached" else 0
            if (index + 1) % 25 == 0:
                log(f"  {index + 1}/{len(prompts)}: uncached {equal['uncached'] / total:.4f}, "
                    f"cached {equal['cached'] / total:.4f} of tokens equal")
    finally:
        engine.close()
    label = f"SmolLM2-135M-Instruct {args.dtype} on the CPU, {'invariant' if args.invariant else 'default'} path"
    for path_name in equal:
        log(f"{label}: {path_name:8s} {equal[path_name]}/{total} greedy tokens equal to model.generate's "
            f"({equal[path_name] / total:.4f}); {identical[path_name]}/{len(prompts)} prompts identical")
    log(f"cached tokens per cached answer: {num_cached / len(prompts):.0f}; {time.perf_counter() - started:.0f} s")
    harness.write_json(args.json, {"args": vars(args), "equal": equal, "identical": identical, "total_tokens": total,
                                   "prompts": len(prompts)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
