"""RoPE re-rotation of cached keys to new positions, with the model's own (scaled) rotary parameters."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Types whose inv_freq is fixed for a model: a key at position p is R(p·inv_freq)·k, so R(p+Δ)=R(Δ)·R(p)
# holds exactly at any position.
_STATIC_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# Types whose inv_freq changes with the sequence length; exact only while every position stays below
# a threshold where they equal their base frequencies.
_LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


class UnsupportedRope(ValueError):
    """The model's rotary embedding cannot be re-rotated exactly."""


@dataclass(slots=True, frozen=True)
class RopeParams:
    inv_freq: torch.Tensor  # [rotary_dim // 2], float32, exactly the model's
    attention_scaling: float  # multiplies cos/sin inside the model; a pure rotation by Δ must not apply it
    rope_type: str
    max_exact_position: int | None = None  # re-rotation is refused at or beyond this position (None: no limit)
    note: str = ""

    def __post_init__(self) -> None:
        assert self.inv_freq.dim() == 1 and self.inv_freq.numel() > 0, "inv_freq must be a non-empty vector"

    @property
    def rotary_dim(self) -> int:
        """Leading head dims that rotate; the rest pass through (partial rotary models)."""
        return 2 * self.inv_freq.numel()


def rope_parameters(config) -> RopeParams:
    """The rotary parameters a model built from `config` uses, computed by transformers' own functions.

    Raises:
        UnsupportedRope: for per-layer-type RoPE (e.g. Gemma 3), models with layers that skip RoPE (SmolLM3's
            NoPE layers) and rope types transformers does not know.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    no_rope_layers = getattr(config, "no_rope_layers", None)  # SmolLM3: 0 marks a layer without RoPE (NoPE)
    if no_rope_layers is not None and not all(no_rope_layers):
        raise UnsupportedRope(f"layers {[i for i, r in enumerate(no_rope_layers) if not r]} use no RoPE; keys are "
                              "moved with one rotation for every layer")
    config.standardize_rope_params()
    rope = config.rope_parameters
    if rope is None or "rope_type" not in rope:
        raise UnsupportedRope(f"config has no single rope_parameters entry (per-layer RoPE?): {rope!r}")
    rope_type = rope["rope_type"]
    if rope_type == "default":
        inv_freq, scaling = _default_inv_freq(rope, config), 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS and rope_type in _STATIC_TYPES + _LENGTH_DEPENDENT_TYPES:
        # Called as the model's rotary embedding calls it at init (no seq_len): the frequencies it starts with.
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    else:
        raise UnsupportedRope(f"rope_type {rope_type!r} is not supported for re-rotation")
    limit, note = None, ""
    if rope_type == "dynamic":
        limit = int(config.max_position_embeddings)
        note = f"dynamic NTK RoPE: exact below {limit} positions, where the model uses its base frequencies"
    elif rope_type == "longrope":
        limit = int(rope["original_max_position_embeddings"])
        note = f"LongRoPE: exact below {limit} positions, where the model uses its short factors"
    return RopeParams(inv_freq.float().cpu(), float(scaling), rope_type, limit, note)


def _default_inv_freq(rope: dict, config) -> torch.Tensor:
    # Same formula as the models' compute_default_rope_parameters (which lives on each model class).
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rerotate_keys(
    keys: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor, params: RopeParams
) -> torch.Tensor:
    """Keys computed at from_positions, moved to to_positions: each token is rotated by Δ = to - from.

    Args:
        keys: [..., tokens, head_dim], e.g. [layers, kv_heads, tokens, head_dim], already rotated by the
            model (HF rotate_half layout: the first and second halves of the rotary dims pair up).
        from_positions, to_positions: [tokens] integer positions.
    Returns:
        A new tensor of the same shape and dtype.
    Raises:
        UnsupportedRope: a position reaches params.max_exact_position.
    """
    moved = keys.clone()
    rerotate_keys_(moved, from_positions, to_positions, params)
    return moved


def rerotate_keys_(
    keys: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor, params: RopeParams
) -> None:
    """rerotate_keys in place: `keys` (a view into a larger buffer works) is overwritten with the moved keys.

    Raises UnsupportedRope (keys untouched) where rerotate_keys would.
    """
    num_tokens, head_dim = keys.shape[-2], keys.shape[-1]
    assert from_positions.shape == (num_tokens,), f"from_positions must be [{num_tokens}], got {tuple(from_positions.shape)}"
    assert to_positions.shape == (num_tokens,), f"to_positions must be [{num_tokens}], got {tuple(to_positions.shape)}"
    assert params.rotary_dim <= head_dim, f"rotary dim {params.rotary_dim} exceeds head_dim {head_dim}"
    check_rerotation(params, from_positions, to_positions)
    # The model applies attention_scaling to cos and sin, so a stored key is scaling·R(p)·k; rotating it
    # by R(Δ) alone gives scaling·R(p+Δ)·k. Angles in float64: Δ·inv_freq loses bits in float32.
    delta = (to_positions.to(torch.float64) - from_positions.to(torch.float64)).to(keys.device)
    angles = delta[:, None] * params.inv_freq.to(device=keys.device, dtype=torch.float64)[None, :]  # [tokens, half]
    # Rotate in at least float32 (bf16/fp16 keys lose digits otherwise), then back to the keys' dtype.
    compute_dtype = torch.promote_types(keys.dtype, torch.float32)
    cos, sin = angles.cos().to(compute_dtype), angles.sin().to(compute_dtype)
    rotary = keys[..., : params.rotary_dim]
    work = rotary if rotary.dtype == compute_dtype else rotary.to(compute_dtype)
    # rotate_half pairs dim i with i + half: (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin), both halves
    # sharing one angle per pair; computed in place, without rotate_half's concatenated copy.
    half = params.rotary_dim // 2
    first, second = work[..., :half], work[..., half:]
    original_first = first.clone()
    first.mul_(cos).addcmul_(second, sin, value=-1)
    second.mul_(cos).addcmul_(original_first, sin)
    if work is not rotary:
        rotary.copy_(work)


def check_rerotation(params: RopeParams, *positions: torch.Tensor) -> None:
    """Raises UnsupportedRope where rerotate_keys would refuse keys at or moved to these positions."""
    if params.max_exact_position is None:
        return
    highest = max((int(p.max()) for p in positions if p.numel()), default=-1)
    if highest >= params.max_exact_position:
        raise UnsupportedRope(f"position {highest} is out of range for re-rotation: {params.note}")
