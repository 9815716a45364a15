"""The decode step the engine runs, chosen once at start-up and checked by one probe, and the runner that runs it.

The step is the lean step (model/lean_step.py: the one layer loop, scripted on a CPU) where the model takes it
and the probe finds it bitwise the model's forward, else the model's forward itself (model/model_step.py). On a
GPU the lean step is replayed from CUDA graphs (model/graph_step.py) where the same probe finds the replay bitwise
the eager step in the same buckets. The log and Stats.decode_step say which runs and why.

The invariant decode step (the invariant path's, docs/engine.md) is the lean step with every slot as a row (the rows
not decoding padded, as the graphs' buckets pad them) and blockwise attention (model/scripted_layers.py), so every
product has one shape and a row's logits depend on its own inputs only: not on which rows decode beside it, nor on
how long they are. Its probe checks exactly that, bitwise.
"""
from __future__ import annotations

import logging

import torch

from inference_service.model.lean_step import LeanStep, lean_step_support
from inference_service.model.scripted_layers import INVARIANT_ATTENTION_BLOCK
from inference_service.model.graph_step import MIN_LENGTH_BUCKET, CaptureFailed, GraphSteps, graph_support
from inference_service.kv_memory.kv_buffers import kv_geometry
from inference_service.model.model_step import ModelStep
from inference_service.kv_memory.slot_buffers import SlotBuffers
from inference_service.model.step_names import DECODE_STEPS, DEFAULT_DECODE_STEP

logger = logging.getLogger(__name__)


