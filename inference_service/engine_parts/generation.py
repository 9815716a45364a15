"""One row's side of decoding: pick a token, stream its text, stop on EOS, a stop string or token, the length limit or cancellation."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from inference_service.engine_parts.logprobs import token_logprobs
from inference_service.engine_parts.types import SEED_LIMIT, GenerationParams, TokenEvent
from inference_service.errors import InvalidRequest
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.sampling import make_generator, sample, suppress_tokens

OnToken = Callable[[TokenEvent], None]


@dataclass(slots=True, frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and k alternatives
    min_tokens: int = 0  # ending tokens (EOS, stop_token_ids) are suppressed before this many
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, params: GenerationParams, choice: int = 0) -> SamplingSettings:
        """A request's settings; choice i of n > 1 samples with seed + i (modulo 2**64: seeds are unsigned 64-bit,
        so the last seed's second choice is seed 0), so the choices differ."""
        seed = None if params.seed is None else (params.seed + choice) % SEED_LIMIT
        return cls(params.temperature, params.top_k, params.top_p, seed, params.logprobs, params.min_tokens,
                   params.ignore_eos, frozenset(params.stop_token_ids))

    def eos_ids(self, model_eos_ids: frozenset[int]) -> frozenset[int]:
        """The EOS ids that end this request (none with ignore_eos)."""
        return frozenset() if self.ignore_eos else model_eos_ids


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    first_token_time: float  # perf_counter when the first token was chosen (0.0 when none was)
    last_token_time: float


class NonFiniteLogits(RuntimeError):
    """A row's logits hold NaN or +inf: its K/V or the forward went wrong (INTERNAL, for that request alone)."""


def check_logits(logits: torch.Tensor, settings: SamplingSettings) -> None:
    """Checks on the host, before sampling, what no sampler can take. logits: [vocab]."""
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise NonFiniteLogits("the model produced non-finite logits for this request")
    if settings.temperature > 0:  # sample() divides float32 logits by the temperature
        scaled_max = logits.float().abs().max() / torch.tensor(settings.temperature, dtype=torch.float32)
        if not bool(torch.isfinite(scaled_max)):
            raise InvalidRequest(f"temperature {settings.temperature} is too small: the logits divided by it overflow "
                                 "float32; use 0 for greedy decoding or a larger temperature")


def pick_token(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None,
               num_generated: int, eos_ids: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [], the logits it was sampled from) for logits [vocab]; ending tokens held off before min_tokens."""
    if num_generated < settings.min_tokens:
        logits = suppress_tokens(logits, eos_ids | settings.stop_token_ids)
    return sample(logits, settings.temperature, settings.top_k, settings.top_p, generator), logits


class RowDecoder:
    """One completion's side of decoding: picks each token from its logits with the request's own sampler,
    streams its text and says when it ends. The executor drives one per running row, inside its request's guard.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, settings: SamplingSettings, eos_ids: frozenset[int],
                 max_new_tokens: int, on_token: OnToken | None, should_stop: Callable[[], bool],
                 after_first_token: Callable[[], None], tokenizer=None, device: torch.device | str = "cpu",
                 index: int = 0, approximate_tokens: int | None = None) -> None:
        """approximate_tokens: None for an exact prompt; else its content-hit tokens kept (said on the first event)."""
        self.detokenizer = detokenizer
        self.settings = settings
        self.eos_ids = settings.eos_ids(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.on_token = on_token
        self.should_stop = should_stop
        self.after_first_token = after_first_token
        self.tokenizer = tokenizer
        self.index = index  # which of the request's completions: its events carry it
        self.approximate_tokens = approximate_tokens
        self.generator = make_generator(settings.seed, device) if settings.temperature > 0 else None
        self.token_ids: list[int] = []
        self.first_time = 0.0
        self.last_time = 0.0
        self.reason = ""

    def take(self, logits: torch.Tensor, hint: tuple[bool, int] | None = None) -> int:
        """Chooses the next token from logits [vocab], streams it, and sets `reason` when the request ends.

        hint: (no NaN or +inf in the logits, their first maximum) computed for every row of a step at once
        (step_hints); a greedy choice is then taken from it without reading the logits again.
        Raises:
            InvalidRequest: the request's sampling settings turn finite logits into no distribution.
            NonFiniteLogits: the model gave NaN or infinite logits for this row.
        """
        if hint is not None and self.settings.temperature <= 0 and len(self.token_ids) >= self.settings.min_tokens:
            if not hint[0]:
                raise NonFiniteLogits("the model produced non-finite logits for this request")
            token_id, used_logits = hint[1], logits  # what greedy() picks: the first maximum
        else:
            check_logits(logits, self.settings)
            token, used_logits = pick_token(logits, self.settings, self.generator, len(self.token_ids), self.eos_ids)
            token_id = int(token)
        self.token_ids.append(token_id)
        self.last_time = time.perf_counter()
        self.first_time = self.first_time or self.last_time
        piece = self.detokenizer.add(token_id)
        if self.on_token is not None:
            logprobs = () if self.settings.logprobs is None else tuple(
                token_logprobs(self.tokenizer, used_logits.view(1, -1), [token_id], self.settings.logprobs))
            first = len(self.token_ids) == 1 and self.approximate_tokens is not None
            self.on_token(TokenEvent(piece, (token_id,), logprobs, self.index, approximate=first,
                                     approximate_tokens=self.approximate_tokens if first else 0))
        if len(self.token_ids) == 1:
            self.after_first_token()
        self.reason = finish_reason(token_id, self.detokenizer, self.eos_ids, len(self.token_ids),
                                    self.max_new_tokens, self.should_stop, self.settings.stop_token_ids)
        return token_id


    def finish(self, reason: str = "") -> DecodeResult:
        """Flushes held-back text; reason overrides the one `take` set (a request stopped from outside)."""
        rest = self.detokenizer.finish()
        if rest and self.on_token is not None:
            self.on_token(TokenEvent(rest, (), index=self.index))
        return DecodeResult(self.token_ids, self.detokenizer.text, reason or self.reason, self.first_time,
                            self.last_time)


def step_hints(logits: torch.Tensor) -> list[tuple[bool, int]]:
    """For each row of a step's logits [rows, vocab]: (no NaN or +inf in it, its first maximum), in one copy from
    the device (one synchronisation per step, not three per row)."""
    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1)
    flags, best = torch.stack([bad.long(), logits.argmax(-1)]).tolist()
    return [(not flag, token) for flag, token in zip(flags, best)]


def takes_hint(params) -> bool:
    """Whether a request's first token is the greedy one step_hints finds (RowDecoder.take then uses the hint): a
    temperature of 0 and no EOS held off before it."""
    return params.temperature <= 0 and params.min_tokens <= 0


def finish_reason(token_id: int, detokenizer: IncrementalDetokenizer, eos_ids: frozenset[int],
                  num_generated: int, max_new_tokens: int, should_stop: Callable[[], bool],
                  stop_token_ids: frozenset[int] = frozenset()) -> str:
    if token_id in eos_ids:
        return "eos"
    if detokenizer.stopped or token_id in stop_token_ids:
        return "stop"
    if num_generated >= max_new_tokens:
        return "length"
    if should_stop():
        return "cancelled"
    return ""


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The tokenizer's EOS id plus every EOS id of the model's generation config."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return frozenset(ids)
