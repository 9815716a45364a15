"""Prefill of a partly cached prompt: computes missing tokens and repairs approximate (content-hit) K/V."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.model.attention import ENGINE_ATTENTION, engine_call_kwargs

# Per-position status of an assembled prompt, as an int8 tensor [S].
EXACT, APPROX, MISSING = 0, 1, 2  # prefix hit (reused as is), content hit (re-rotated, repairable), not cached
STRATEGIES = ("none", "selective", "cacheblend")
MASKABLE_ATTENTION = ("sdpa", "eager", ENGINE_ATTENTION)  # implementations that take an arbitrary additive 4D mask


@dataclass(slots=True, frozen=True)
class RepairOptions:
    strategy: str = "cacheblend"
    recompute_ratio: float = 0.15  # cacheblend: share of APPROX tokens recomputed in the later layers
    selective_tokens: int = 16  # selective: APPROX tokens recomputed after each seam
    sink_tokens: int = 0  # selective, cacheblend: the first tokens of the prompt are always recomputed
    check_layers: int = 1  # cacheblend: leading layers recomputed for every non-EXACT token
    # cacheblend: the fidelity guard. When the K/V error left unrepaired at the check layer (risk, see
    # _residual_risk) exceeds this share, every non-EXACT token is recomputed (the answer is then full
    # prefill's). 0 disables the guard.
    guard_threshold: float = 0.0

    def __post_init__(self) -> None:
        assert self.strategy in STRATEGIES, f"strategy must be one of {STRATEGIES}, got {self.strategy!r}"
        assert 0.0 <= self.recompute_ratio <= 1.0, f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}"
        assert self.selective_tokens >= 0, f"selective_tokens must be >= 0, got {self.selective_tokens}"
        assert self.sink_tokens >= 0, f"sink_tokens must be >= 0, got {self.sink_tokens}"
        assert self.check_layers >= 1, f"check_layers must be >= 1, got {self.check_layers}"
        assert self.guard_threshold >= 0.0, f"guard_threshold must be >= 0, got {self.guard_threshold}"


@dataclass(slots=True)
class RepairResult:
    cache: object  # transformers DynamicCache holding all S positions
    last_logits: torch.Tensor  # [vocab], float32, for the last prompt token
    num_recomputed: int  # APPROX tokens whose K/V were recomputed through the last layer
    risk: float = 0.0  # cacheblend: the share of check-layer K/V error the chosen tokens left unrepaired
    guarded: bool = False  # the fidelity guard fired: every APPROX token was recomputed


def seam_positions(status: torch.Tensor, seams: torch.Tensor | None = None) -> torch.Tensor:
    """Starts of APPROX runs (entered from another status) plus the given seams that fall on APPROX tokens.

    Args:
        status: [S] EXACT/APPROX/MISSING.
        seams: optional positions where a new stored run starts inside an APPROX stretch, e.g. where one
            content-hit document follows another directly.
    Returns:
        Sorted unique positions, int64.
    """
    is_approx = status == APPROX
    entered = is_approx.clone()
    entered[1:] &= ~is_approx[:-1]
    if seams is not None and seams.numel():
        seams = seams.to(device=status.device, dtype=torch.long)
        entered[seams] |= is_approx[seams]
    return entered.nonzero().flatten()


def selective_positions(status: torch.Tensor, num_tokens: int, seams: torch.Tensor | None = None) -> torch.Tensor:
    """The first num_tokens APPROX positions after each seam, each window stopping at the end of its run."""
    positions = torch.arange(status.numel(), device=status.device)
    is_seam = torch.zeros_like(status, dtype=torch.bool)
    is_seam[seam_positions(status, seams)] = True
    # Every APPROX run starts with a seam, so the latest seam at or before an APPROX token is in its run.
    latest_seam = torch.where(is_seam, positions, -1).cummax(dim=0).values
    chosen = (status == APPROX) & (latest_seam >= 0) & (positions - latest_seam < num_tokens)
    return chosen.nonzero().flatten()


def select_tokens(deviation: torch.Tensor, status: torch.Tensor, ratio: float, sink_tokens: int) -> torch.Tensor:
    """CacheBlend's choice: the round(ratio · #APPROX) APPROX tokens of highest deviation, every MISSING
    token and the non-EXACT tokens among the first sink_tokens.

    Ties in deviation go to the earlier position. Returns sorted unique positions, int64.
    """
    approx = (status == APPROX).nonzero().flatten()
    num_chosen = round(ratio * approx.numel())
    order = torch.sort(deviation[approx], descending=True, stable=True).indices
    chosen = torch.zeros_like(status, dtype=torch.bool)
    chosen[approx[order[:num_chosen]]] = True
    chosen |= status == MISSING
    chosen[:sink_tokens] |= status[:sink_tokens] != EXACT
    return chosen.nonzero().flatten()


@torch.inference_mode()
def repair_prefill(
    model,
    input_ids: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    status: torch.Tensor,
    options: RepairOptions,
    seams: torch.Tensor | None = None,
    token_scores: torch.Tensor | None = None,
) -> RepairResult:
    """Computes the MISSING tokens and repairs APPROX ones by options.strategy; never runs all layers
    over all tokens unless every token needs it.

    Args:
        input_ids: [1, S].
        keys, values: per layer [1, kv_heads, S, head_dim]; APPROX keys already re-rotated to their
            positions; MISSING rows are ignored. They are updated in place with the recomputed rows.
        status: [S] int8 EXACT/APPROX/MISSING; the last token must be MISSING.
        seams: optional extra seam positions for `selective` (see seam_positions).
        token_scores: cacheblend only, [S]: rank APPROX tokens by these instead of the deviation measured
            after the check layers (for diagnostics, e.g. an oracle's ranking by the true K/V error).
    Returns:
        RepairResult with the cache of all S positions and the last token's logits.
    """
    runner = _LayerwiseForward(model, keys, values)
    _check_inputs(runner, input_ids, status)
    status = status.to(keys[0].device)
    risk, guarded = 0.0, False
    if options.strategy == "cacheblend":
        chosen, hidden, risk, guarded = _cacheblend(runner, input_ids, status, options, token_scores)
    else:
        chosen = (status == MISSING).nonzero().flatten()
        if options.strategy == "selective":
            sinks = (status[: options.sink_tokens] != EXACT).nonzero().flatten()
            extra = torch.cat((selective_positions(status, options.selective_tokens, seams), sinks))
            chosen = torch.cat((chosen, extra)).unique()
        hidden = runner.run(runner.embed(input_ids, chosen), chosen, range(runner.num_layers))
    return RepairResult(
        cache=_cache_over(runner.config, keys, values),
        last_logits=runner.logits(hidden[:, -1:])[0, -1].float(),
        num_recomputed=int((status[chosen] == APPROX).sum()),
        risk=risk,
        guarded=guarded,
    )


def _cacheblend(runner: _LayerwiseForward, input_ids, status, options: RepairOptions, token_scores=None):
    """Layer-wise CacheBlend. The first check_layers layers run on every non-EXACT token. Their output
    feeds the K/V projection of layer c = check_layers for all those tokens: the first K/V that depend on
    the new context (layer 0's depend on the token and its position only, so they never deviate). Those
    fresh K/V are spliced in, their deviation from the cached ones picks the tokens, and layers c.. run
    on the picked tokens only, attending to cached K/V everywhere else.

    The fidelity guard (options.guard_threshold > 0): when the chosen tokens leave more than that share
    of the check layer's K/V error unrepaired, every non-EXACT token runs the later layers instead.

    Returns (chosen positions [n], hidden states after the last layer [1, n, hidden], risk, guarded).
    """
    live = (status != EXACT).nonzero().flatten()
    check = min(options.check_layers, runner.num_layers)
    hidden = runner.run(runner.embed(input_ids, live), live, range(check))
    if check == runner.num_layers:
        return live, hidden, 0.0, False
    approx = (status == APPROX).nonzero().flatten()
    cached_keys = runner.keys[check][:, :, approx].clone()  # [1, kv_heads, #approx, head_dim]
    cached_values = runner.values[check][:, :, approx].clone()
    runner.splice_projections(check, hidden, live)
    deviation = torch.zeros(status.numel(), device=status.device)
    deviation[approx] = _squared_distance(runner.keys[check][:, :, approx], cached_keys) + _squared_distance(
        runner.values[check][:, :, approx], cached_values
    )
    scores = deviation if token_scores is None else token_scores.to(deviation)
    chosen = select_tokens(scores, status, options.recompute_ratio, options.sink_tokens)
    risk = _residual_risk(deviation, approx, chosen, cached_keys, cached_values)
    guarded = 0.0 < options.guard_threshold < risk
    if guarded:
        chosen = live
    rows = torch.searchsorted(live, chosen)  # chosen ⊆ live, both sorted
    return chosen, runner.run(hidden[:, rows], chosen, range(check, runner.num_layers)), risk, guarded


def _residual_risk(deviation: torch.Tensor, approx: torch.Tensor, chosen: torch.Tensor,
                   cached_keys: torch.Tensor, cached_values: torch.Tensor) -> float:
    """Squared K/V deviation at the check layer of the APPROX tokens left unchosen, relative to the squared
    norm of all APPROX tokens' cached K/V there: 0 when repair fixes everything that deviates."""
    if approx.numel() == 0:
        return 0.0
    left = torch.ones(deviation.numel(), dtype=torch.bool, device=deviation.device)
    left[chosen] = False
    unrepaired = float(deviation[approx][left[approx]].sum())
    norm = float(cached_keys.float().pow(2).sum() + cached_values.float().pow(2).sum())
    return unrepaired / norm if norm > 0 else 0.0


def _cache_over(config, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A DynamicCache whose layers are the model's kinds (sliding-window layers keep their window) and
    whose full-attention layers hold the given tensors as they are, without a copy."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    for layer, layer_keys, layer_values in zip(cache.layers, keys, values):
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(layer_keys, layer_values)
            layer.keys, layer.values = layer_keys, layer_values
        else:
            layer.update(layer_keys, layer_values)
    return cache


def _squared_distance(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    # [1, kv_heads, tokens, head_dim] -> [tokens], summed over heads and dims
    return (fresh.float() - cached.float()).pow(2).sum(dim=(0, 1, 3))


def _check_inputs(runner: _LayerwiseForward, input_ids: torch.Tensor, status: torch.Tensor) -> None:
    num_tokens = input_ids.shape[-1]
    assert input_ids.shape == (1, num_tokens), f"input_ids must be [1, S], got {tuple(input_ids.shape)}"
    assert status.shape == (num_tokens,), f"status must be [{num_tokens}], got {tuple(status.shape)}"
    assert int(status[-1]) == MISSING, "the last prompt token must be MISSING so that it yields logits"
    assert len(runner.keys) == runner.num_layers == len(runner.values), "need K and V for every layer"
    for layer_keys in runner.keys:
        assert layer_keys.shape[0] == 1 and layer_keys.shape[2] == num_tokens, (
            f"keys must be [1, kv_heads, {num_tokens}, head_dim] per layer, got {tuple(layer_keys.shape)}"
        )


class _SpliceCache:
    """Stands in for the Cache inside one decoder-layer call. HF attention calls
    past_key_values.update(k, v, layer_idx) with the K/V of its query tokens and attends over what it
    returns; DynamicCache would append them, but here the queries sit at arbitrary positions of a full
    S-long cache. So update() writes them into the full per-layer tensors at those positions and returns
    the full tensors: the layer attends to fresh K/V at recomputed positions and to cached K/V elsewhere,
    with the model's own projections, norms, RoPE and attention kernel."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.positions: torch.Tensor | None = None  # [n] positions of the current query tokens

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [1, kv_heads, n, head_dim]
        self.keys[layer_idx].index_copy_(2, self.positions, key_states.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.positions, value_states.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]


class _ProjectionsSpliced(Exception):
    """Raised by _ProjectionOnlyCache to stop an attention call once its K/V are spliced in."""


class _ProjectionOnlyCache(_SpliceCache):
    # The attention module computes q/k/v (and any k norm, RoPE) before calling update(); stopping there
    # gets a layer's fresh K/V without paying for its attention or MLP, whatever the architecture.
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        super().update(key_states, value_states, layer_idx)
        raise _ProjectionsSpliced


class _LayerwiseForward:
    """Runs the model's own decoder layers for a subset of query positions over S-long per-layer K/V."""

    def __init__(self, model, keys: list[torch.Tensor], values: list[torch.Tensor]):
        implementation = model.config._attn_implementation
        assert implementation in MASKABLE_ATTENTION, (
            f"repair needs attention that takes a 4D mask {MASKABLE_ATTENTION}, the model uses {implementation!r}"
        )
        self.model, self.decoder = model, model.get_decoder()
        self.config = model.config.get_text_config(decoder=True)
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.keys, self.values = keys, values
        self.num_tokens = keys[0].shape[2]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # -> [1, n, hidden]
        return self.model.get_input_embeddings()(input_ids[:, positions.to(input_ids.device)])

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, layer_indices: range) -> torch.Tensor:
        """hidden: [1, n, hidden] at sorted positions [n] -> the hidden states after the given layers."""
        splice = _SpliceCache(self.keys, self.values)
        splice.positions = positions
        position_ids = positions[None]
        position_embeddings = self.decoder.rotary_emb(hidden, position_ids=position_ids)
        masks: dict[int | None, torch.Tensor] = {}
        for index in layer_indices:
            window = self._sliding_window(index)
            if window not in masks:
                masks[window] = _attention_mask(positions, self.num_tokens, window, hidden.dtype)
            output = self.layers[index](
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                past_key_values=splice,
                use_cache=True,
                position_embeddings=position_embeddings,
                **engine_call_kwargs(),
            )
            hidden = output[0] if isinstance(output, tuple) else output
        return hidden

    def splice_projections(self, index: int, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Writes layer `index`'s fresh K/V for hidden [1, n, hidden] at positions [n] into the cache."""
        layer = self.layers[index]
        splice = _ProjectionOnlyCache(self.keys, self.values)
        splice.positions = positions
        position_embeddings = self.decoder.rotary_emb(hidden, position_ids=positions[None])
        try:
            layer.self_attn(
                hidden_states=layer.input_layernorm(hidden),
                position_embeddings=position_embeddings,
                attention_mask=None,
                past_key_values=splice,
            )
        except _ProjectionsSpliced:
            return
        raise AssertionError(f"layer {index} attention never called past_key_values.update")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(self.decoder.norm(hidden))

    def _sliding_window(self, index: int) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if window is None or layer_types is None:
            return window  # Mistral: one window for every layer (None: none)
        return window if layer_types[index] == "sliding_attention" else None


def _attention_mask(query_positions: torch.Tensor, num_keys: int, window: int | None, dtype) -> torch.Tensor:
    """Additive causal mask [1, 1, n, num_keys] for queries at query_positions over keys at 0..num_keys-1."""
    key_positions = torch.arange(num_keys, device=query_positions.device)
    offset = query_positions[:, None] - key_positions[None, :]  # [n, num_keys]
    allowed = offset >= 0
    if window is not None:
        allowed &= offset < window  # as transformers' sliding_window_overlay: kv > q - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
