"""Decides from a model config, before any weight is loaded, whether chunk K/V reuse is sound for it."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from inference_service.errors import UnsupportedArchitecture

logger = logging.getLogger(__name__)

# Decoder-only models with full rotary position embeddings: a chunk's K/V depend on its tokens,
# the tokens before it and their absolute positions only, and keys can be re-rotated.
SUPPORTED_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
    "gemma", "gemma2", "gemma3_text", "phi3", "olmo", "olmo2", "granite", "starcoder2",
    "smollm3",
})

_LEARNED_POSITIONS = "learned absolute position embeddings: K/V cannot be moved to other positions"
_ALIBI = "ALiBi attention biases instead of rotary embeddings"
_PARTIAL_ROTARY = "partial rotary embeddings (only part of each head rotates), not handled by re-rotation"

REFUSED_MODEL_TYPES: dict[str, str] = {
    "gpt2": _LEARNED_POSITIONS,
    "gpt_bigcode": _LEARNED_POSITIONS,
    "opt": _LEARNED_POSITIONS,
    "biogpt": _LEARNED_POSITIONS,
    "bloom": _ALIBI,
    "mpt": _ALIBI,
    "falcon": f"{_ALIBI} in some checkpoints, rotary in others (the `alibi` flag)",
    "gpt_neox": _PARTIAL_ROTARY,
    "gptj": _PARTIAL_ROTARY,
    "phi": _PARTIAL_ROTARY,
    "stablelm": _PARTIAL_ROTARY,
    "persimmon": _PARTIAL_ROTARY,
}


@dataclass(slots=True, frozen=True)
class ArchitectureCheck:
    model_type: str
    architecture: str  # e.g. "LlamaForCausalLM"; the model type when the config names none
    supported: bool
    reason: str  # why it is not supported; empty when it is

    def __post_init__(self) -> None:
        assert self.supported == (not self.reason), "a refusal carries a reason, a supported model none"


def inspect_architecture(config: object) -> ArchitectureCheck:
    """Classifies a config (a transformers PretrainedConfig or anything with the same attributes)."""
    model_type = str(getattr(config, "model_type", "") or "")
    names = getattr(config, "architectures", None) or []
    architecture = str(names[0]) if names else model_type
    return ArchitectureCheck(model_type, architecture, *_verdict(config, model_type))


def _verdict(config: object, model_type: str) -> tuple[bool, str]:
    if getattr(config, "is_encoder_decoder", False):
        return False, "encoder-decoder model: only decoder-only causal LMs are served"
    if model_type in REFUSED_MODEL_TYPES:
        return False, REFUSED_MODEL_TYPES[model_type]
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        return False, f"model type {model_type!r} is not on the supported list ({supported})"
    if _rotary_fraction(config) < 1.0:
        return False, _PARTIAL_ROTARY
    return True, ""


def _rotary_fraction(config: object) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    fraction = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if fraction is None:
        fraction = getattr(config, "partial_rotary_factor", 1.0)
    return float(fraction if fraction is not None else 1.0)


def check_architecture(config: object, strict: bool = True) -> ArchitectureCheck:
    """Returns the check; raises UnsupportedArchitecture for an unsupported model when strict.

    With strict=False an unsupported model is only logged: the caller tries anyway.
    """
    check = inspect_architecture(config)
    if check.supported:
        return check
    message = f"{check.architecture} ({check.model_type}) is not supported: {check.reason}"
    if strict:
        raise UnsupportedArchitecture(f"{message}; pass --no-strict to try anyway")
    logger.warning("%s; trying anyway (--no-strict)", message)
    return check
