"""Where content reuse loses accuracy: K/V of documents warmed alone against the same tokens' K/V in the
full prompt, layer by layer, and what CacheBlend recovers with its own token choice and with an oracle's.

For each RAG question of bench/rag_dataset.py (the prompts bench_accuracy.py asks), the full prompt is
prefilled once (the reference). Every document is also prefilled alone, as content-addressed Warm stores
it, and its keys re-rotated to the document's place in the prompt. Two tables:

1. Per layer, the median over document tokens of |ΔK|/|K| and |ΔV|/|V| (warmed alone vs in the prompt),
   for the first 8 tokens after each seam and for the rest. Sparse error (large at a few tokens, small
   elsewhere) is what a small recompute ratio can fix; dense error is not.
2. First-token KL and answer accuracy of cacheblend at several ratios when the recomputed tokens are
   chosen by CacheBlend's measured deviation (the product) or by an oracle that knows every token's
   true K/V error summed over all layers (not computable at serving time: an upper bound for any
   deviation-ranked choice at that ratio).

    python bench/bench_deviation.py                 # 40 questions
    python bench/bench_deviation.py --questions 10
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from inference_service import mkl_dispatch  # noqa: E402

MKL_DISPATCH = mkl_dispatch.apply()  # before torch: the service's default (KVBOOST_MKL_DISPATCH=vendor to compare)

import torch  # noqa: E402

from inference_service.model.weights import DEFAULT_MODEL  # noqa: E402
from kvboost_keys.prompts import tokenize_segments  # noqa: E402
from inference_service.kv.repair import APPROX, MISSING, RepairOptions, repair_prefill  # noqa: E402
from inference_service.kv.rope import rerotate_keys, rope_parameters# noqa: E402
from inference_service.model.kv_buffers import build_cache# noqa: E402
from inference_service.model.forward import decode_alone# noqa: E402
from inference_service.model.loading import load_model# noqa: E402
from inference_service.request.verification import first_token_kl# noqa: E402
from rag_dataset import build_documents, build_questions, chat_segments  # noqa: E402

SEAM_TOKENS = 8  # "near a seam": the first tokens of each document


@torch.inference_mode()
def prefill(model, token_ids: list[int]):
    """-> per-layer keys and values [1, kv_heads, n, head_dim], last-token logits [vocab]."""
    output = model(torch.tensor([token_ids]), use_cache=True)
    layers = output.past_key_values.layers
    return [layer.keys for layer in layers], [layer.values for layer in layers], output.logits[0, -1].float()


@torch.inference_mode()
def greedy_answer(model, cache, first_logits: torch.Tensor, num_tokens: int, max_new_tokens: int) -> list[int]:
    tokens = [int(first_logits.argmax())]
    for step in range(max_new_tokens - 1):
        tokens.append(int(decode_alone(model, cache, torch.tensor(tokens[-1]), num_tokens + step).argmax()))
    return tokens


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    # [1, kv_heads, n, head_dim] -> [n]
    return (approx - exact).pow(2).sum(dim=(0, 1, 3)).sqrt() / exact.pow(2).sum(dim=(0, 1, 3)).sqrt()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--ratios", default="0.15,0.3,0.5", help="cacheblend recompute ratios, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]

    loaded = load_model(args.model, device="cpu", dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    rope = rope_parameters(model.config)
    num_layers = model.config.num_hidden_layers
    documents = build_documents()
    questions = build_questions(documents, args.questions)
    alone: dict[tuple[int, ...], tuple[list, list]] = {}
    # errors[layer][kind]["near"|"far"]: per-token relative errors of document tokens
    errors = [{kind: {"near": [], "far": []} for kind in ("K", "V")} for _ in range(num_layers)]
    columns = ["reuse none"] + [f"{who} {round(r * 100)}%" for r in ratios for who in ("cacheblend", "oracle")]
    scores = {name: {"kl": [], "correct": []} for name in ["full prefill", *columns]}
    started = time.perf_counter()
    for question in questions:
        segments = tokenize_segments(tokenizer, chat_segments(tokenizer, documents, question))
        token_ids = [token for segment in segments for token in segment]
        num_tokens = len(token_ids)
        full_keys, full_values, full_logits = prefill(model, token_ids)
        status = torch.full((num_tokens,), MISSING, dtype=torch.int8)
        near = torch.zeros(num_tokens, dtype=torch.bool)
        keys = [torch.zeros_like(k) for k in full_keys]
        values = [torch.zeros_like(v) for v in full_values]
        start = len(segments[0])
        for segment in segments[1:-1]:  # the documents; the chat header and the question are computed
            end = start + len(segment)
            if tuple(segment) not in alone:
                doc_keys, doc_values, _ = prefill(model, segment)
                alone[tuple(segment)] = (doc_keys, doc_values)
            doc_keys, doc_values = alone[tuple(segment)]
            moved_from, moved_to = torch.arange(len(segment)), torch.arange(start, end)
            for layer in range(num_layers):
                keys[layer][:, :, start:end] = rerotate_keys(doc_keys[layer], moved_from, moved_to, rope)
                values[layer][:, :, start:end] = doc_values[layer]
            status[start:end] = APPROX
            near[start : start + SEAM_TOKENS] = True
            start = end
        approx = status == APPROX
        oracle = torch.zeros(num_tokens)
        for layer in range(num_layers):
            key_error = relative_error(keys[layer], full_keys[layer])
            value_error = relative_error(values[layer], full_values[layer])
            for kind, error in (("K", key_error), ("V", value_error)):
                errors[layer][kind]["near"] += error[approx & near].tolist()
                errors[layer][kind]["far"] += error[approx & ~near].tolist()
            oracle += (keys[layer] - full_keys[layer]).pow(2).sum(dim=(0, 1, 3))
            oracle += (values[layer] - full_values[layer]).pow(2).sum(dim=(0, 1, 3))

        reference = greedy_answer(model, _copy_cache(model, full_keys, full_values), full_logits, num_tokens,
                                  args.max_new_tokens)
        _score(scores["full prefill"], tokenizer, question.answer, reference, 0.0)
        input_ids = torch.tensor([token_ids])
        runs = [("reuse none", RepairOptions(strategy="none"), None)]
        for ratio in ratios:
            options = RepairOptions(strategy="cacheblend", recompute_ratio=ratio)
            runs += [(f"cacheblend {round(ratio * 100)}%", options, None), (f"oracle {round(ratio * 100)}%", options, oracle)]
        for name, options, token_scores in runs:
            run_keys, run_values = [k.clone() for k in keys], [v.clone() for v in values]
            result = repair_prefill(model, input_ids, run_keys, run_values, status, options, token_scores=token_scores)
            answer = greedy_answer(model, result.cache, result.last_logits, num_tokens, args.max_new_tokens)
            _score(scores[name], tokenizer, question.answer, answer, first_token_kl(full_logits, result.last_logits))

    print(f"\n{loaded.model_id}, CPU fp32, {args.questions} questions over 4-6 of {len(documents)} documents "
          f"warmed alone, {time.perf_counter() - started:.0f} s\n")
    print("median relative K/V error of document tokens, warmed alone (re-rotated) vs in the full prompt")
    print(f"{'layer':>5} {f'K first {SEAM_TOKENS}':>9} {'K rest':>7} {f'V first {SEAM_TOKENS}':>9} {'V rest':>7}")
    for layer, by_kind in enumerate(errors):
        cells = [statistics.median(by_kind[kind][where]) for kind in ("K", "V") for where in ("near", "far")]
        print(f"{layer:>5} " + " ".join(f"{cell:>{9 if i % 2 == 0 else 7}.3f}" for i, cell in enumerate(cells)))
    print(f"\n{'repair':<16} {'accuracy':>8} {'1st-tok KL':>10}")
    for name, score in scores.items():
        print(f"{name:<16} {statistics.mean(score['correct']):>8.3f} {statistics.mean(score['kl']):>10.4f}")


def _copy_cache(model, keys, values, room: int = 256):
    """A cache over copies of the K/V with room for `room` more tokens (the engine's buffers never grow)."""
    held = torch.cat(keys)  # [layers, kv_heads, S, head_dim]
    shape = (held.shape[0], held.shape[1], held.shape[2] + room, held.shape[3])
    key_buffer, value_buffer = held.new_empty(shape), held.new_empty(shape)
    key_buffer[:, :, : held.shape[2]].copy_(held)
    value_buffer[:, :, : held.shape[2]].copy_(torch.cat(values))
    return build_cache(model.config, key_buffer, value_buffer, held.shape[2])


def _score(score: dict, tokenizer, answer: str, tokens: list[int], kl: float) -> None:
    score["correct"].append(answer.lower() in tokenizer.decode(tokens).lower())
    score["kl"].append(kl)


if __name__ == "__main__":
    main()