class StepRunner:
    """One token for each decoding slot of a SlotBuffers: through `step` (LeanStep or ModelStep), replayed from
    `graphs` where they were captured and the step fits one of their buckets."""

    def __init__(self, buffers: SlotBuffers, step, graphs: GraphSteps | None = None, name: str = "",
                 reason: str = "") -> None:
        self.buffers, self.step, self.graphs = buffers, step, graphs
        self.name = name  # what Stats.decode_step says: lean, lean+graphs, transformers, +invariant
        self.reason = reason  # why the step asked for does not run ('' when it does)

    @property
    def invariant(self) -> bool:
        """Every step over every slot with blockwise attention: a row's logits depend on the row alone."""
        return getattr(self.step, "attention_block", 0) > 0

    def readable_columns(self, length: int) -> int:
        """Columns a step reaching `length` reads (and so keeps finite): whole attention blocks when invariant."""
        if not self.invariant:
            return length
        block = self.step.attention_block
        return min(-(-length // block) * block, self.buffers.capacity)

    @torch.inference_mode()
    def decode(self, rows: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One token for each slot in rows ({slot: (token id, position)}); returns logits [len(rows), vocab]
        (float32) in the order of `rows`."""
        buffers = self.buffers
        first, last = min(rows), max(rows)
        if self.invariant:  # one shape for every step: all slots, whichever decode
            first, last = 0, buffers.num_slots - 1
        num_rows = last - first + 1  # a view of slots first..last: no copy
        length = max(position for _, position in rows.values()) + 1
        token_ids = [0] * num_rows
        positions = [0] * num_rows
        columns = [buffers.capacity] * num_rows  # the scratch column
        for slot, (token_id, position) in rows.items():
            token_ids[slot - first], positions[slot - first], columns[slot - first] = token_id, position, position
        if self.graphs is not None and self.graphs.can_run(last, length):
            buffers.keep_finite(list(rows), self.readable_columns(self.graphs.shape_for(last, length)[1]))
            try:
                return self.graphs.run(rows, length)
            except CaptureFailed:  # logged; this step and the next run eagerly (nothing was written)
                pass
        buffers.keep_finite(list(rows), self.readable_columns(length))
        device = buffers.device
        position_tensor = torch.tensor(positions, device=device)
        # mask: [rows, 1, 1, length], True where a row may attend: its own columns up to its position.
        mask = (torch.arange(length, device=device)[None, :] <= position_tensor[:, None])[:, None, None, :]
        logits = self.step(buffers.keys[:, first : last + 1], buffers.values[:, first : last + 1],
                           torch.tensor(token_ids, device=device).view(num_rows, 1), position_tensor,
                           torch.tensor(columns, device=device), length, mask)
        order = [slot - first for slot in rows]
        if order == list(range(num_rows)):
            return logits
        return logits[torch.tensor(order, device=device)]


def choose_runner(model, buffers: SlotBuffers, asked: str = DEFAULT_DECODE_STEP,
                  invariant: bool = False) -> StepRunner:
    """The runner over `buffers` for the step asked for: lean where the model supports it and the probe finds it
    bitwise the model's forward (replayed from CUDA graphs where they replay it bitwise), otherwise the model's
    own forward, with the reason (logged). invariant: the lean step as the invariant decode step, where its own
    probe finds a row's logits independent of the other rows (else the lean step, and the log says why)."""
    assert asked in DECODE_STEPS, f"decode step must be one of {DECODE_STEPS}, got {asked!r}"
    if asked == "transformers":
        if invariant:
            logger.warning("invariant decode needs the lean step; --decode-step transformers decodes rows together")
        logger.info("decode step: transformers (the model's own forward)")
        return StepRunner(buffers, ModelStep(model), name="transformers")
    reason = lean_step_support(model)
    step = None if reason else LeanStep(model)
    reason = reason or probe_mismatch(model, step)
    if reason and step is not None and step.fused:  # the joined products round apart here: the seven products
        logger.info("decode step: the joined q|k|v and gate|up products differ from the model's (%s)", reason)
        step = LeanStep(model, fused=False)
        reason = probe_mismatch(model, step)
    if reason:
        logger.warning("decode step %s is off for this model, each step runs transformers' forward%s: %s", asked,
                       " (so invariant decode is off too: a row's tokens may round with the rows beside it)"
                       if invariant else "", reason)
        return StepRunner(buffers, ModelStep(model), name="transformers", reason=reason)
    logger.info("decode step: lean (bitwise the model's forward%s%s)", "; scripted layers" if step.scripted else "",
                "; joined q|k|v and gate|up products" if step.fused else "")
    suffix = ""
    if invariant:
        step.attention_block = INVARIANT_ATTENTION_BLOCK
        broken = probe_invariance(model, step)
        if broken:
            step.attention_block = 0
            logger.warning("invariant decode is off: %s; a row's tokens may round with the rows beside it", broken)
        else:
            suffix = "+invariant"
            logger.info("decode step: invariant (every slot a row, blockwise attention: a row's logits are its own)")
    graphs = _maybe_graphs(model, step, buffers)
    return StepRunner(buffers, step, graphs, name=("lean+graphs" if graphs is not None else "lean") + suffix)


def _maybe_graphs(model, step: LeanStep, buffers: SlotBuffers) -> GraphSteps | None:
    """Graphs over `buffers` where the device allows them and the probe replays bitwise what the eager step
    computes; None (the reason logged) otherwise."""
    reason = graph_support(model.device, step)
    if not reason:
        try:
            reason = probe_mismatch(model, step, graphs=True)
        except Exception as error:  # a capture that fails (an op that syncs, an allocator limit): eager it is
            reason = f"capture failed: {type(error).__name__}: {error}"
    if reason:
        (logger.warning if model.device.type == "cuda" else logger.debug)("decode steps run eagerly: %s", reason)
        return None
    logger.info("decode steps replay CUDA graphs (bitwise the eager step on the probe)")
    return GraphSteps(step, buffers.keys, buffers.values, buffers.capacity)


@torch.inference_mode()
def probe_mismatch(model, step, graphs: bool = False) -> str:
    """Runs the same decode steps two ways over the same random K/V: the model's forward and `step` at exact
    shapes, or (graphs) `step` in CUDA graphs' buckets, eagerly and replayed. The steps: one row in slot 0, one
    above it, two rows with a gap between their slots, one of them at the capacity's column bucket. '' when the
    logits and the K/V written agree bitwise; otherwise what differs."""
    capacity = MIN_LENGTH_BUCKET + 44  # a column bucket below the capacity and one capped at it
    generator = torch.Generator(device="cpu").manual_seed(0)
    runners, noise = [], None
    for candidate, eager in ((step if graphs else ModelStep(model), True), (step, False)):
        buffers, noise = _noisy_slots(model, capacity, generator, noise)
        in_graphs = GraphSteps(candidate, buffers.keys, buffers.values, capacity, eager=eager) if graphs else None
        runners.append(StepRunner(buffers, candidate, in_graphs))
    reference, tried = runners
    tokens = torch.randint(0, model.get_input_embeddings().num_embeddings, (4,), generator=generator).tolist()
    against = "the eager step's" if graphs else "the model's forward"
    for rows in ({0: (tokens[0], 12)}, {1: (tokens[1], 9)}, {0: (tokens[2], 5), 3: (tokens[3], capacity - 1)}):
        expected, got = reference.decode(rows), tried.decode(rows)
        if not torch.equal(expected, got):
            return f"its probe logits differ from {against} (by up to {float((got - expected).abs().max()):.3g})"
    if not (torch.equal(reference.buffers.keys, tried.buffers.keys)
            and torch.equal(reference.buffers.values, tried.buffers.values)):
        return f"its probe wrote other K/V than {against}"
    if graphs and tried.graphs.num_replays != 3:
        return f"the probe replayed {tried.graphs.num_replays} of its 3 steps"
    return ""


def _noisy_slots(model, capacity: int, generator: torch.Generator, noise: torch.Tensor | None):
    """Four slots over the same random K/V (drawn once: pass the returned noise back), 12 columns written."""
    buffers = SlotBuffers(kv_geometry(model.config), 4, capacity, model.device, model.dtype)
    if noise is None:
        noise = torch.randn(buffers.keys.shape, generator=generator).to(model.device, model.dtype)
    buffers.keys.copy_(noise)
    buffers.values.copy_(noise.flip(-1))
    for slot in range(4):
        buffers.written(slot, 12)
    return buffers, noise


@torch.inference_mode()
def probe_invariance(model, step: LeanStep) -> str:
    """A row's logits and written K/V, decoded alone and then beside rows of other lengths (one of them past the
    first attention block, so the step reads more blocks), must be bitwise the same; '' when they are."""
    capacity = 2 * INVARIANT_ATTENTION_BLOCK + 44
    generator = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, model.get_input_embeddings().num_embeddings, (4,), generator=generator).tolist()
    alone_buffers, noise = _noisy_slots(model, capacity, generator, None)
    beside_buffers, _ = _noisy_slots(model, capacity, generator, noise)
    alone, beside = StepRunner(alone_buffers, step), StepRunner(beside_buffers, step)
    expected = alone.decode({1: (tokens[0], 9)})
    got = beside.decode({0: (tokens[1], 5), 1: (tokens[0], 9), 3: (tokens[2], INVARIANT_ATTENTION_BLOCK + 30)})[1:2]
    if not torch.equal(expected, got):
        return f"its probe's row differs beside other rows (by up to {float((got - expected).abs().max()):.3g})"
    if not (torch.equal(alone_buffers.keys[:, 1, :, :10], beside_buffers.keys[:, 1, :, :10])
            and torch.equal(alone_buffers.values[:, 1, :, :10], beside_buffers.values[:, 1, :, :10])):
        return "its probe's row wrote other K/V beside other rows"
    return ""
