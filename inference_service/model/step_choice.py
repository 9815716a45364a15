"""Which decode step the engine runs, checked against the model's own forward before the first request."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference_service.model.decode_step import (LeanStep, lean_step_support, packed_matmul_support, split_support,
                                                  wide_support)
from inference_service.model.kv_buffers import kv_geometry
from inference_service.model.slot_buffers import SlotBuffers
from inference_service.model.step_names import DECODE_STEPS, DEFAULT_DECODE_STEP

logger = logging.getLogger(__name__)

PACK_ROWS = 16  # the row count oneDNN's weight layout is tuned for (the engine's default running rows)
# onednn: the probe's logits may differ by rounding only (the projections sum in another order).
PACKED_TOLERANCE = 1e-3


# Steps that become lean where they cannot run: (why not here, LeanStep's arguments, what the log says it is).
LEAN_VARIANTS = {
    "split": (split_support, {"split": True}, "projections on two threads, bitwise the model's forward"),
    "wide": (wide_support, {"wide": True},
             "one row bitwise the model's forward; several rows through transposed weights, rounded differently"),
}


@dataclass(slots=True, frozen=True)
class StepChoice:
    step: LeanStep | None  # None: the model's own forward
    name: str  # the step that runs: one of DECODE_STEPS
    reason: str  # why it is not the one asked for ('' when it is)


def choose_decode_step(model, asked: str = DEFAULT_DECODE_STEP) -> StepChoice:
    """The step asked for when the model supports it and a probe step agrees with the model's forward (bitwise for
    split and lean, within rounding for onednn and for wide's rows decoded together); otherwise the model's own
    forward, with the reason (logged). split or wide that cannot run here (one inter-op thread, not a CPU, a probe
    that differs) becomes lean, with the reason."""
    assert asked in DECODE_STEPS, f"decode step must be one of {DECODE_STEPS}, got {asked!r}"
    if asked == "transformers":
        logger.info("decode step: transformers (the model's own forward)")
        return StepChoice(None, asked, "")
    if asked in LEAN_VARIANTS:
        support, build, described = LEAN_VARIANTS[asked]
        reason = lean_step_support(model) or support(model.device)
        if not reason:
            step = LeanStep(model, **build)
            reason = probe_mismatch(model, step)
            if not reason:
                logger.info("decode step: %s (%s)", asked, described)
                return StepChoice(step, asked, "")
        logger.info("decode step %s is off for this model (%s); trying lean", asked, reason)
        fallback = choose_decode_step(model, "lean")
        return StepChoice(fallback.step, fallback.name, reason + (f"; {fallback.reason}" if fallback.reason else ""))
    reason = lean_step_support(model)
    if not reason and asked == "onednn":
        reason = packed_matmul_support(model.device, model.dtype)
    step = None
    if not reason:
        step = LeanStep(model, pack_rows=PACK_ROWS if asked == "onednn" else 0)
        reason = probe_mismatch(model, step)
    if reason:
        logger.warning("decode step %s is off for this model, each step runs transformers' forward: %s", asked, reason)
        return StepChoice(None, "transformers", reason)
    logger.info("decode step: %s%s", asked, " (oneDNN packed weights: not bitwise exact)" if step.packed else
                " (bitwise the model's forward)")
    return StepChoice(step, asked, "")


@torch.inference_mode()
def probe_mismatch(model, step: LeanStep) -> str:
    """Runs the same steps through the model's forward and `step` over random K/V (one row, then rows of
    different lengths with a gap between their slots); '' when the logits and the K/V written agree (bitwise;
    within rounding where the step is not exact: every row of onednn, rows decoded together by wide)."""
    geometry = kv_geometry(model.config)
    generator = torch.Generator(device="cpu").manual_seed(0)
    buffers = [SlotBuffers(model.config, geometry, 4, 16, model.device, model.dtype) for _ in range(2)]
    noise = torch.randn(buffers[0].keys.shape, generator=generator).to(model.device, model.dtype)
    for slots in buffers:
        slots.keys.copy_(noise)
        slots.values.copy_(noise.flip(-1))
        for slot in range(4):
            slots.written(slot, 12)
    vocab_size = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocab_size, (3,), generator=generator).tolist()
    reference, lean = buffers
    lean.step = step
    for rows in ({1: (tokens[0], 9)}, {0: (tokens[1], 5), 3: (tokens[2], 11)}):
        expected, got = reference.decode(model, rows), lean.decode(model, rows)
        if step.packed or (step.wide and len(rows) > 1):
            scale = float(expected.abs().max()) + 1e-6
            if not bool(torch.isfinite(got).all()) or float((got - expected).abs().max()) > PACKED_TOLERANCE * scale:
                return f"its probe logits are off by more than rounding ({float((got - expected).abs().max()):.3g})"
        elif not torch.equal(expected, got):
            return f"its probe logits differ from the model's forward (by up to {float((got - expected).abs().max()):.3g})"
        bitwise = step.exact or (step.wide and len(rows) == 1)  # K/V so far must be the model's own bits
        if bitwise and not (torch.equal(reference.keys, lean.keys) and torch.equal(reference.values, lean.values)):
            return "its probe wrote other K/V than the model's forward"
    return ""
