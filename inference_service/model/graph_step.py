"""The batched decode step replayed from CUDA graphs: one launch per step instead of ~30 kernels per layer.

On a GPU the lean step (model/lean_step.py) is launch-bound: Python and the dispatcher start each of its ~1,000
kernels (an 8B model) one after the other, for several times what reading the weights once takes (docs/gpu.md,
Where the time goes). Captured once as
a CUDA graph, a step is one replay. A graph fixes its shapes and addresses, so it is captured per bucket: the rows
are slots [0, R) of the slot buffers (R a power of two covering the highest decoding slot; rows not decoding this
step run on token 0 at position 0 and write only their slot's scratch column) and attention reads columns [0, L)
(L a power of two from 256 covering the longest row, at most the capacity; each row's mask stops at its own
position, and the columns past it are kept finite by SlotBuffers as before). Tokens, positions and columns go in
through one copy into the graph's static input; the logits come out of its static output.

Exactness: a bucket runs the same kernels as the eager step on more rows and more (masked) columns, which on a GPU
may round apart from the exact shapes: the GPU tests compare answers with model.generate (fp32) and bench_gpu.py
reports bf16 agreement. Before the first request a probe runs the same buckets eagerly and from captured graphs
over the same random K/V and compares them bitwise; where they differ, or capture fails, the eager step runs at
exact shapes and the log says why (model/step_runner.py runs that probe).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference_service.model.lean_step import LeanStep

logger = logging.getLogger(__name__)

MIN_LENGTH_BUCKET = 256
MAX_GRAPHS = 64  # buckets captured at most; a step outside them runs eagerly


def graph_support(device: torch.device, step) -> str:
    """Why decode steps cannot be captured here; '' when they can (the probe still decides)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the model is on {device.type}"
    if not isinstance(step, LeanStep):
        return "the decode step is transformers' own forward (only the lean step is captured)"
    return ""


def bucket(value: int, floor: int, ceiling: int) -> int:
    """The smallest power of two >= value (at least floor), capped at ceiling."""
    size = floor
    while size < value:
        size *= 2
    return min(size, ceiling)


class CaptureFailed(RuntimeError):
    """A bucket could not be captured while serving; the caller runs the step eagerly instead."""


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: GraphSteps.eager, which runs the bucket's step without a graph
    inputs: torch.Tensor  # [3, rows] int64 on the device: token ids, positions, columns
    host: torch.Tensor  # the same, pinned: filled on the host, copied in before each replay
    logits: torch.Tensor  # [rows, vocab] float32, rewritten by each replay
    forward: object = None  # the eager run's step

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits.copy_(self.forward())


class GraphSteps:
    """Captured decode steps over one SlotBuffers' memory (keys, values [layers, slots, kv_heads, capacity + 1, dim])."""

    def __init__(self, step: LeanStep, keys: torch.Tensor, values: torch.Tensor, capacity: int,
                 eager: bool = False) -> None:
        """eager: run each bucket's step without capturing it (the probe's reference, and a CPU dry run)."""
        self.step, self.keys, self.values, self.capacity = step, keys, values, capacity
        self.num_slots = keys.shape[1]
        self.eager = eager or keys.device.type != "cuda"
        self.pool = None if self.eager else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.num_replays = 0
        self.failure = ""  # why capture failed while serving: from then on every step runs eagerly

    def shape_for(self, last_slot: int, length: int) -> tuple[int, int]:
        """(rows, columns) of the bucket a step over slots up to last_slot and `length` columns replays."""
        if self.step.attention_block:  # the invariant step: one row bucket, every slot, whichever decode
            return (self.num_slots, bucket(length, min(MIN_LENGTH_BUCKET, self.capacity), self.capacity))
        return (bucket(last_slot + 1, 1, self.num_slots),
                bucket(length, min(MIN_LENGTH_BUCKET, self.capacity), self.capacity))

    def can_run(self, last_slot: int, length: int) -> bool:
        shape = self.shape_for(last_slot, length)
        return (not self.failure and length <= self.capacity
                and (shape in self._graphs or len(self._graphs) < MAX_GRAPHS))

    @torch.inference_mode()
    def run(self, rows: dict[int, tuple[int, int]], length: int) -> torch.Tensor:
        """Logits [len(rows), vocab] (float32) for rows {slot: (token id, position)}, in their order (can_run must
        hold; the caller keeps columns [0, shape_for(...)[1]) of the decoding slots finite)."""
        num_rows, columns = self.shape_for(max(rows), length)
        captured = self._graphs.get((num_rows, columns))
        if captured is None:
            try:
                captured = self._capture(num_rows, columns)
            except Exception as error:  # out of memory in a new bucket, say: the step runs eagerly from now on
                self.failure = f"{type(error).__name__}: {error}"
                logger.warning("capturing the decode step for %d rows x %d columns failed, steps run eagerly from "
                               "now on: %s", num_rows, columns, self.failure)
                raise CaptureFailed(self.failure) from error
        host = captured.host.numpy()
        host[0].fill(0)
        host[1].fill(0)
        host[2].fill(self.capacity)  # rows not decoding write their scratch column only
        for slot, (token_id, position) in rows.items():
            host[:, slot] = (token_id, position, position)
        captured.inputs.copy_(captured.host, non_blocking=True)
        captured.replay()
        self.num_replays += 1
        return captured.logits[torch.tensor(list(rows), device=captured.logits.device)]

    def _forward(self, inputs: torch.Tensor, num_rows: int, columns: int) -> torch.Tensor:
        positions = inputs[1]
        mask = (torch.arange(columns, device=inputs.device)[None, :] <= positions[:, None])[:, None, None, :]
        return self.step(self.keys[:, :num_rows], self.values[:, :num_rows], inputs[0].view(num_rows, 1), positions,
                         inputs[2], columns, mask)

    def _capture(self, num_rows: int, columns: int) -> _Graph:
        inputs = torch.zeros(3, num_rows, dtype=torch.long, device=self.keys.device)
        inputs[2] = self.capacity
        if self.eager:  # the same buckets, padding and inputs, run without a graph
            forward = lambda: self._forward(inputs, num_rows, columns)
            captured = _Graph(None, inputs, torch.empty(inputs.shape, dtype=inputs.dtype), forward().clone(), forward)
            self._graphs[num_rows, columns] = captured
            return captured
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces) outside the capture
            self._forward(inputs, num_rows, columns)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the write-back thread copies K/V off the device while a bucket is captured; in the default
        # (global) mode its copies would fail, and invalidate the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(inputs, num_rows, columns)
        captured = _Graph(graph, inputs, torch.empty_like(inputs, device="cpu").pin_memory(), logits)
        self._graphs[num_rows, columns] = captured
        logger.info("decode step captured as a CUDA graph for %d rows x %d columns (%d graphs)", num_rows, columns,
                    len(self._graphs))
        return captured
