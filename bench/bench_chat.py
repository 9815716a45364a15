"""A multi-turn chat through a running service: per turn, the prompt tokens it recomputes and its TTFT against
BASELINE (the same messages, no cache), measured in the same run.

Each turn sends the whole conversation (a ~500-token system prompt, the earlier questions and answers, the new
question) as chat messages. With answers stored (the default), a turn finds the previous turn's prompt and answer
in the cache and recomputes only its new message; --max-answer-tokens-stored 0 shows the turn without them.
Greedy answers are checked against BASELINE's. Loopback only: its own daemon and service, stopped at the end.

    flock /tmp/kvboost-bench.lock python bench/bench_chat.py                  # SmolLM2, 6 turns, ~100-token answers
    python bench/bench_chat.py --model tiny --turns 3 --answer-tokens 16      # the tiny random Llama (tests)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

SYSTEM = " ".join(
    f"Rule {i + 1}: the {['library', 'pool', 'museum', 'market', 'station'][i % 5]} opens at {7 + i % 5}:"
    f"{(i * 13) % 60:02d} on {['Mondays', 'Tuesdays', 'Fridays', 'weekends'][i % 4]} and costs {1 + i % 7} euros."
    for i in range(36)) + " You are the town's information desk. Answer briefly and only from the rules."
QUESTIONS = ["When does the library open on Mondays?", "And the pool?", "How much is the museum?",
             "Is the market open on weekends?", "Which place opens earliest?", "Thank you. Anything else I should know?",
             "Which one costs the most?", "Where can I go on Fridays?"]


def ask(stub, messages, mode, max_new_tokens: int):
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role=role, content=content) for role, content in messages],
                                 max_new_tokens=max_new_tokens, mode=mode)
    return list(stub.Generate(request, timeout=300))[-1].result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="'tiny': the random 2-layer test Llama")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=100, help="max_new_tokens per answer")
    parser.add_argument("--max-answer-tokens-stored", type=int, default=1024, help="the service's flag")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of the service")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from tests.conftest import pick_free_port
    from tests.e2e.daemon_process import start_daemon
    from tests.e2e.service_process import start_service

    identical, rows = True, []
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-chat-")))
        model = args.model
        if model == "tiny":
            from tests.e2e.stack_process import save_tiny_model
            model = str(save_tiny_model(work_dir / "tiny-model"))
        daemon = start_daemon(work_dir / "lmdb", pick_free_port())
        stack.callback(daemon.terminate)
        service = start_service(model, daemon.address, pick_free_port(), work_dir / "service.log",
                                "--max-answer-tokens-stored", str(args.max_answer_tokens_stored), timeout_s=300)
        stack.callback(service.terminate)
        stub = inference_pb2_grpc.InferenceServiceStub(stack.enter_context(grpc.insecure_channel(service.address)))
        ask(stub, [("user", "warm-up")], pb.BASELINE, 2)
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {args.model}, {args.threads} threads, "
              f"{args.turns} turns, answers up to {args.answer_tokens} tokens, --max-answer-tokens-stored "
              f"{args.max_answer_tokens_stored}", flush=True)
        messages = [("system", SYSTEM)]
        for turn in range(args.turns):
            messages.append(("user", QUESTIONS[turn % len(QUESTIONS)]))
            baseline = ask(stub, messages, pb.BASELINE, args.answer_tokens)
            cached = ask(stub, messages, pb.PREFIX_CACHE, args.answer_tokens)
            identical &= list(cached.output_token_ids) == list(baseline.output_token_ids)
            recomputed = cached.prompt_tokens - cached.cached_tokens
            new_tokens = cached.prompt_tokens - (rows[-1]["prompt"] + rows[-1]["answer"] if rows else 0)
            rows.append({"prompt": cached.prompt_tokens, "answer": cached.generated_tokens})
            print(f"turn {turn + 1}: prompt {cached.prompt_tokens:5d} tokens, cached {cached.cached_tokens:5d}, "
                  f"recomputed {recomputed:4d} (new since the last turn's answer: {new_tokens:4d}), TTFT "
                  f"{cached.ttft_ms:7.1f} ms vs BASELINE {baseline.ttft_ms:7.1f} ms "
                  f"({baseline.ttft_ms / max(cached.ttft_ms, 1e-6):5.1f}x), answer {cached.generated_tokens} tokens",
                  flush=True)
            messages.append(("assistant", cached.output_text))
    print(f"greedy answers identical to BASELINE on every turn: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
