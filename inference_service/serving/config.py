"""The inference service's configuration: one dataclass filled from CLI flags with KVBOOST_* environment defaults."""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from inference_service.request.types import MODES, RECOMPUTE_STRATEGIES
from inference_service.model.step_names import (DECODE_STEPS, DEFAULT_DECODE_STEP, RETIRED_DECODE_STEPS,
                                                 current_decode_step)
from inference_service.model.weights import DEFAULT_MODEL
from inference_service.mkl_dispatch import CHOICES as MKL_DISPATCHES
from inference_service.store.colocated import LOCAL_READ_MODES
from inference_service.store.protocol import DEFAULT_MAX_STREAM_BYTES
from kvboost_common import catalogue
from kvboost_common.addresses import check_listen_address, is_local, is_unix, split_host_port
from kvboost_common.auth import load_token
from kvboost_common.kv_events.endpoints import zmq_endpoint
from kvboost_common.env_defaults import add_renamed_flags, apply_renamed_flags, env_default_reader

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_CACHE_ADDR = "127.0.0.1:50052"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SWITCHES = ("auto", "on", "off")
# Flags that are gone, with what replaced them: a config that still names one fails at start-up with this.
REMOVED_FLAGS = {
    "scheduler": "--scheduler was removed: every request runs on the one step loop (one request at a time is "
                 "--max-running-requests 1)",
    "max_batch_tokens": "--max-batch-tokens was replaced by --kv-cache-bytes: the K/V memory running requests may "
                        "reserve, in bytes (prompt + max_new_tokens per row)",
}
# Flags that were renamed, old -> new (dests): the old flag and variable still work, with a warning (env_defaults).
RENAMED_FLAGS = {"overlap_k": "overlap_tokens"}


