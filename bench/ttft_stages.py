"""Where one request's time goes, from its arrival to its first token: the host stages replayed alone
(bench_overhead.replay_stages: tokenize, keys, Lookup, placement), then the question's own prefill (a plain forward of
its tokens over the N cached positions) and the first sample, each timed by host clocks and, on CUDA, by events.
"rest" is the request's TTFT minus all of them: hand-offs, waits, what no stage names."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench import harness
from bench.bench_overhead import replay_stages
from inference_service.engine.engine import Engine, GenerationParams
from inference_service.model.forward import prefill
from inference_service.kv_memory.kv_buffers import allocate_kv, build_cache, kv_geometry

HOST_STAGES = ("tokenize", "keys", "lookup", "placement")
DEVICE_STAGES = ("question prefill", "first sample")


def timed(device: torch.device, work: Callable[[], object]) -> tuple[object, float, float | None]:
    """(work's result, host ms to the device's completion, device ms between events around it; None on a CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
    started = time.perf_counter()
    result = work()
    if cuda:
        after.record()
        torch.cuda.synchronize(device)
    host_ms = (time.perf_counter() - started) * 1000
    return result, host_ms, before.elapsed_time(after) if cuda else None


@torch.inference_mode()
def question_prefill(model, token_ids: list[int], num_cached: int) -> tuple[torch.Tensor, float, float | None]:
    """The question's tokens (token_ids[num_cached:]) forwarded over num_cached positions already in a cache (their
    values do not matter for the time): (its last logits, host ms, device ms). One untimed run first."""
    geometry = kv_geometry(model.config)
    buffers = allocate_kv(geometry, len(token_ids) + 1, model.device, model.dtype)
    buffers[0].zero_()
    buffers[1].zero_()
    live = torch.tensor(token_ids[num_cached:], device=model.device)

    def forward():
        return prefill(model, build_cache(model.config, *buffers, num_cached), live, num_cached)[0]

    forward()
    return timed(model.device, forward)


def first_sample(logits: torch.Tensor) -> tuple[int, float, float | None]:
    """Greedy pick of the first token from its logits, to the host (the engine's greedy path): (id, host ms, device
    ms)."""
    return timed(logits.device, lambda: int(torch.argmax(logits.reshape(-1, logits.shape[-1])[-1]).item()))


def split_request(engine: Engine, prompt: str, mode: str | None = None) -> dict:
    """One request through the engine, then each of its stages alone: ms per stage (host clock), device ms per
    device stage ("<stage> gpu"), ttft_ms, cached_tokens and rest."""
    params = GenerationParams(prompt=prompt, max_new_tokens=1, mode=mode)
    outcome = engine.generate(params)
    engine.flush_writes()
    token_ids = list(engine.plan_request(params)[1].token_ids)
    row = {"ttft_ms": outcome.ttft_ms, "cached_tokens": outcome.cached_tokens, "prompt_tokens": len(token_ids)}
    if mode == "baseline":  # nothing looked up or placed: the prefill is the whole prompt's
        stages = replay_stages(engine, params)
        row.update({"tokenize": stages["tokenize"], "keys": stages["keys"], "lookup": 0.0, "placement": 0.0})
    else:
        row.update({name: replay_stages(engine, params)[name] for name in HOST_STAGES})
    logits, row["question prefill"], row["question prefill gpu"] = question_prefill(engine.model, token_ids,
                                                                                    outcome.cached_tokens)
    _, row["first sample"], row["first sample gpu"] = first_sample(logits)
    row["rest"] = row["ttft_ms"] - sum(row[name] for name in (*HOST_STAGES, *DEVICE_STAGES))
    return row


def median_row(rows: list[dict]) -> dict:
    """Each field's median over the runs (None where a field has none)."""
    fields = rows[0].keys()
    return {name: (harness.median(row[name] for row in rows) if rows[0][name] is not None else None)
            for name in fields}


def format_row(path: str, row: dict) -> str:
    stages = "  ".join(f"{name} {row[name]:.2f}" + (f" (gpu {row[name + ' gpu']:.2f})" if row.get(name + " gpu")
                                                     is not None else "")
                       for name in (*HOST_STAGES, *DEVICE_STAGES))
    return f"  {path:14s} TTFT {row['ttft_ms']:8.2f} ms = {stages}  rest {row['rest']:.2f}  (cached {row['cached_tokens']:.0f})"
