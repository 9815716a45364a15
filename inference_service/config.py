"""The engine's configuration, declared once: each field's default, check and help, from which the service's flags,
its KVBOOST_* variables and docs/configuration.md's engine rows are generated (serving/engine_flags.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from inference_service.model.step_names import DECODE_STEPS, DEFAULT_DECODE_STEP, RETIRED_DECODE_STEPS
from inference_service.store.protocol import DEFAULT_MAX_STREAM_BYTES
from kvboost_common import catalogue
from kvboost_keys.token_cache import DEFAULT_TOKEN_CACHE_BYTES

MODES = ("baseline", "prefix_cache", "chunk_kv_reuse")
RECOMPUTE_STRATEGIES = ("none", "selective", "cacheblend")

# How a field's value becomes the one the engine runs with.
AS_GIVEN = "as given"
AUTO = "auto"  # None: decided by the engine at load, from the machine (bytes) or the device and dtype (switches)
FROM_WEIGHTS = "from the weights"  # None: the value tuned for the loaded weights (the catalogue's), chosen at load
SAME = object()  # a knob's service default when it is the library's

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Knob:
    """What one EngineConfig field declares besides its default."""

    help: str  # one text: the flag's --help and the doc row's meaning
    check: Callable[[Any], bool]
    need: str  # what check wants, said as "<field> must be <need>, got <value>"
    flag: str | None = ""  # "": the field's name with dashes; None: no flag (engines built in code only)
    resolved: str = AS_GIVEN
    service_default: Any = SAME  # the flag's default, when it differs from the library's
    why: str = ""  # why the service's default differs, or why there is no flag
    shown_default: str = ""  # the doc's default cell, when the value alone says too little
    choices: tuple = ()  # the values allowed, when they are a few (check and need then follow from them)
    accepted: tuple = ()  # further flag values, mapped to a valid one before the check (retired names)


def knob(default: Any, help: str, check: Callable[[Any], bool] | None = None, need: str = "", **more: Any) -> Any:
    """An EngineConfig field: its default, help and check (or its choices), and how the service takes it."""
    choices = more.get("choices", ())
    if choices:
        check, need = (lambda value: value in choices), "one of " + ", ".join(map(str, choices))
    if check is None or not need:
        raise TypeError("a knob needs a check and what it wants (need), or its choices")
    return field(default=default, metadata={"knob": Knob(help, check, need, **more)})


def _positive(value: Any) -> bool:
    return value > 0


def _not_negative(value: Any) -> bool:
    return value >= 0


def _bytes_or_auto(value: Any) -> bool:
    return value is None or value >= 0


def _switch(value: Any) -> bool:
    return value in (None, True, False)


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def knob_of(item: Any) -> Knob:
    return item.metadata["knob"]


class FieldError(ValueError):
    """A field's value its check refuses; the message names the field (the service's names its flag instead)."""

    def __init__(self, name: str, need: str, value: Any) -> None:
        super().__init__(self.said(name, need, value))
        self.name, self.need, self.value = name, need, value

    @staticmethod
    def said(label: str, need: str, value: Any) -> str:
        shown = "auto" if value is None else value
        return f"{label} must be {need}, got {shown}"


def check_fields(config: Any) -> None:
    """Runs every field's declared check; raises FieldError for the first refused."""
    for item in fields(config):
        declared = knob_of(item)
        value = getattr(config, item.name)
        if not declared.check(value):
            raise FieldError(item.name, declared.need, value)


def service_defaults(cls: type) -> dict[str, Any]:
    """Field name -> the service's default, for the fields whose service default differs from the library's."""
    return {item.name: knob_of(item).service_default for item in fields(cls)
            if knob_of(item).service_default is not SAME}


