"""Loads a model and its tokenizer onto a device, after checking its architecture."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from inference_service.model import weights
from inference_service.model.architectures import ArchitectureCheck, check_architecture

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
@dataclass(slots=True, frozen=True)
class LoadedModel:
    model: Any  # a transformers causal LM in eval mode
    tokenizer: Any
    model_id: str  # the name or path asked for (what /v1/models and logs show)
    path: str  # where the weights were read from
    architecture: ArchitectureCheck
    weights_id: str = ""  # the weights' fingerprint (weights.weights_fingerprint): the model part of the namespace


def pick_device_dtype(device: str | None = None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA with bf16 (fp16 where bf16 is not supported) when present, else CPU fp32; explicit choices win."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen_device = torch.device(device)
    if chosen_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is present")
    if dtype is None:
        if chosen_device.type != "cuda":
            return chosen_device, torch.float32
        return chosen_device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    return chosen_device, _DTYPES[dtype]


def set_threads(num_threads: int) -> None:
    """torch's intra-op threads for the model (0: torch's default, one per core); logged either way."""
    if num_threads:
        torch.set_num_threads(num_threads)
    logger.info("torch intra-op threads: %d%s", torch.get_num_threads(), "" if num_threads else " (torch's default)")


def load_model(name_or_path: str, device: str | None = None, dtype: str | None = None, strict: bool = True) -> LoadedModel:
    """Checks the architecture from the config first, then loads weights and tokenizer from disk.

    Raises:
        UnsupportedArchitecture: the config names an architecture chunk reuse is not sound for (strict only).
    """
    model_id = name_or_path or weights.DEFAULT_MODEL
    path = weights.resolve_model_path(name_or_path)
    architecture = check_architecture(AutoConfig.from_pretrained(path), strict=strict)
    chosen_device, chosen_dtype = pick_device_dtype(device, dtype)
    logger.info("loading %s from %s on %s as %s", model_id, path, chosen_device, chosen_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=chosen_dtype).to(chosen_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    weights_id = weights.weights_fingerprint(path) or weights.state_fingerprint(model)
    model.kvboost_weights_id = weights_id  # an Engine built on this model keys its chunks by it
    logger.info("weights fingerprint %s", weights_id)
    return LoadedModel(model, tokenizer, model_id, path, architecture, weights_id)

