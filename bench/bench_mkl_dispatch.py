"""What --mkl-dispatch features changes against MKL's own choice: plain `model.generate`, greedy, over chat prompts, in a
process on MKL's vendor dispatch and one under `features`: prompts with the same tokens and each process's speed. On an
Intel CPU both run the same kernels.

    flock /tmp/kvboost-bench.lock python bench/bench_mkl_dispatch.py --prompts 200
    python bench/bench_mkl_dispatch.py --model qwen2.5-coder-0.5b --prompts 50
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISPATCHES = ("vendor", "features")


def worker(model_name: str, prompts: int, tokens: int, threads: int) -> dict:
    """Runs in a subprocess whose KVBOOST_MKL_DISPATCH is set: the dispatch is applied before torch loads."""
    sys.path[:0] = [str(ROOT), str(ROOT / "proto")]
    from inference_service import mkl_dispatch

    dispatch = mkl_dispatch.apply()
    import torch

    from bench import harness
    from bench.bench_fast_step import reference_ids, sweep_cases
    from kvboost_keys.prompts import tokenize_messages

    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = harness.cpu_model(model_name)
    outputs, seconds = [], 0.0
    for index, case in enumerate(sweep_cases(prompts)):
        token_ids = tokenize_messages(tokenizer, case)[0]
        started = time.perf_counter()
        outputs.append(reference_ids(model, token_ids, tokens))
        seconds += time.perf_counter() - started
        if (index + 1) % 25 == 0:
            print(f"  {dispatch.applied}: {index + 1}/{prompts} prompts", file=sys.stderr, flush=True)
    return {"dispatch": dispatch.applied, "reason": dispatch.reason, "threads": torch.get_num_threads(),
            "outputs": outputs, "seconds": seconds}


def run_worker(dispatch: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "KVBOOST_MKL_DISPATCH": dispatch}
    result = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model, "--prompts",
                             str(args.prompts), "--tokens", str(args.tokens), "--threads", str(args.threads)],
                            env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, tiny-llama, tiny-qwen2, or a catalogue name prepared with `make model MODEL=...`")
    parser.add_argument("--prompts", type=int, default=200, help="chat prompts (bench_fast_step's sweep prompts)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the outputs and figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.prompts, args.tokens, args.threads)))
        return 0

    sys.path[:0] = [str(ROOT), str(ROOT / "proto")]
    from bench.bench_fast_step import agreement

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    runs = {dispatch: run_worker(dispatch, args) for dispatch in DISPATCHES}
    vendor, features = runs["vendor"]["outputs"], runs["features"]["outputs"]
    same, token_share, divergence = agreement(vendor, features)
    print(f"{stamp} UTC, {args.model}, {args.prompts} chat prompts x up to {args.tokens} greedy tokens, plain "
          f"model.generate, one process per MKL dispatch, {runs['vendor']['threads']} threads")
    for dispatch, run in runs.items():
        produced = sum(map(len, run["outputs"]))
        print(f"  {dispatch:8s} (applied: {run['dispatch']}; {run['reason']}): {run['seconds']:.0f} s, "
              f"{produced / run['seconds']:.1f} tokens/s with prefill")
    first = f"; the others first differ at token {divergence:.1f} on average" if same < len(vendor) else ""
    print(f"  agreement: {same}/{args.prompts} prompts token-identical, {token_share * 100:.2f}% of "
          f"tokens in place{first}")
    if args.json:
        args.json.write_text(json.dumps({"utc": stamp, "model": args.model, "runs": runs, "same": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