@dataclass(slots=True, frozen=True)
class EngineConfig:
    chunk_size: int = knob(128, "tokens per cached chunk", _positive, "positive")
    kv_cache_bits: int = knob(16, "stored K/V precision: 16 (unquantized, exact), 8, 4", choices=(4, 8, 16))
    tenant_salt: str = knob("", "isolates this tenant's cache entries", lambda value: isinstance(value, str), "text")
    max_new_tokens_limit: int = knob(4096, "largest max_new_tokens a request may ask for", _positive, "positive",
                                     flag="max-new-tokens")
    max_prompt_tokens: int = knob(0, "longest prompt accepted; 0 = the model's context", _not_negative,
                                  ">= 0 (0: the model's context)")
    default_mode: str = knob(
        "prefix_cache", "mode when a request names none (ModelInfo says it): `prefix_cache` reuses exactly (the answer "
        "is baseline's); `chunk_kv_reuse` also reuses content hits, approximately, each such answer labelled "
        "`approximate: true` — a deployment's opt-in; `baseline` no cache", choices=MODES)
    default_recompute_strategy: str = knob(
        "selective", "default repair of content hits: none, selective, cacheblend; applies in `chunk_kv_reuse` mode "
        "only (it does not opt a request in)", choices=RECOMPUTE_STRATEGIES, flag="recompute-strategy")
    recompute_ratio: float = knob(0.15, "cacheblend: share of reused tokens recomputed in the later layers",
                                  lambda value: 0.0 < value <= 1.0, "in (0, 1]")
    selective_tokens: int = knob(16, "selective: reused tokens recomputed after each seam", _not_negative, ">= 0")
    sink_tokens: int = knob(0, "reused tokens among the first N of a prompt are always recomputed", _not_negative,
                            ">= 0")
    overlap_tokens: int = knob(
        0, "the first N tokens of every reused run are recomputed with their real left context. Formerly "
        "`--overlap-k` (`KVBOOST_OVERLAP_K`), which still works, with a warning", _not_negative, ">= 0")
    check_layers: int = knob(1, "cacheblend: leading layers run on every non-exact token to measure deviation",
                             lambda value: value >= 1, ">= 1", flag=None,
                             why="a repair detail measured by bench/bench_accuracy.py, not a deployment's choice")
    guard_threshold: float | None = knob(
        0.0, "cacheblend: when the reused tokens' K/V error left unrepaired at the check layer exceeds this share, "
        "recompute every reused token (full prefill's answer); 0 = off. Unset: the threshold tuned for the loaded "
        "weights (the catalogue's, by their fingerprint; the largest that kept guarded answers within 2 points of "
        "full prefill on a development split): Qwen2.5-Coder-0.5B 9.776e-05 (held out 0.907 vs 0.927), -1.5B "
        "7.894e-05 (held out 0.990 vs 1.000), 97% of requests fallen back on both; other weights get the 0.5B's, "
        "which does not transfer well (on the 1.5B it keeps ~0.70), so tune yours with `bench/bench_accuracy.py` "
        "([engine.md](engine.md), trade-off in [benchmarks.md](benchmarks.md)); the start-up log says which",
        lambda value: value is None or (value >= 0 and value == value), "a share >= 0 (0 = off)",
        flag="fidelity-guard", resolved=FROM_WEIGHTS, service_default=None, shown_default="the loaded weights'",
        why="an engine built in code runs unguarded unless asked, so tests and benchmarks measure the repair alone")
    kv_group_size: int = knob(
        0, "quantization group at 8 and 4 bits (tokens per key scale, channels per value scale); 0 = 64 at 8 bits, "
        "128 at 4", lambda value: 0 <= value <= 65535, "in 0..65535")
    kv_keys_before_rope: bool = knob(
        False, "at 8 and 4 bits, quantize keys with RoPE undone and redo it on every hit (see Quantized storage): on "
        "SmolLM2/CPU int8 KL fell only 8%, int4 KL rose 25% and every prefix hit of 1536 tokens took ~45 ms longer, "
        "so it is off by default; ignored at 16 bits and for RoPE that cannot be moved", _bool, "true or false")
    max_running_requests: int = knob(
        16, "requests prefilling or decoding at once; more wait. A request with n completions counts once and decodes "
        "as n rows, one K/V slot each (slots: max(this, 16) plus max(4, this/2) spares, so one request's 16 "
        "completions never hold every place). `1`: one request at a time", _positive, "positive")
    kv_cache_bytes: int | None = knob(
        None, "K/V memory the running requests may reserve: each reserves prompt + max_new_tokens per row at "
        "admission, so nothing runs out mid-decode; one that does not fit waits, one that could never fit is "
        "INVALID_ARGUMENT. `auto` (`inference_service/kv_memory/memory_plan.py`): on CUDA half of the device's free "
        "memory after the weights less a reserve for activations and the lazily captured graphs (a tenth of the "
        "device, at least 2 GiB), or all of it less `--l0-bytes` when that is a number; on a CPU a quarter of the RAM "
        "available at start (MemAvailable). A number wins. Auto slots that would get under 64 MiB refuse to start, "
        "saying what to set. The start-up log says the bytes and tokens each tier holds (SmolLM2 fp32: 46,080 bytes "
        "per token)", lambda value: value is None or value > 0, "positive or auto", resolved=AUTO)
    max_prefill_tokens: int = knob(
        0, "prompt tokens prefilled between two decode steps: a long prompt runs in pieces while others decode; short "
        "prompts are batched in forwards of 128 tokens on a CPU, 2048 on a GPU", _not_negative, ">= 0 (0: by device)",
        shown_default="`0` (by device: 512 on a CPU, 8192 on a GPU)")
    max_forward_tokens: int = knob(0, "prompt tokens of short prefills batched in one forward; 0: by device",
                                   _not_negative, ">= 0 (0: by device)", flag=None,
                                   why="follows the device (engine/scheduler.device_limits); set in code to measure")
    max_queue: int = knob(64, "requests waiting to be admitted to the step loop before RESOURCE_EXHAUSTED",
                          _positive, "positive")
    max_answer_tokens_stored: int = knob(
        1024, "generated tokens whose K/V are written back with the prompt's tail when a request ends (first "
        "completion), so a conversation's next turn recomputes only its new message; 0 = answers are not stored",
        _not_negative, ">= 0")
    decode_step: str = knob(
        DEFAULT_DECODE_STEP, "`lean`: the model's own ops in one layer loop without transformers' per-call overhead "
        "(scripted on a CPU, replayed from CUDA graphs on a GPU), bitwise its forward (checked at start-up, else the "
        "model's forward runs, logged); `transformers`: the model's forward. The retired `split`, `wide` and `onednn` "
        "run `lean`, with a warning (their figures: docs/performance.md)", choices=DECODE_STEPS,
        accepted=tuple(RETIRED_DECODE_STEPS))
    max_store_stream_bytes: int = knob(
        DEFAULT_MAX_STREAM_BYTES, "blob bytes per Store stream: a larger write-back or Warm goes out as several "
        "streams, encoded as it goes (never all in memory); keep it at or below the daemon's `--max-store-bytes` "
        "(default: its `--max-bytes`)", lambda value: value >= 1 << 20, "at least 1048576",
        flag="cache-max-stream-bytes", shown_default="`268435456` (256 MiB)")
    kv_slots_by_budget: bool | None = knob(
        None, "slots sized so that their memory stays within kv_cache_bytes (kv_memory/slot_ledger.plan_slots); None: on "
        "devices that commit memory at allocation (CUDA), not on a CPU (pages committed as written)", _switch,
        "true, false or None (auto)", flag=None, resolved=AUTO, why="follows the device; set in code to measure")
    l0_bytes: int | None = knob(
        None, "L0, the service's own tier: K/V of the chunks this process wrote back (kept before the daemon has "
        "them) or fetched, in its own memory (the GPU's on CUDA). A prefix it holds is copied into the slot in a few "
        "batched copies, without a daemon read, checksum or decoding, and a prompt asked again while its write-back "
        "is in flight does not wait for it. It also answers for chunks the daemon evicted for its budget, as long as "
        "no Delete reached the daemon since it last confirmed them (the Lookup's delete epoch). Evicted leaf first: a "
        "chunk leaves after every held chunk that continues it, so a prefix is never stranded and a prompt longer than L0 keeps its head (placed from its first chunk as "
        "far as L0 holds it); among leaves, hit frequency decayed with a one-hour half-life, as the daemon's LFU. "
        "`auto`: on CUDA what the device has free after the weights, the reserve and the K/V slots (half of it when "
        "both are auto); on a CPU a quarter of the RAM available at start (six 2k-token SmolLM2 documents, ~566 MB "
        "in fp32, fit on a machine with 3 GiB available). Exact: 16-bit storage only (off at `--kv-cache-bits` 8 and "
        "4, and without `--cache-addr`). Stats and `/metrics`: `l0_chunks_hit`, `l0_bytes_placed`, `l0_bytes_held`; "
        "`/metrics` also `kvboost_engine_l0_chunks_rejected`, `kvboost_engine_l0_chunks_alone` and per tier "
        "`kvboost_engine_tier_{chunks,bytes,seconds,loads}{tier=\"l0\"|\"daemon_map\"|\"daemon_fetch\"}`. 0 = off",
        _bytes_or_auto, ">= 0 (0 = off) or auto", resolved=AUTO)
    host_tier_bytes: int | None = knob(
        0, "The host tier, under L0 on CUDA (`inference_service/kv_memory/host_tier.py`): whole chunks' K/V in one host "
        "region, registered with CUDA once (`cudaHostRegister`: page-locked, so the copy engine reads it directly; "
        "not torch's pinned allocator, which rounds sizes up to a power of two), in slabs of one chunk. Filled by "
        "chunks leaving L0 (copied off the device on a side stream, never in a decode step's way) and by chunks "
        "fetched from the daemon (checked once, on the way in: no second checksum). Placement order: L0, host tier, "
        "daemon (co-located map or Fetch), L2 through the daemon; adjacent slabs go to the device in one DMA, then "
        "into the slot by one strided copy per buffer; a slab is refilled only after the event recorded behind its "
        "last copy out. It places only keys the daemon's Lookup confirmed or L0 answered for alone (the delete epoch), "
        "so a Delete or a namespace drop at the daemon reaches it. Evicted leaf first by decayed frequency, as L0 (a "
        "chunk whose parent L0 holds is no orphan). `auto`: on CUDA a quarter of the RAM available at start (less what L0 takes of host memory), at "
        "most 64 GiB (pinned pages never swap, and pinning hundreds of GiB takes long); on a CPU off (L0 already is "
        "host memory). A number wins; the start-up log says its bytes and tokens. Pinning that fails falls back to "
        "pageable memory, said in one log line. 16-bit storage only. Stats and `/metrics`: `host_chunks_hit`, "
        "`host_bytes_held`, `host_chunks_held`, `host_chunks_evicted`, and `kvboost_engine_tier_*{tier=\"host\"}`. "
        "0 = off", _bytes_or_auto, ">= 0 (0 = off) or auto", resolved=AUTO, service_default=None,
        why="a process building several engines (tests, benchmarks) pins no host memory it did not ask for")
    recompute_when_faster: bool | None = knob(
        None, "each request loads its cached run, a prefix of it (by tier) or none of it, whichever is predicted "
        "faster by this process's cost lines (`inference_service/reuse/load_choice.py`: prefill and each tier's load "
        "as a fixed cost plus a cost per token or byte, measured at start-up on the served model's shapes and "
        "refitted by every request; a tier skipped for 30 s is loaded once to be measured again); below the "
        "break-even length the daemon is asked for no bytes. See [the engine](engine.md#never-slower-than-recompute). "
        "`/metrics`: `kvboost_engine_loads_skipped`, `kvboost_engine_load_skipped_tokens`, "
        "`kvboost_engine_load_probes`. `auto`: on with CUDA, off on a CPU (loading beats prefill by far there for "
        "real models); `on`, `off`", _switch, "auto, on or off", resolved=AUTO)
    tokenizer_cache_bytes: int = knob(
        DEFAULT_TOKEN_CACHE_BYTES, "token ids of long prompt pieces kept in memory (4 bytes a token): the text "
        "between two special tokens (a chat message, a segment) of 256 characters or more is tokenized once and its "
        "ids reused, least recently used dropped first. Exact: the tokenizer's own ids; keyed by the request's "
        "namespace, so tenants and tokenizers never share an entry. A tokenizer that strips around its special "
        "tokens is tokenized whole (said at start). 0 = off", _not_negative, ">= 0 (0 = off)",
        shown_default="`67108864` (64 MiB)")
    invariant_prefill: bool = knob(
        False, "every prefill forward is one whole chunk of rows at chunk-aligned positions (the prompt's last chunk "
        "padded), so cached answers are bitwise the uncached ones in bf16 and fp16 too (16-bit storage); smaller "
        "forwards cost prefill time; answers are not stored; its chunks are stored apart from the default prefill's; "
        "refused for models with sliding-window layers or a dynamic RoPE ([engine.md](engine.md#invariant-prefill))",
        _bool, "true or false")
    invariant_piece_chunks: int = knob(
        1, "with `--invariant-prefill`: whole chunks per prefill forward, at positions aligned to as many (stored "
        "chunks keep `--chunk-size`). More read the weights fewer times (a GPU's cost for a long uncached prompt) but "
        "recompute up to that many chunks after a cached run and pad the last piece; each value has its own "
        "namespace ([engine.md](engine.md#invariant-prefill))", lambda value: value >= 1,
        ">= 1 (whole chunks per invariant prefill forward)")
    invariant_decode: bool | None = knob(
        None, "with `--invariant-prefill`: decode steps whose rows do not depend on the rows beside them (every slot "
        "a row, attention in fixed blocks), so a request's tokens are the same alone or batched; `auto`: on CUDA in "
        "bf16/fp16 only (on a CPU the padded step costs several times a step; in fp32 the default step already gives "
        "`model.generate`'s tokens) ([engine.md](engine.md#invariant-prefill))", _switch, "auto, on or off",
        resolved=AUTO)

    @property
    def invariant_piece_tokens(self) -> int:
        """Tokens of one invariant prefill forward (chunk_size x invariant_piece_chunks); 1 without it."""
        return self.chunk_size * self.invariant_piece_chunks if self.invariant_prefill else 1

    @property
    def keys_before_rope(self) -> bool:
        return self.kv_keys_before_rope and self.kv_cache_bits != 16

    def __post_init__(self) -> None:
        check_fields(self)
        if self.invariant_decode and not self.invariant_prefill:
            raise ValueError("invariant_decode (--invariant-decode on) is part of the invariant path: turn on "
                             "invariant_prefill (--invariant-prefill) too (a decode step alone cannot make an answer "
                             "independent of the cache)")


def resolve_guard_threshold(config: EngineConfig, weights_id: str) -> EngineConfig:
    """The config with guard_threshold chosen when it is None: the threshold tuned for these weights (the catalogue's),
    else the catalogue's default; logged either way."""
    if config.guard_threshold is not None:
        logger.info("fidelity guard %g (as configured: --fidelity-guard)", config.guard_threshold)
        return config
    threshold, source = catalogue.guard_threshold_for(weights_id)
    logger.info("fidelity guard %g (%s; --fidelity-guard sets another, 0 turns it off)", threshold, source)
    return replace(config, guard_threshold=threshold)
