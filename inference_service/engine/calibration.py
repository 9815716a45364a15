"""At start-up, on the served model's shapes: the load-or-recompute choice's cost lines measured, and the first-time
costs of a cached request (pinned staging buffers, kernels picked for the prefill's shapes) paid before SERVING."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inference_service.kv.blobs import encode_chunk_kv
from inference_service.kv.codec import read_header
from inference_service.kv.loader import STAGING_BUFFERS, RunLoad, staging_ring
from inference_service.model.forward import prefill
from inference_service.kv_memory.kv_buffers import allocate_kv, build_cache
from inference_service.engine_parts.generation import step_hints
from inference_service.engine_parts.planning import EngineParts
from inference_service.kv_memory.tier_placement import copy_run_
from inference_service.kv_memory.tier_rates import store_tier
from inference_service.store.protocol import StoreUnavailable

logger = logging.getLogger(__name__)

QUESTION_TOKENS = 24  # a question's prefill over cached positions: its kernels picked at start-up too


@dataclass(slots=True)
class Calibration:
    """What start-up measured: (units, seconds) points per cost line ("prefill" in tokens, each tier in bytes)."""

    points: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    seconds: float = 0.0  # the whole calibration, first-time costs included


def calibrate(parts: EngineParts) -> Calibration:
    """Measures the prefill (1 and 4 chunks) and each tier's load (L0's device copy, the host tier's pinned copy, the
    store's staging path for 1 and STAGING_BUFFERS chunks plus one Lookup) on scratch buffers of the served model's
    shapes, each once untimed first; seeds parts.counters.chooser with them. Runs on the step loop's thread, so the
    pinned staging ring it fills is the one requests use."""
    started = time.perf_counter()
    chunk, device = parts.config.chunk_size, parts.device
    longest = min(max(STAGING_BUFFERS, 4) * chunk, parts.max_prompt_tokens)
    num_chunks = [count for count in (1, 4, STAGING_BUFFERS) if count * chunk <= longest]
    buffers = allocate_kv(parts.geometry, longest + QUESTION_TOKENS, device, parts.dtype)
    per_token = 2 * buffers[0][:, :, :1].numel() * buffers[0].element_size()
    result = Calibration()
    result.points["prefill"] = [(count * chunk, _timed(device, lambda count=count: _prefill(parts, buffers, count)))
                                for count in num_chunks[:2]]
    chunk_kv = [(torch.zeros_like(buffers[0][:, :, :chunk]), torch.zeros_like(buffers[1][:, :, :chunk]))]  # a chunk
    if parts.l0 is not None:
        result.points["l0"] = [(count * chunk * per_token, _timed(device, lambda count=count: copy_run_(
            chunk_kv * count, 0, buffers))) for count in num_chunks]
    if parts.host is not None:
        result.points["host"] = _host_points(buffers, chunk, num_chunks, per_token)
    tier = store_tier(parts.store)
    blob = encode_chunk_kv(*chunk_kv[0], 0, 16)
    lookup_s = _lookup_seconds(parts)
    result.points[tier] = [(count * chunk * per_token, lookup_s + _timed(device, lambda count=count: _store_load(
        buffers, blob, chunk, count))) for count in (1, num_chunks[-1])]
    chooser = parts.counters.chooser
    for name, points in result.points.items():
        (chooser.prefill if name == "prefill" else chooser.load_meter(name)).seed(points)
    result.seconds = time.perf_counter() - started
    logger.info("start-up calibration in %.0f ms (first-time costs included): %s", result.seconds * 1000,
                "; ".join(f"{name} {model.fixed_s * 1000:.2f} ms + {model.per_unit_s * 1e9:.3f} ns/unit"
                          for name, model in chooser.models().items() if model is not None))
    return result


def start_calibrated(core, parts: EngineParts, calibrates: bool) -> Calibration | None:
    """Starts the engine's step loop (core: its EngineCore). When calibrates (the load-or-recompute choice is on),
    the cost lines are measured first, on the loop's thread, and this waits for them: once the service reports
    SERVING, its first-time costs are paid. A failed calibration is logged, and the choice starts unmeasured."""
    if not calibrates:
        core.start()
        return None
    done = threading.Event()
    measured: list[Calibration] = []

    def first() -> None:
        try:
            measured.append(calibrate(parts))
        except Exception:  # the service still serves: the choice then learns from its first requests
            logger.exception("start-up calibration failed: the load-or-recompute choice starts unmeasured")
        finally:
            done.set()

    core.start(first)
    done.wait()
    return measured[0] if measured else None


def _timed(device: torch.device, work: Callable[[], object]) -> float:
    """Seconds of one run of work, after one untimed run (its first-time costs), to the device's completion."""
    work()
    _sync(device)
    started = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _prefill(parts: EngineParts, buffers: tuple[torch.Tensor, torch.Tensor], num_chunks: int) -> None:
    """A prompt of num_chunks chunks prefilled from position 0, then a question over it and its first token picked
    (as a cached request's)."""
    generator = torch.Generator().manual_seed(num_chunks)
    vocab = int(getattr(parts.model.config, "vocab_size", 0) or len(parts.tokenizer))
    num_tokens = num_chunks * parts.config.chunk_size
    token_ids = torch.randint(0, vocab, (num_tokens + QUESTION_TOKENS,), generator=generator).to(parts.device)
    prefill(parts.model, build_cache(parts.model.config, *buffers, 0), token_ids[:num_tokens], 0)
    logits, _ = prefill(parts.model, build_cache(parts.model.config, *buffers, num_tokens), token_ids[num_tokens:],
                        num_tokens)
    step_hints(logits.view(1, -1))  # the first token's pick, as the executor makes it


def _host_points(buffers: tuple[torch.Tensor, torch.Tensor], chunk: int, num_chunks: list[int],
                 per_token: int) -> list[tuple[float, float]]:
    """The host tier's copy: pinned host memory to the device in one DMA, then into the slot's slice."""
    pinned = torch.empty((2, *buffers[0][:, :, : num_chunks[-1] * chunk].shape), dtype=buffers[0].dtype,
                         pin_memory=buffers[0].device.type == "cuda")

    def copy(count: int) -> None:
        staged = pinned[:, :, :, : count * chunk].to(buffers[0].device, non_blocking=True)
        buffers[0][:, :, : count * chunk].copy_(staged[0])
        buffers[1][:, :, : count * chunk].copy_(staged[1])

    return [(count * chunk * per_token, _timed(buffers[0].device, lambda count=count: copy(count)))
            for count in num_chunks]


def _store_load(buffers: tuple[torch.Tensor, torch.Tensor], blob: bytes, chunk: int, count: int) -> None:
    """count copies of a 16-bit blob placed as the store's chunks are (kv.loader: staged through the pinned ring on
    CUDA, checksums and the finiteness check included)."""
    header = read_header(blob)
    load = RunLoad(buffers, True, staging_ring() if buffers[0].device.type == "cuda" else None)
    for index in range(count):  # the blob says position 0: each copy goes to its own rows all the same
        load.add(index, b"", blob, header, index * chunk, (index + 1) * chunk)
    assert load.finish() is None, "a calibration blob failed its checks"


def _lookup_seconds(parts: EngineParts) -> float:
    """One Lookup of a key the store does not hold: the round trip every store load pays first (0 when it fails)."""
    try:
        started = time.perf_counter()
        parts.store.lookup(parts.namespace, [os.urandom(32)], None)
        return time.perf_counter() - started
    except StoreUnavailable as error:
        logger.info("calibration: the store's Lookup was not measured: %s", error)
        return 0.0
