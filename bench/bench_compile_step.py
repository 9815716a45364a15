"""torch.compile of the lean step's layer loop under the CUDA graphs, against the graphs alone: step time and bitwise.

Both steps decode the same rows over the same random K/V (bench/gpu_model.py's model), one stream and --rows at once,
alternating: each one's median step time, the compiled one's compile time per bucket (the rest skipped past
--compile-limit-s), whether every step's logits are bitwise the graphs-only step's; then, within --budget-s, the
start-up probe on the compiled step. The service's step is unchanged: this is a measurement.

    python bench/bench_compile_step.py                                   # 8B shape, bf16, 1 and 16 rows, on a GPU
    python bench/bench_compile_step.py --shape tiny --device cpu --dtype float32 --steps 4   # a CPU dry run
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
from bench.gpu_model import SHAPES, log, random_model  # noqa: E402
from inference_service.model.lean_step import LeanStep  # noqa: E402
from inference_service.model.graph_step import GraphSteps  # noqa: E402
from inference_service.kv_memory.kv_buffers import kv_geometry  # noqa: E402
from inference_service.model.scripted_layers import decoder_layers  # noqa: E402
from inference_service.kv_memory.slot_buffers import SlotBuffers  # noqa: E402
from inference_service.model.step_runner import StepRunner, probe_mismatch  # noqa: E402


def compiled_step(model, mode: str) -> LeanStep:
    """A lean step whose layer loop is torch.compile'd (static shapes: one compilation per graph bucket)."""
    import torch._dynamo.config as dynamo

    for name, value in (("recompile_limit", 64), ("fail_on_recompile_limit_hit", True)):
        if hasattr(dynamo, name):  # a bucket past the limit must fail, not run the loop eagerly unnoticed
            setattr(dynamo, name, value)
    step = LeanStep(model)
    step.layers = torch.compile(decoder_layers, dynamic=False, mode=mode)
    step.scripted = False
    return step


@torch.inference_mode()
def runner_over(model, step, num_rows: int, capacity: int, context: int) -> StepRunner:
    """The step in graph buckets (eager ones on a CPU) over num_rows slots holding `context` columns of random K/V,
    the same for every runner built with the same arguments."""
    geometry = kv_geometry(model.config)
    buffers = SlotBuffers(geometry, num_rows, capacity, model.device, model.dtype)
    generator = torch.Generator(device="cpu").manual_seed(0)
    noise = torch.randn(buffers.keys.shape, generator=generator).to(model.device, model.dtype)
    buffers.keys.copy_(noise)
    buffers.values.copy_(noise.flip(-1))
    for slot in range(num_rows):
        buffers.written(slot, context)
    return StepRunner(buffers, step, GraphSteps(step, buffers.keys, buffers.values, capacity))


def sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def timed_step(model, runner: StepRunner, rows: dict) -> tuple[torch.Tensor, float]:
    sync(model)
    started = time.perf_counter()
    logits = runner.decode(rows)
    sync(model)
    return logits, time.perf_counter() - started


def compare_rows(model, num_rows: int, args, steps: dict, capacity: int) -> dict:
    """One bucket of num_rows rows: the graphs-only step and the compiled one, alternating, over equal K/V."""
    runners = {name: runner_over(model, step, num_rows, capacity, args.context) for name, step in steps.items()}
    tokens = torch.randint(2, model.config.vocab_size, (args.steps + 1, num_rows),
                           generator=torch.Generator().manual_seed(num_rows)).tolist()
    rows_at = lambda index: {slot: (tokens[index][slot], args.context + index) for slot in range(num_rows)}
    result: dict = {"rows": num_rows}
    first = {}
    for name, runner in runners.items():  # each bucket's first call captures it (and compiles the compiled loop)
        try:
            first[name], seconds = timed_step(model, runner, rows_at(0))
        except Exception as error:  # no C compiler for triton's launchers, an inductor error: a measurement to report
            if name != "compiled":
                raise
            result["skipped"] = f"compiling the loop failed: {type(error).__name__}: {str(error)[:300]}"
            return result
        result[f"{name}_first_call_s"] = seconds
        if name == "compiled" and seconds > args.compile_limit_s:
            result["skipped"] = (f"compiling and capturing the compiled loop for {num_rows} row(s) took {seconds:.0f} s, "
                                 f"over --compile-limit-s {args.compile_limit_s:.0f}")
            return result
    times: dict[str, list[float]] = {name: [] for name in runners}
    equal, worst = int(torch.equal(first["graphs"], first["compiled"])), float((first["graphs"] - first["compiled"]).abs().max())
    for index in range(1, args.steps + 1):
        logits = {}
        for name in harness.in_turn(runners, index - 1):
            logits[name], seconds = timed_step(model, runners[name], rows_at(index))
            times[name].append(seconds)
        equal += int(torch.equal(logits["graphs"], logits["compiled"]))
        worst = max(worst, float((logits["graphs"] - logits["compiled"]).abs().max()))
    for name, samples in times.items():
        result[f"{name}_ms"] = harness.median(samples) * 1000
    result.update(tokens_per_s=num_rows * 1000 / result["compiled_ms"], graphs_tokens_per_s=num_rows * 1000 / result["graphs_ms"],
                  speedup=result["graphs_ms"] / result["compiled_ms"], bitwise_steps=equal, steps=args.steps + 1,
                  max_abs_diff=worst, replays={name: runner.graphs.num_replays for name, runner in runners.items()})
    return result