@dataclass(slots=True, frozen=True)
class ServiceConfig:
    model: str = DEFAULT_MODEL
    cache_addr: str = DEFAULT_CACHE_ADDR  # empty: no daemon, every request runs without the cache
    listen: str = DEFAULT_LISTEN
    device: str = "auto"  # auto: cuda when present, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    threads: int = 0  # torch intra-op threads; 0: torch's default (the machine's cores)
    decode_step: str = DEFAULT_DECODE_STEP  # lean (bitwise the model's forward, faster) or transformers
    mkl_dispatch: str = "auto"  # MKL's kernels by instruction set (features) or by CPU vendor; set before torch loads
    chunk_size: int = 128
    kv_cache_bits: int = 16
    tenant_salt: str = ""
    strict: bool = True  # refuse architectures whose K/V cannot be reused correctly
    default_mode: str = "prefix_cache"  # exact; chunk_kv_reuse (content hits, approximate, labelled) is opt-in
    recompute_strategy: str = "selective"
    recompute_ratio: float = 0.15
    selective_tokens: int = 16
    sink_tokens: int = 0
    overlap_tokens: int = 0
    # --fidelity-guard; 0: off; None: the threshold tuned for the loaded weights (the catalogue's, by their
    # fingerprint), else catalogue.DEFAULT_GUARD_THRESHOLD (bench_accuracy.py, docs/benchmarks.md).
    guard_threshold: float | None = None
    kv_group_size: int = 0  # 0: the codec's default for the bits (64 at 8 bits, 128 at 4)
    kv_keys_before_rope: bool = False  # at 8 and 4 bits, quantize keys un-rotated (opt-in: see --help)
    max_queue: int = 64  # requests waiting for the model worker before RESOURCE_EXHAUSTED
    max_running_requests: int = 16  # requests running at once (one with n completions decodes as n rows)
    # K/V memory reserved by running requests (prompt + max_new_tokens per row); None: auto (engine/memory_plan.py)
    kv_cache_bytes: int | None = None
    l0_bytes: int | None = None  # L0: decoded K/V of whole chunks in the service's memory; 0 = off; None: auto
    host_tier_bytes: int | None = None  # pinned host tier under L0 (CUDA); 0 = off; None: auto (off on a CPU)
    recompute_when_faster: str = "auto"  # recompute cached K/V that would load slower than prefill; auto: on CUDA
    tokenizer_cache_bytes: int = 64 << 20  # token ids of long prompt pieces kept (kvboost_keys/token_cache.py); 0 = off
    invariant_prefill: bool = False  # every prefill forward one whole chunk: cached answers bitwise in bf16 too
    invariant_piece_chunks: int = 1  # with invariant_prefill: whole chunks per prefill forward (fewer weight reads)
    invariant_decode: str = "auto"  # with invariant_prefill: decode rows independent of their neighbours; auto: CUDA half
    max_prefill_tokens: int = 0  # prompt tokens prefilled between two decode steps; 0: by device
    metrics_port: int = 0  # Prometheus /metrics HTTP port on the listen host; 0 = off
    max_answer_tokens_stored: int = 1024  # generated tokens written back per request (the next turn reuses them)
    max_new_tokens: int = 4096
    max_prompt_tokens: int = 0  # 0: the model's context length
    max_message_bytes: int = 64 << 20  # largest gRPC message received or sent
    max_concurrent_streams: int = 0  # RPCs in flight per client connection (more wait); 0 = gRPC's default
    auth_token_file: str = ""  # clients must send `authorization: Bearer <token>`
    tls_cert: str = ""
    tls_key: str = ""
    cache_auth_token_file: str = ""
    cache_tls: bool = False
    cache_tls_ca: str = ""  # PEM roots for the daemon's certificate; empty: the system roots
    cache_timeout_s: float = 1.0  # Lookup deadline; reconnect probe interval
    cache_stream_timeout_s: float = 10.0  # a Fetch stream's deadline; a Store stream's fixed part (+ bytes / 16 MB/s)
    cache_max_stream_bytes: int = DEFAULT_MAX_STREAM_BYTES  # blob bytes per Store stream of a write-back or warm-up
    cache_local_read: str = "auto"  # read blobs from the daemon's LMDB on this host: auto, on or off
    # KV events in vLLM's format for vllm-router, llm-d and Dynamo (kvboost_common/kv_events); empty: off
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_block_size: int = 16  # vllm-router's --kv-event-block-size default
    kv_events_publish_salted: bool = False  # announce chunks stored under a cache_salt or --tenant-salt too
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        _require(self.model != "", "--model is empty")
        try:
            check_listen_address(self.listen)
        except ValueError:
            raise ValueError(f"--listen must be HOST:PORT or unix:PATH, got {self.listen!r}") from None
        _require(self.device in DEVICES or self.device.startswith("cuda:"), f"--device must be one of {DEVICES} or cuda:N, got {self.device!r}")
        _require(self.invariant_piece_chunks >= 1,
                 f"--invariant-piece-chunks must be >= 1 (whole chunks per invariant prefill forward), got "
                 f"{self.invariant_piece_chunks}")
        _require(self.dtype in DTYPES, f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.threads >= 0, f"--threads must be >= 0 (0: torch's default), got {self.threads}")
        _require(self.mkl_dispatch in MKL_DISPATCHES,
                 f"--mkl-dispatch must be one of {MKL_DISPATCHES}, got {self.mkl_dispatch!r}")
        _require(self.decode_step in DECODE_STEPS, f"--decode-step must be one of {DECODE_STEPS}, got {self.decode_step!r}")
        _require(self.chunk_size > 0, f"--chunk-size must be positive, got {self.chunk_size}")
        _require(self.kv_cache_bits in (4, 8, 16), f"--kv-cache-bits must be 4, 8 or 16, got {self.kv_cache_bits}")
        _require(self.default_mode in MODES, f"--default-mode must be one of {MODES}, got {self.default_mode!r}")
        _require(self.recompute_strategy in RECOMPUTE_STRATEGIES, f"--recompute-strategy must be one of {RECOMPUTE_STRATEGIES}, got {self.recompute_strategy!r}")
        _require(0.0 < self.recompute_ratio <= 1.0, f"--recompute-ratio must be in (0, 1], got {self.recompute_ratio}")
        _require(self.selective_tokens >= 0, f"--selective-tokens must be >= 0, got {self.selective_tokens}")
        _require(self.sink_tokens >= 0, f"--sink-tokens must be >= 0, got {self.sink_tokens}")
        _require(self.overlap_tokens >= 0, f"--overlap-tokens must be >= 0, got {self.overlap_tokens}")
        _require(self.guard_threshold is None or (self.guard_threshold >= 0
                                                  and self.guard_threshold == self.guard_threshold),
                 f"--fidelity-guard must be a share >= 0 (0 = off), got {self.guard_threshold}")
        _require(0 <= self.kv_group_size <= 65535, f"--kv-group-size must be in 0..65535, got {self.kv_group_size}")
        _require(self.max_queue > 0, f"--max-queue must be positive, got {self.max_queue}")
        _require(self.max_running_requests > 0, f"--max-running-requests must be positive, got {self.max_running_requests}")
        _require(self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
                 f"--kv-cache-bytes must be positive or auto, got {self.kv_cache_bytes}")
        _require(self.tokenizer_cache_bytes >= 0,
                 f"--tokenizer-cache-bytes must be >= 0 (0 = off), got {self.tokenizer_cache_bytes}")
        _require(self.l0_bytes is None or self.l0_bytes >= 0,
                 f"--l0-bytes must be >= 0 (0 = off) or auto, got {self.l0_bytes}")
        _require(self.host_tier_bytes is None or self.host_tier_bytes >= 0,
                 f"--host-tier-bytes must be >= 0 (0 = off) or auto, got {self.host_tier_bytes}")
        _require(self.invariant_decode in SWITCHES,
                 f"--invariant-decode must be one of {SWITCHES}, got {self.invariant_decode!r}")
        _require(self.invariant_decode != "on" or self.invariant_prefill,
                 "--invariant-decode on is part of the invariant path: add --invariant-prefill")
        _require(self.recompute_when_faster in SWITCHES,
                 f"--recompute-when-faster must be one of {SWITCHES}, got {self.recompute_when_faster!r}")
        _require(0 <= self.metrics_port < 65536, f"--metrics-port out of range: {self.metrics_port}")
        _require(self.max_answer_tokens_stored >= 0,
                 f"--max-answer-tokens-stored must be >= 0, got {self.max_answer_tokens_stored}")
        _require(self.max_prefill_tokens >= 0, f"--max-prefill-tokens must be >= 0 (0: by device), got {self.max_prefill_tokens}")
        _require(self.max_new_tokens > 0, f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        _require(self.max_message_bytes >= 1 << 20, f"--max-message-bytes must be at least 1048576, got {self.max_message_bytes}")
        _require(self.max_concurrent_streams >= 0, f"--max-concurrent-streams must be >= 0, got {self.max_concurrent_streams}")
        _require(self.max_prompt_tokens >= 0, f"--max-prompt-tokens must be >= 0, got {self.max_prompt_tokens}")
        _require(bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key go together")
        _require(self.cache_timeout_s > 0, f"--cache-timeout must be positive, got {self.cache_timeout_s}")
        _require(self.cache_stream_timeout_s > 0,
                 f"--cache-stream-timeout must be positive, got {self.cache_stream_timeout_s}")
        _require(self.cache_max_stream_bytes >= 1 << 20,
                 f"--cache-max-stream-bytes must be at least 1048576, got {self.cache_max_stream_bytes}")
        _require(self.kv_events_block_size > 0,
                 f"--kv-events-block-size must be positive, got {self.kv_events_block_size}")
        for flag, value in (("--kv-events-endpoint", self.kv_events_endpoint),
                            ("--kv-events-replay-endpoint", self.kv_events_replay_endpoint)):
            try:
                value and zmq_endpoint(value)
            except ValueError as error:
                raise ValueError(f"{flag}: {error}") from None
        _require(not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint),
                 "--kv-events-replay-endpoint needs --kv-events-endpoint")
        _require(self.cache_local_read in LOCAL_READ_MODES,
                 f"--cache-local-read must be one of {LOCAL_READ_MODES}, got {self.cache_local_read!r}")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def host(self) -> str:
        """The listen host; loopback for a unix socket (where the metrics port then listens)."""
        return "127.0.0.1" if is_unix(self.listen) else split_host_port(self.listen)[0]

    @property
    def listens_on_loopback(self) -> bool:
        return is_local(self.listen)

    def auth_token(self) -> str | None:
        return read_secret(self.auth_token_file)

    def cache_auth_token(self) -> str | None:
        return read_secret(self.cache_auth_token_file)

    def describe(self) -> str:
        """One line per setting for the start-up log (secrets appear as file paths only)."""
        auto = {"kv_cache_bytes", "l0_bytes", "host_tier_bytes"}  # None there means sized from the machine at start
        return "\n".join(f"  {name} = {'auto' if value is None and name in auto else repr(value)}"
                         for name, value in asdict(self).items())


def read_secret(path: str) -> str | None:
    """The stripped contents of a token file; None when no file is configured."""
    return load_token(path) if path else None


def bytes_or_auto(text: str) -> int | None:
    """A byte count, or None for 'auto' (sized from the machine at start)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a number of bytes nor auto") from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _tuned_guards() -> str:
    return ", ".join(f"{entry.name} {entry.guard_threshold:g}" for entry in catalogue.CATALOGUE
                     if entry.guard_threshold is not None)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    defaults = ServiceConfig()
    default = env_default_reader(environ)

    parser = argparse.ArgumentParser(
        prog="python -m inference_service",
        description="KVBoost inference service: generation with chunk K/V reuse through the cache daemon. "
                    "Every flag defaults to the KVBOOST_<NAME> environment variable when it is set.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default=default("MODEL", defaults.model), help="a catalogue name (SmolLM2-135M-Instruct, the embedded default; qwen2.5-coder-0.5b, qwen2.5-coder-1.5b after `make model MODEL=NAME`), a .gguf file (converted once) or a local HF folder (KVBOOST_MODEL). The cache namespace follows the weights' fingerprint, not this name")
    add("--cache-addr", default=default("CACHE_ADDR", defaults.cache_addr), help="cache daemon HOST:PORT or unix:PATH; empty runs without a cache (KVBOOST_CACHE_ADDR)")
    add("--listen", default=default("LISTEN", defaults.listen), help="HOST:PORT to serve on, or unix:PATH for a socket on this host (KVBOOST_LISTEN)")
    add("--device", default=default("DEVICE", defaults.device), help="auto, cpu, cuda or cuda:N (KVBOOST_DEVICE)")
    add("--dtype", default=default("DTYPE", defaults.dtype), choices=DTYPES, help="weights and K/V dtype (KVBOOST_DTYPE)")
    add("--threads", type=int, default=default("THREADS", defaults.threads),
        help="torch intra-op CPU threads for the model; 0 keeps torch's default (one per core). On a machine whose "
             "cores other processes also use, fewer threads than cores avoids threads waiting on each other "
             "(docs/performance.md) (KVBOOST_THREADS)")
    add("--mkl-dispatch", default=default("MKL_DISPATCH", defaults.mkl_dispatch), choices=MKL_DISPATCHES,
        help="which of MKL's kernels torch's float32 products run: MKL picks by CPU vendor and gives non-Intel "
             "x86 CPUs generic kernels (3.5x slower one-row products on an AMD EPYC); features = pick by "
             "instruction set as on Intel (a tiny library compiled once with cc, loaded before torch); "
             "vendor = MKL's own choice; auto = features on a non-Intel x86-64 Linux CPU. Greedy output stays "
             "identical to model.generate under the same dispatch (docs/performance.md) (KVBOOST_MKL_DISPATCH)")
    add("--decode-step", default=default("DECODE_STEP", defaults.decode_step),
        choices=DECODE_STEPS + tuple(RETIRED_DECODE_STEPS), metavar="{" + ",".join(DECODE_STEPS) + "}",
        help="how each batched decode step runs: lean (default) = the model's own ops in one layer loop without "
             "transformers' per-call overhead (scripted on a CPU, replayed from CUDA graphs on a GPU), bitwise its "
             "forward (checked at start-up; the model's forward runs where it is not); transformers = the model's "
             "own forward. The retired split, wide and onednn run lean, with a warning (KVBOOST_DECODE_STEP)")
    add("--chunk-size", type=int, default=default("CHUNK_SIZE", defaults.chunk_size), help="tokens per cached chunk (KVBOOST_CHUNK_SIZE)")
    add("--kv-cache-bits", type=int, default=default("KV_CACHE_BITS", defaults.kv_cache_bits), choices=(4, 8, 16), help="stored K/V precision (KVBOOST_KV_CACHE_BITS)")
    add("--tenant-salt", default=default("TENANT_SALT", defaults.tenant_salt), help="isolates this service's cache entries from other tenants (KVBOOST_TENANT_SALT)")
    add("--no-strict", dest="strict", action="store_false", default=not default("NO_STRICT", False), help="try unsupported architectures anyway (KVBOOST_NO_STRICT=1; strict check now: %(default)s)")
    add("--default-mode", default=default("DEFAULT_MODE", defaults.default_mode), choices=MODES, help="mode for requests that name none (KVBOOST_DEFAULT_MODE). prefix_cache (default): exact reuse only, the same answer as baseline; chunk_kv_reuse: also reuses content hits (chunks stored under another prefix), repaired by --recompute-strategy: faster on reordered documents but APPROXIMATE, each such answer says approximate: true; baseline: no cache")
    add("--recompute-strategy", default=default("RECOMPUTE_STRATEGY", defaults.recompute_strategy), choices=RECOMPUTE_STRATEGIES, help="default repair of content hits, in chunk_kv_reuse mode only (a request or --default-mode opts into it; this flag alone does not) (KVBOOST_RECOMPUTE_STRATEGY)")
    add("--recompute-ratio", type=float, default=default("RECOMPUTE_RATIO", defaults.recompute_ratio), help="cacheblend: share of content-hit tokens recomputed in the later layers, (0, 1] (KVBOOST_RECOMPUTE_RATIO)")
    add("--selective-tokens", type=int, default=default("SELECTIVE_TOKENS", defaults.selective_tokens), help="selective: content-hit tokens recomputed after each seam (KVBOOST_SELECTIVE_TOKENS)")
    add("--sink-tokens", type=int, default=default("SINK_TOKENS", defaults.sink_tokens), help="selective, cacheblend: content-hit tokens among the first N of a prompt are always recomputed (KVBOOST_SINK_TOKENS)")
    add("--fidelity-guard", dest="guard_threshold", type=float, default=default("FIDELITY_GUARD", defaults.guard_threshold, float), help="cacheblend: when the content hits' K/V error left unrepaired at the check layer exceeds this share, recompute every content-hit token (the answer is then full prefill's); 0 = off; "
        f"unset: the threshold tuned for the loaded weights ({_tuned_guards()}: the largest that kept guarded answers within 2 points of full prefill on a development split), else {catalogue.DEFAULT_GUARD_THRESHOLD:g}; the start-up log says which. docs/benchmarks.md has the measured trade-off (KVBOOST_FIDELITY_GUARD)")
    add("--overlap-tokens", type=int, default=default("OVERLAP_TOKENS", defaults.overlap_tokens), help="the first N tokens of every content-hit run are recomputed with their real left context, whatever the strategy; formerly --overlap-k (KVBOOST_OVERLAP_TOKENS)")
    add("--kv-group-size", type=int, default=default("KV_GROUP_SIZE", defaults.kv_group_size), help="quantization group at 8 and 4 bits: tokens per key scale, channels per value scale; 0 picks 64 at 8 bits, 128 at 4 (KVBOOST_KV_GROUP_SIZE)")
    add("--kv-keys-before-rope", action=argparse.BooleanOptionalAction,
        default=default("KV_KEYS_BEFORE_ROPE", defaults.kv_keys_before_rope),
        help="at 8 and 4 bits, store keys un-rotated (RoPE undone at write-back, redone on every hit): less key "
             "error, but on SmolLM2/CPU int8 KL fell only 8%%, int4 KL rose 25%% and every prefix hit of 1536 "
             "tokens took ~45 ms longer, so it is off by default; models whose RoPE cannot be moved always store "
             "keys as computed (KVBOOST_KV_KEYS_BEFORE_ROPE=1)")
    add("--max-queue", type=int, default=default("MAX_QUEUE", defaults.max_queue), help="requests waiting for the model before RESOURCE_EXHAUSTED (KVBOOST_MAX_QUEUE)")
    add("--max-running-requests", type=int, default=default("MAX_RUNNING_REQUESTS", defaults.max_running_requests), help="requests prefilling or decoding at once; more wait. A request with n completions counts once and decodes as n rows, one K/V slot each (the slots: max(this, 16) plus spares) (KVBOOST_MAX_RUNNING_REQUESTS)")
    add("--kv-cache-bytes", type=_bytes_flag, default=default("KV_CACHE_BYTES", "auto", str), help="K/V memory the running requests may reserve, in bytes: each reserves prompt + max_new_tokens per row when it is admitted, so nothing runs out mid-decode; a request that does not fit waits, one that could never fit is INVALID_ARGUMENT. auto: on CUDA half of the device's free memory after the weights less a reserve for activations and captured graphs (a tenth of the device, at least 2 GiB), or all of it less --l0-bytes when that is a number; on a CPU a quarter of the RAM available at start. The start-up log says the bytes and tokens chosen (KVBOOST_KV_CACHE_BYTES)")
    add("--l0-bytes", type=_bytes_flag, default=default("L0_BYTES", "auto", str), help="L0, the service's own cache tier: K/V of the chunks this process wrote back (kept before the daemon has them) or fetched, in this process's memory (the GPU's on CUDA); a prefix it holds is copied into place without a daemon read, checksum or decoding, and a prompt asked again while its write-back is in flight does not wait for it. Evicted leaf first (a chunk leaves after every chunk that continues it, so a prefix is never stranded; a prompt longer than L0 keeps its head), by hit frequency decayed over an hour, as the daemon's LFU. Exact (16-bit storage only; off at --kv-cache-bits 8 and 4). auto: on CUDA what the device has free after the weights, the reserve and the K/V slots; on a CPU a quarter of the RAM available at start. 0 = off (KVBOOST_L0_BYTES)")
    add("--host-tier-bytes", type=_bytes_flag, default=default("HOST_TIER_BYTES", "auto", str), help="the host tier, under L0 on CUDA: whole chunks' K/V in one pinned (registered) host region in slabs of a chunk, filled by chunks leaving L0 (copied off the device on a side stream) and by chunks fetched from the daemon (checked once, on the way in); a prefix it holds is copied from the slabs straight into the slot. Placement order: L0, host tier, daemon; its hits are confirmed by the daemon's Lookup, as L0's. auto: on CUDA a quarter of the RAM available at start (less what L0 takes of host memory), at most 64 GiB; on a CPU off (L0 already is host memory). 16-bit storage only. 0 = off (KVBOOST_HOST_TIER_BYTES)")
    add("--tokenizer-cache-bytes", type=int, default=default("TOKENIZER_CACHE_BYTES", defaults.tokenizer_cache_bytes), help="token ids of long pieces of prompt text kept in memory, in bytes (4 a token): the text between two special tokens (a chat message, a segment) of 256 characters or more is tokenized once and its ids reused, least recently used dropped first. Exact: the same ids as the tokenizer (its own splitting at special tokens); keyed by the request's namespace, so tenants and tokenizers never share an entry. A tokenizer that strips around its special tokens is tokenized whole (said at start). 0 = off (KVBOOST_TOKENIZER_CACHE_BYTES)")
    add("--invariant-prefill", action=argparse.BooleanOptionalAction, default=default("INVARIANT_PREFILL", defaults.invariant_prefill), help="every prefill forward runs one whole chunk of rows at chunk-aligned positions (the prompt's last chunk padded), so a chunk's K/V do not depend on how its prompt was cut or what was cached: cached answers are bitwise the uncached ones in bf16 and fp16 as well, where products round by their rows (with 16-bit storage; on a CPU in fp32 the default prefill already gives model.generate's tokens). Costs smaller forwards; answers are not stored for the next turn (their K/V come from decode steps); its chunks are stored apart from the default prefill's; refused for sliding-window layers and dynamic RoPE (docs/engine.md, Invariant prefill) (KVBOOST_INVARIANT_PREFILL)")
    add("--invariant-piece-chunks", type=int, default=default("INVARIANT_PIECE_CHUNKS", defaults.invariant_piece_chunks), help="with --invariant-prefill: whole chunks per prefill forward, at positions aligned to as many (the stored chunks keep --chunk-size). More chunks read the weights fewer times (a GPU's cost of a long uncached prompt), but recompute up to that many chunks after a cached run and pad the last piece to its end; each value keeps its own namespace (KVBOOST_INVARIANT_PIECE_CHUNKS)")
    add("--invariant-decode", default=default("INVARIANT_DECODE", defaults.invariant_decode), choices=SWITCHES, help="with --invariant-prefill: decode steps whose rows do not depend on the rows beside them (every slot runs as a row, attention in fixed blocks), so a request's tokens are the same alone or batched; auto: on CUDA in bf16/fp16 (on a CPU the padded step costs several times a step; in fp32 the default step already gives model.generate's tokens) (KVBOOST_INVARIANT_DECODE)")
    add("--recompute-when-faster", default=default("RECOMPUTE_WHEN_FASTER", defaults.recompute_when_faster), choices=SWITCHES, help="each request loads its cached run, a prefix of it (L0's and the host tier's chunks, say) or none of it, whichever this process predicts faster: prefill and each tier's load are lines with a fixed cost (measured at start-up on the served model's shapes, then refitted by every request; a tier skipped for 30 s is loaded once to be measured again), so a run below the break-even length asks the daemon for no bytes; /metrics counts kvboost_engine_loads_skipped, _load_skipped_tokens and _load_probes. auto: on with CUDA, off on a CPU, where loading beats prefill by far for real models (KVBOOST_RECOMPUTE_WHEN_FASTER)")
    add("--max-prefill-tokens", type=int, default=default("MAX_PREFILL_TOKENS", defaults.max_prefill_tokens), help="prompt tokens prefilled between two decode steps: a long prompt runs in pieces while others decode; 0 (default): by device, 512 on a CPU, 8192 on a GPU (KVBOOST_MAX_PREFILL_TOKENS)")
    add("--metrics-port", type=int, default=default("METRICS_PORT", defaults.metrics_port), help="Prometheus /metrics HTTP port on the listen host (the step loop's running rows, waiting requests, K/V bytes reserved and budget; request counters); 0 = off (KVBOOST_METRICS_PORT)")
    add("--max-answer-tokens-stored", type=int, default=default("MAX_ANSWER_TOKENS_STORED", defaults.max_answer_tokens_stored), help="when a request ends, the K/V of its prompt's tail and of up to this many generated tokens (its first completion) are written back, keyed as the next turn of the conversation will key them, so that turn recomputes only its new message; 0 = answers are not stored (KVBOOST_MAX_ANSWER_TOKENS_STORED)")
    for removed in REMOVED_FLAGS:  # still parsed, so naming one fails with what replaced it
        add("--" + removed.replace("_", "-"), dest=removed, default=default(removed.upper(), None), help=argparse.SUPPRESS)
    add_renamed_flags(parser, RENAMED_FLAGS, default)
    add("--max-new-tokens", type=int, default=default("MAX_NEW_TOKENS", defaults.max_new_tokens), help="largest max_new_tokens a request may ask for (KVBOOST_MAX_NEW_TOKENS)")
    add("--max-prompt-tokens", type=int, default=default("MAX_PROMPT_TOKENS", defaults.max_prompt_tokens), help="longest prompt accepted; 0 = the model's context (KVBOOST_MAX_PROMPT_TOKENS)")
    add("--max-message-bytes", type=int, default=default("MAX_MESSAGE_BYTES", defaults.max_message_bytes), help="largest gRPC message received or sent, bytes; larger ones get RESOURCE_EXHAUSTED (KVBOOST_MAX_MESSAGE_BYTES)")
    add("--max-concurrent-streams", type=int, default=default("MAX_CONCURRENT_STREAMS", defaults.max_concurrent_streams), help="RPCs in flight per client connection, more wait; 0 = gRPC's default (KVBOOST_MAX_CONCURRENT_STREAMS)")
    add("--auth-token-file", default=default("AUTH_TOKEN_FILE", defaults.auth_token_file), help="file holding the bearer token clients must send (KVBOOST_AUTH_TOKEN_FILE)")
    add("--tls-cert", default=default("TLS_CERT", defaults.tls_cert), help="PEM certificate chain to serve TLS (KVBOOST_TLS_CERT)")
    add("--tls-key", default=default("TLS_KEY", defaults.tls_key), help="PEM private key to serve TLS (KVBOOST_TLS_KEY)")
    add("--cache-auth-token-file", default=default("CACHE_AUTH_TOKEN_FILE", defaults.cache_auth_token_file), help="bearer token file for the cache daemon (KVBOOST_CACHE_AUTH_TOKEN_FILE)")
    add("--cache-tls", action="store_true", default=default("CACHE_TLS", defaults.cache_tls), help="connect to the daemon over TLS (KVBOOST_CACHE_TLS=1)")
    add("--cache-tls-ca", default=default("CACHE_TLS_CA", defaults.cache_tls_ca), help="PEM roots for the daemon's certificate (KVBOOST_CACHE_TLS_CA)")
    add("--cache-timeout", dest="cache_timeout_s", type=float, default=default("CACHE_TIMEOUT", defaults.cache_timeout_s), help="seconds for a cache Lookup; also the reconnect interval (KVBOOST_CACHE_TIMEOUT)")
    add("--cache-stream-timeout", dest="cache_stream_timeout_s", type=float, default=default("CACHE_STREAM_TIMEOUT", defaults.cache_stream_timeout_s), help="seconds for a Fetch stream (at most 32 chunks; a long prompt's chunks come over several) and the fixed part of a Store stream's deadline, which adds its bytes at 16 MB/s; a stream past its deadline fails that transfer only and never marks the daemon unreachable (KVBOOST_CACHE_STREAM_TIMEOUT)")
    add("--cache-max-stream-bytes", type=int, default=default("CACHE_MAX_STREAM_BYTES", defaults.cache_max_stream_bytes), help="blob bytes per Store stream: a write-back or warm-up larger than this goes out as several streams, encoded as it goes; keep it at or below the daemon's --max-store-bytes (KVBOOST_CACHE_MAX_STREAM_BYTES)")
    add("--cache-local-read", default=default("CACHE_LOCAL_READ", defaults.cache_local_read), choices=LOCAL_READ_MODES,
        help="read cached blobs straight from the daemon's LMDB environment when this host can open it (the "
             "daemon's Describe names it; Lookup and Store still go over gRPC): auto falls back to the gRPC "
             "stream, on refuses to start without it, off always streams (KVBOOST_CACHE_LOCAL_READ)")
    add("--kv-events-endpoint", default=default("KV_EVENTS_ENDPOINT", defaults.kv_events_endpoint),
        help="publish KV events in vLLM's format (ZMQ PUB, msgpack) on PORT (bound on 127.0.0.1), HOST:PORT or a ZMQ "
             "URL, for vllm-router's kv_aware policy (--kv-event-source WORKER_URL=tcp://HOST:PORT), llm-d and Dynamo: "
             "BlockStored / BlockRemoved as L0 takes and lets go of chunks (medium GPU on CUDA, CPU on a CPU), blocks "
             "of --kv-events-block-size tokens inside the run of cached chunks from position 0 of one-segment prompts "
             "only. Chunks under a cache_salt, a gateway --keys-file tenant or --tenant-salt are never published "
             "unless --kv-events-publish-salted. Empty (default): off, and pyzmq is never loaded (docs/scaling.md) "
             "(KVBOOST_KV_EVENTS_ENDPOINT)")
    add("--kv-events-topic", default=default("KV_EVENTS_TOPIC", defaults.kv_events_topic),
        help="the topic frame of every KV-event message: empty for vllm-router's static sources, kv@POD@MODEL for "
             "llm-d (KVBOOST_KV_EVENTS_TOPIC)")
    add("--kv-events-replay-endpoint", default=default("KV_EVENTS_REPLAY_ENDPOINT", defaults.kv_events_replay_endpoint),
        help="a ZMQ ROUTER socket (same forms as --kv-events-endpoint) that answers a subscriber's 8-byte start "
             "sequence with the batches it missed, from a ring of the last 10000; empty: no replay "
             "(KVBOOST_KV_EVENTS_REPLAY_ENDPOINT)")
    add("--kv-events-block-size", type=int, default=default("KV_EVENTS_BLOCK_SIZE", defaults.kv_events_block_size),
        help="tokens per published block; must equal the router's --kv-event-block-size (KVBOOST_KV_EVENTS_BLOCK_SIZE)")
    add("--kv-events-publish-salted", action=argparse.BooleanOptionalAction,
        default=default("KV_EVENTS_PUBLISH_SALTED", defaults.kv_events_publish_salted),
        help="also publish chunks stored under a cache_salt (every request through a gateway with --keys-file) or "
             "--tenant-salt: their token ids, which are prompt text, then leave the process, and any tenant's request "
             "is routed toward another tenant's cached prompts (docs/scaling.md, Privacy) "
             "(KVBOOST_KV_EVENTS_PUBLISH_SALTED=1)")
    add("--log-level", default=default("LOG_LEVEL", defaults.log_level), help="DEBUG, INFO, WARNING or ERROR (KVBOOST_LOG_LEVEL)")
    return parser


def _bytes_flag(text: str) -> int | None:
    try:
        return bytes_or_auto(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """Flags over environment over defaults; exits with a usage message on a bad value."""
    parser = build_parser(os.environ if environ is None else environ)
    args = parser.parse_args(argv)
    for removed, message in REMOVED_FLAGS.items():
        if vars(args).pop(removed) is not None:
            parser.error(f"{message} (KVBOOST_{removed.upper()} in the environment counts too)")
    apply_renamed_flags(parser, args, RENAMED_FLAGS, ServiceConfig())
    args.decode_step, retired = current_decode_step(args.decode_step)
    if retired:  # a deployment that named a retired step keeps starting, on the exact step nearest to it
        logging.getLogger(__name__).warning("%s", retired)
    try:
        return ServiceConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
