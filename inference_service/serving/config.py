"""The inference service's configuration: the process's own fields and the engine's (inference_service/config.py),
filled from CLI flags with KVBOOST_* environment defaults."""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Mapping, Sequence

from inference_service.config import FROM_WEIGHTS, EngineConfig, knob_of, service_defaults
from inference_service.model.step_names import current_decode_step
from inference_service.model.weights import DEFAULT_MODEL
from inference_service.mkl_dispatch import CHOICES as MKL_DISPATCHES
from inference_service.serving.engine_flags import add_engine_flags, engine_config_from_args, shown
from inference_service.store.colocated import LOCAL_READ_MODES
from kvboost_common.addresses import check_listen_address, is_local, is_unix, split_host_port
from kvboost_common.auth import load_token
from kvboost_common.kv_events.endpoints import zmq_endpoint
from kvboost_common.env_defaults import add_renamed_flags, apply_renamed_flags, env_default_reader

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_CACHE_ADDR = "127.0.0.1:50052"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Flags that are gone, with what replaced them: a config that still names one fails at start-up with this.
REMOVED_FLAGS = {
    "scheduler": "--scheduler was removed: every request runs on the one step loop (one request at a time is "
                 "--max-running-requests 1)",
    "max_batch_tokens": "--max-batch-tokens was replaced by --kv-cache-bytes: the K/V memory running requests may "
                        "reserve, in bytes (prompt + max_new_tokens per row)",
}
# Flags that were renamed, old -> new (dests): the old flag and variable still work, with a warning (env_defaults).
RENAMED_FLAGS = {"overlap_k": "overlap_tokens"}


def service_engine_config() -> EngineConfig:
    """The engine's configuration with the service's defaults (each field that differs says why: config.py)."""
    return EngineConfig(**service_defaults(EngineConfig))


@dataclass(slots=True, frozen=True)
class ServiceConfig:
    model: str = DEFAULT_MODEL
    cache_addr: str = DEFAULT_CACHE_ADDR  # empty: no daemon, every request runs without the cache
    listen: str = DEFAULT_LISTEN
    device: str = "auto"  # auto: cuda when present, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    threads: int = 0  # torch intra-op threads; 0: torch's default (the machine's cores)
    mkl_dispatch: str = "auto"  # MKL's kernels by instruction set (features) or by CPU vendor; set before torch loads
    strict: bool = True  # refuse architectures whose K/V cannot be reused correctly
    metrics_port: int = 0  # Prometheus /metrics HTTP port on the listen host; 0 = off
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
    cache_local_read: str = "auto"  # read blobs from the daemon's LMDB on this host: auto, on or off
    # KV events in vLLM's format for vllm-router, llm-d and Dynamo (kvboost_common/kv_events); empty: off
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_block_size: int = 16  # vllm-router's --kv-event-block-size default
    kv_events_publish_salted: bool = False  # announce chunks stored under a cache_salt or --tenant-salt too
    log_level: str = "INFO"
    engine: EngineConfig = field(default_factory=service_engine_config)  # its flags: serving/engine_flags.py

    def __post_init__(self) -> None:
        _require(self.model != "", "--model is empty")
        try:
            check_listen_address(self.listen)
        except ValueError:
            raise ValueError(f"--listen must be HOST:PORT or unix:PATH, got {self.listen!r}") from None
        _require(self.device in DEVICES or self.device.startswith("cuda:"), f"--device must be one of {DEVICES} or cuda:N, got {self.device!r}")
        _require(self.dtype in DTYPES, f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.threads >= 0, f"--threads must be >= 0 (0: torch's default), got {self.threads}")
        _require(self.mkl_dispatch in MKL_DISPATCHES,
                 f"--mkl-dispatch must be one of {MKL_DISPATCHES}, got {self.mkl_dispatch!r}")
        _require(0 <= self.metrics_port < 65536, f"--metrics-port out of range: {self.metrics_port}")
        _require(self.max_message_bytes >= 1 << 20, f"--max-message-bytes must be at least 1048576, got {self.max_message_bytes}")
        _require(self.max_concurrent_streams >= 0, f"--max-concurrent-streams must be >= 0, got {self.max_concurrent_streams}")
        _require(bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key go together")
        _require(self.cache_timeout_s > 0, f"--cache-timeout must be positive, got {self.cache_timeout_s}")
        _require(self.cache_stream_timeout_s > 0,
                 f"--cache-stream-timeout must be positive, got {self.cache_stream_timeout_s}")
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
        """One line per setting for the start-up log, the engine's after the process's (secrets appear as file
        paths only)."""
        lines = [f"  {item.name} = {getattr(self, item.name)!r}" for item in fields(self) if item.name != "engine"]
        return "\n".join(lines + [f"  engine.{item.name} = {_described(item, getattr(self.engine, item.name))}"
                                   for item in fields(self.engine)])


def _described(item, value) -> str:
    """auto, on, off, "from the weights" (a value resolved at load) or the value."""
    if value is None and knob_of(item).resolved == FROM_WEIGHTS:
        return FROM_WEIGHTS
    words = shown(item, value)
    return words if words in ("auto", "on", "off") else repr(value)


def read_secret(path: str) -> str | None:
    """The stripped contents of a token file; None when no file is configured."""
    return load_token(path) if path else None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


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
    add("--no-strict", dest="strict", action="store_false", default=not default("NO_STRICT", False), help="try unsupported architectures anyway (KVBOOST_NO_STRICT=1; strict check now: %(default)s)")
    add("--metrics-port", type=int, default=default("METRICS_PORT", defaults.metrics_port), help="Prometheus /metrics HTTP port on the listen host (the step loop's running rows, waiting requests, K/V bytes reserved and budget; request counters); 0 = off (KVBOOST_METRICS_PORT)")
    add_engine_flags(parser, default)
    for removed in REMOVED_FLAGS:  # still parsed, so naming one fails with what replaced it
        add("--" + removed.replace("_", "-"), dest=removed, default=default(removed.upper(), None, str),
            help=argparse.SUPPRESS)
    add_renamed_flags(parser, RENAMED_FLAGS, default)
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


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """Flags over environment over defaults; exits with a usage message on a bad value."""
    parser = build_parser(os.environ if environ is None else environ)
    args = parser.parse_args(argv)
    for removed, message in REMOVED_FLAGS.items():
        if vars(args).pop(removed) is not None:
            parser.error(f"{message} (KVBOOST_{removed.upper()} in the environment counts too)")
    apply_renamed_flags(parser, args, RENAMED_FLAGS, service_engine_config())
    args.decode_step, retired = current_decode_step(args.decode_step)
    if retired:  # a deployment that named a retired step keeps starting, on the exact step nearest to it
        logging.getLogger(__name__).warning("%s", retired)
    try:
        return ServiceConfig(engine=engine_config_from_args(args), **vars(args))
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