def describe(result: dict) -> str:
    if "skipped" in result:
        return f"{result['rows']:3d} row(s): compiled skipped: {result['skipped']}"
    bitwise = ("bitwise" if result["bitwise_steps"] == result["steps"] else
               f"MISMATCH ({result['bitwise_steps']}/{result['steps']} steps bitwise, max |diff| {result['max_abs_diff']:.3g})")
    return (f"{result['rows']:3d} row(s): graphs {result['graphs_ms']:.2f} ms/step ({result['graphs_tokens_per_s']:.1f} "
            f"tokens/s), compiled+graphs {result['compiled_ms']:.2f} ms/step ({result['tokens_per_s']:.1f} tokens/s), "
            f"{result['speedup']:.2f}x; first call (compile and capture) "
            f"{result['compiled_first_call_s']:.1f} s vs {result['graphs_first_call_s']:.1f} s; logits {bitwise}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (random weights)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a dry run (graph buckets run eagerly)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows decoding at once, one bucket each")
    parser.add_argument("--context", type=int, default=512, help="K/V columns each row attends to before its step")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant and bucket")
    parser.add_argument("--compile-limit-s", type=float, default=90.0, help="skip the rest once a bucket's first "
                        "compiled call (compile and capture) takes longer than this")
    parser.add_argument("--budget-s", type=float, default=100.0, help="run the probes only while the run is under this")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu --shape tiny for a dry run")
    started = time.perf_counter()
    log(f"building a random-weight {args.shape}-shaped model on {args.device} in {args.dtype}")
    model = random_model(args.shape, args.device, getattr(torch, args.dtype), args.context + args.steps + 512)
    capacity = args.context + args.steps + 8
    steps = {"graphs": LeanStep(model), "compiled": compiled_step(model, "default")}
    results: dict = {"shape": args.shape, "dtype": args.dtype, "context": args.context, "capacity": capacity,
                     "torch": torch.__version__, "compile_mode": "default", "by_rows": [],
                     "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                     "graphs_step_scripted": steps["graphs"].scripted}
    log(f"the service's step: lean{' (scripted loop)' if steps['graphs'].scripted else ''}, in graph buckets"
        f"{' (run eagerly: no CUDA)' if model.device.type != 'cuda' else ''}; against it the compiled loop, same buckets")
    for num_rows in args.rows:
        result = compare_rows(model, num_rows, args, steps, capacity)
        results["by_rows"].append(result)
        log(describe(result))
        if "skipped" in result:
            break
    probes = {}
    for name, graphs in (("captured vs eager (compiled step)", True), ("compiled step vs the model's forward", False)):
        if "skipped" in results["by_rows"][-1] or time.perf_counter() - started > args.budget_s:
            probes[name] = f"not run: {time.perf_counter() - started:.0f} s of --budget-s {args.budget_s:.0f} spent"
        elif graphs and model.device.type != "cuda":
            probes[name] = "not run: no CUDA graphs on a CPU"
        else:
            began = time.perf_counter()
            try:
                reason = probe_mismatch(model, steps["compiled"], graphs=graphs)
            except Exception as error:  # a capture or compilation that fails is the probe's answer too
                reason = f"failed: {type(error).__name__}: {str(error)[:300]}"
            probes[name] = f"{'bitwise' if not reason else 'MISMATCH: ' + reason} ({time.perf_counter() - began:.1f} s)"
        log(f"probe, {name}: {probes[name]}")
    results["probes"] = probes
    results["seconds"] = time.perf_counter() - started
    log(f"{results['seconds']:.0f} s in all")
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
