"""Daemon configuration: one dataclass filled from CLI flags with KVBOOST_* environment defaults."""
from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cache_daemon.events import DEFAULT_HISTORY
from cache_daemon.l2.address import L2Address, parse_l2_address
from cache_daemon.l2.record_auth import MAKE_KEY_HINT
from cache_daemon.l2.tls import L2TlsFiles
from kvboost_common.addresses import check_listen_address, is_local, is_unix, split_host_port

DEFAULT_LISTEN = "127.0.0.1:50052"
DEFAULT_MAX_BYTES = 1 << 30
# Data frames are 1 MiB plus a few bytes of framing: the message limit leaves room above that.
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
MIN_MAX_MESSAGE_BYTES = 2 << 20
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(slots=True, frozen=True)
class DaemonConfig:
    data_dir: Path
    listen: str = DEFAULT_LISTEN  # host:port; port 0 picks a free one
    max_bytes: int = DEFAULT_MAX_BYTES  # hard budget on stored blob bytes
    map_size: int = 0  # initial LMDB map size; 0 = twice the budget plus 64 MiB (it grows when full)
    metrics_port: int = 0  # Prometheus HTTP port on the listen host; 0 = off
    auth_token_file: Path | None = None
    tenants_file: Path | None = None  # tokens of many tenants, each with its own key space (cache_daemon.tenancy)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    half_life_s: float = 3600.0  # frequencies halve after this long without hits; 0 = never decay
    flush_interval_s: float = 1.0  # hits reach LMDB at most this late (write-behind)
    heap_trim_interval_s: float = 1.0  # freed heap memory goes back to the OS this often (malloc_trim); 0 = never
    shutdown_grace_s: float = 10.0  # in-flight RPCs get this long on SIGTERM
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # largest gRPC message received or sent
    max_concurrent_streams: int = 0  # RPCs in flight per client connection (more wait); 0 = gRPC's default
    log_level: str = "INFO"
    l2: str = ""  # shared second tier: redis://host:port or redis-cluster://h1:p1,h2:p2; "" = none
    l2_password_file: Path | None = None  # used when the --l2 address carries no password
    l2_write: str = "behind"  # "behind": bounded write-behind queue; "sync": Store waits for L2 (and WAIT)
    l2_queue_bytes: int = 256 << 20  # write-behind bound; beyond it L2 writes are dropped and counted
    l2_wait_replicas: int = -1  # sync writes wait for this many replicas; -1 = 1 for a cluster, 0 for one node
    l2_timeout_s: float = 1.0  # socket timeout of every L2 call; an outage costs at most this per retry
    l2_retry_interval_s: float = 1.0  # while L2 is down, one call tries it again this often
    l2_sync_timeout_s: float = 10.0  # a sync Store retries L2 (through a failover) this long, then UNAVAILABLE
    l2_key_file: Path | None = None  # MAC keys of L2 records ('KEY_ID HEX' lines; the first signs); required with --l2
    l2_tls_ca_file: Path | None = None  # rediss://: the private CA that signed Redis's certificate
    l2_tls_cert_file: Path | None = None  # rediss://: this daemon's client certificate (tls-auth-clients yes)
    l2_tls_key_file: Path | None = None
    l2_promote_batch: int = 64  # L2 hits held in memory at once while a Lookup copies them into LMDB
    tenancy_secret_file: Path | None = None  # 64 hex digits every tenant's key space derives from; required with --l2
    max_store_chunks: int = 65536  # chunks in one Store stream; more: RESOURCE_EXHAUSTED
    max_store_bytes: int = 0  # blob bytes in one Store stream (held in RAM until it ends); 0 = --max-bytes
    store_deadline_s: float = 120.0  # a Store stream must end within this long (server side); 0 = never
    event_history: int = DEFAULT_HISTORY  # KV events kept for watchers that reconnect or fall behind

    def __post_init__(self) -> None:
        _require(self.max_bytes > 0, f"--max-bytes must be positive, got {self.max_bytes}")
        _require(self.map_size >= 0, f"--map-size must be >= 0, got {self.map_size}")
        _require(0 <= self.metrics_port < 65536, f"--metrics-port out of range: {self.metrics_port}")
        _require((self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key go together")
        _require(self.auth_token_file is None or self.tenants_file is None,
                 "--auth-token-file (one trusted caller) and --tenants-file (many tenants) exclude each other")
        _require(self.half_life_s >= 0, f"--half-life must be >= 0, got {self.half_life_s}")
        _require(self.flush_interval_s > 0, f"--flush-interval must be positive, got {self.flush_interval_s}")
        _require(self.heap_trim_interval_s >= 0,
                 f"--heap-trim-interval must be >= 0, got {self.heap_trim_interval_s}")
        _require(self.shutdown_grace_s >= 0, f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s}")
        _require(self.max_message_bytes >= MIN_MAX_MESSAGE_BYTES, f"--max-message-bytes must be at least 2M "
                 f"(data frames are 1 MiB), got {self.max_message_bytes}")
        _require(self.max_concurrent_streams >= 0,
                 f"--max-concurrent-streams must be >= 0, got {self.max_concurrent_streams}")
        check_listen_address(self.listen)
        _require(self.l2_write in ("behind", "sync"), f"--l2-write must be behind or sync, got {self.l2_write!r}")
        _require(self.l2_queue_bytes > 0, f"--l2-queue-bytes must be positive, got {self.l2_queue_bytes}")
        _require(self.l2_wait_replicas >= -1, f"--l2-wait-replicas must be >= 0, got {self.l2_wait_replicas}")
        _require(self.l2_timeout_s > 0 and self.l2_retry_interval_s > 0 and self.l2_sync_timeout_s > 0,
                 "--l2-timeout, --l2-retry-interval and --l2-sync-timeout must be positive")
        _require(self.l2_promote_batch >= 1, f"--l2-promote-batch must be >= 1, got {self.l2_promote_batch}")
        _require((self.l2_tls_cert_file is None) == (self.l2_tls_key_file is None),
                 "--l2-tls-cert-file and --l2-tls-key-file go together")
        _require(self.max_store_chunks >= 1, f"--max-store-chunks must be >= 1, got {self.max_store_chunks}")
        _require(self.max_store_bytes >= 0, f"--max-store-bytes must be >= 0, got {self.max_store_bytes}")
        _require(self.store_deadline_s >= 0, f"--store-deadline must be >= 0, got {self.store_deadline_s}")
        _require(self.event_history >= 1, f"--event-history must be >= 1, got {self.event_history}")
        if self.l2:
            address = parse_l2_address(self.l2)  # ValueError with the reason
            _require(self.l2_key_file is not None,
                     f"--l2 needs --l2-key-file (or KVBOOST_L2_KEY_FILE): every L2 record carries a MAC made with "
                     f"a key the daemons share and Redis never sees; {MAKE_KEY_HINT}")
            _require(self.tenants_file is None or self.tenancy_secret_file is not None,
                     "--tenants-file with --l2 needs --tenancy-secret-file (or KVBOOST_TENANCY_SECRET_FILE), the "
                     "same file on every daemon sharing the L2, so a tenant's keys are the same on every host; "
                     "make one once: python -c \"import secrets; print(secrets.token_hex(32))\" > tenancy.secret")
            _require(address.tls or (self.l2_tls_ca_file is None and self.l2_tls_cert_file is None),
                     "--l2-tls-ca-file and --l2-tls-cert-file need a rediss:// (TLS) --l2 address")
        else:
            _require(self.l2_tls_ca_file is None and self.l2_tls_cert_file is None,
                     "--l2-tls-ca-file and --l2-tls-cert-file need --l2 rediss://...")

    @property
    def store_bytes_limit(self) -> int:
        return self.max_store_bytes or self.max_bytes

    def l2_tls_files(self) -> L2TlsFiles:
        return L2TlsFiles(self.l2_tls_ca_file, self.l2_tls_cert_file, self.l2_tls_key_file)

    @property
    def initial_map_size(self) -> int:
        return self.map_size or 2 * self.max_bytes + (64 << 20)

    def l2_address(self) -> L2Address | None:
        """The parsed --l2 address with the password file read; None without --l2."""
        if not self.l2:
            return None
        password = self.l2_password_file.read_text().strip() if self.l2_password_file else None
        return parse_l2_address(self.l2, password)

    @property
    def num_l2_wait_replicas(self) -> int:
        if self.l2_wait_replicas >= 0:
            return self.l2_wait_replicas
        return 1 if self.l2.startswith(("redis-cluster", "rediss-cluster")) else 0

    @property
    def half_life(self) -> float:
        """Seconds, math.inf when decay is off (what the eviction functions take)."""
        return self.half_life_s or math.inf

    @property
    def host(self) -> str:
        """The listen host; loopback for a unix socket (where the metrics port then listens)."""
        return "127.0.0.1" if is_unix(self.listen) else split_host_port(self.listen)[0]

    @property
    def is_loopback(self) -> bool:
        return is_local(self.listen)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def parse_size(text: str) -> int:
    """'1073741824', '512M', '1.5G', '64KiB' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1073741824, 512M or 2G)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _optional_path(value: str) -> Path | None:
    """A path flag whose empty value (an unset compose variable: `${VAR:-}`) means none."""
    return Path(value) if value else None


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    env = environ.get
    parser = argparse.ArgumentParser(
        prog="python -m cache_daemon",
        description="KVBoost cache daemon: keeps chunk K/V blobs in LMDB under a byte budget and serves "
                    "them over gRPC (kvboost.v1.CacheService). Every flag defaults to the environment "
                    "variable named in its help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data-dir", type=Path, default=env("KVBOOST_DATA_DIR", "~/.cache/kvboost/cache-daemon"),
                        help="LMDB directory, created if missing [KVBOOST_DATA_DIR]")
    parser.add_argument("--listen", default=env("KVBOOST_CACHE_LISTEN", DEFAULT_LISTEN),
                        help="gRPC HOST:PORT (port 0 picks a free port) or unix:PATH for a socket on this host [KVBOOST_CACHE_LISTEN]")
    parser.add_argument("--max-bytes", type=parse_size, default=env("KVBOOST_MAX_BYTES", str(DEFAULT_MAX_BYTES)),
                        help="hard budget on stored blob bytes, e.g. 512M or 8G [KVBOOST_MAX_BYTES]")
    parser.add_argument("--map-size", type=parse_size, default=env("KVBOOST_MAP_SIZE", "0"),
                        help="initial LMDB map size; 0 = 2 x budget + 64M; grows when full [KVBOOST_MAP_SIZE]")
    parser.add_argument("--metrics-port", type=int, default=env("KVBOOST_METRICS_PORT", "0"),
                        help="Prometheus /metrics HTTP port on the listen host, 0 = off [KVBOOST_METRICS_PORT]")
    parser.add_argument("--auth-token-file", type=_optional_path, default=env("KVBOOST_AUTH_TOKEN_FILE"),
                        help="file holding a bearer token; callers then send 'authorization: Bearer <token>' "
                             "(health checks stay open) [KVBOOST_AUTH_TOKEN_FILE]")
    parser.add_argument("--tenants-file", type=Path, default=env("KVBOOST_TENANTS_FILE"),
                        help="JSON file of tenants, each with its bearer token (or token file), an optional admin "
                             "role and max_bytes: each tenant reaches only its own keys; excludes "
                             "--auth-token-file (see 'Tenants' in docs/cache_daemon.md) [KVBOOST_TENANTS_FILE]")
    parser.add_argument("--tls-cert", type=Path, default=env("KVBOOST_TLS_CERT"),
                        help="PEM certificate chain; serve TLS (with --tls-key) [KVBOOST_TLS_CERT]")
    parser.add_argument("--tls-key", type=Path, default=env("KVBOOST_TLS_KEY"),
                        help="PEM private key of --tls-cert [KVBOOST_TLS_KEY]")
    parser.add_argument("--half-life", type=float, default=env("KVBOOST_FREQUENCY_HALF_LIFE", "3600"),
                        help="seconds after which a chunk's hit count halves without hits, 0 = no decay "
                             "[KVBOOST_FREQUENCY_HALF_LIFE]")
    parser.add_argument("--flush-interval", type=float, default=env("KVBOOST_FLUSH_INTERVAL", "1.0"),
                        help="seconds between write-behind flushes of hit counts [KVBOOST_FLUSH_INTERVAL]")
    parser.add_argument("--heap-trim-interval", type=float, default=env("KVBOOST_HEAP_TRIM_INTERVAL", "1.0"),
                        help="seconds between returns of freed heap memory to the OS (glibc malloc_trim; without "
                             "them RssAnon keeps the peak of concurrent Fetch buffers), 0 = never "
                             "[KVBOOST_HEAP_TRIM_INTERVAL]")
    parser.add_argument("--shutdown-grace", type=float, default=env("KVBOOST_SHUTDOWN_GRACE", "10"),
                        help="seconds in-flight RPCs get to finish on SIGTERM [KVBOOST_SHUTDOWN_GRACE]")
    parser.add_argument("--max-message-bytes", type=parse_size,
                        default=env("KVBOOST_MAX_MESSAGE_BYTES", str(DEFAULT_MAX_MESSAGE_BYTES)),
                        help="largest gRPC message received or sent, at least 2M; larger ones are "
                             "RESOURCE_EXHAUSTED [KVBOOST_MAX_MESSAGE_BYTES]")
    parser.add_argument("--max-concurrent-streams", type=int, default=env("KVBOOST_MAX_CONCURRENT_STREAMS", "0"),
                        help="RPCs in flight per client connection; further calls wait for a free stream, "
                             "0 = gRPC's default [KVBOOST_MAX_CONCURRENT_STREAMS]")
    parser.add_argument("--l2", default=env("KVBOOST_L2", ""),
                        help="shared second tier under LMDB: redis://[:PASSWORD@]HOST:PORT[/DB], rediss:// for TLS, "
                             "redis-cluster://H1:P1,H2:P2,... (rediss-cluster:// for TLS); empty = none "
                             "(see docs/scaling.md) [KVBOOST_L2]")
    parser.add_argument("--l2-password-file", type=Path, default=env("KVBOOST_L2_PASSWORD_FILE"),
                        help="file holding the Redis password, when --l2 carries none [KVBOOST_L2_PASSWORD_FILE]")
    parser.add_argument("--l2-write", choices=["behind", "sync"], default=env("KVBOOST_L2_WRITE", "behind"),
                        help="behind: Store replies after LMDB, L2 is written by a background queue (a full queue "
                             "drops writes and counts them); sync: Store replies once L2 (and, in a cluster, a "
                             "replica: WAIT) holds the chunks [KVBOOST_L2_WRITE]")
    parser.add_argument("--l2-queue-bytes", type=parse_size, default=env("KVBOOST_L2_QUEUE_BYTES", "256M"),
                        help="bound of the L2 write-behind queue [KVBOOST_L2_QUEUE_BYTES]")
    parser.add_argument("--l2-wait-replicas", type=int, default=env("KVBOOST_L2_WAIT_REPLICAS", "-1"),
                        help="replicas a sync write waits for; -1 = 1 for a cluster, 0 for one node "
                             "[KVBOOST_L2_WAIT_REPLICAS]")
    parser.add_argument("--l2-timeout", type=float, default=env("KVBOOST_L2_TIMEOUT", "1.0"),
                        help="seconds before an L2 call counts as failed [KVBOOST_L2_TIMEOUT]")
    parser.add_argument("--l2-retry-interval", type=float, default=env("KVBOOST_L2_RETRY_INTERVAL", "1.0"),
                        help="seconds between tries while L2 is down [KVBOOST_L2_RETRY_INTERVAL]")
    parser.add_argument("--l2-sync-timeout", type=float, default=env("KVBOOST_L2_SYNC_TIMEOUT", "10"),
                        help="seconds a --l2-write sync Store keeps trying L2 (a cluster failover takes the "
                             "node timeout and more) before it answers UNAVAILABLE [KVBOOST_L2_SYNC_TIMEOUT]")
    parser.add_argument("--l2-key-file", type=_optional_path, default=env("KVBOOST_L2_KEY_FILE"),
                        help="required with --l2: file of 'KEY_ID HEX' lines (at least 32 bytes each), the same on "
                             "every daemon sharing the L2 and never stored in Redis; the first line signs new L2 "
                             "records (HMAC-SHA256), every line verifies (rotation: see docs/scaling.md). Make one: "
                             "python -c \"import secrets; print('k1', secrets.token_hex(32))\" > l2.key "
                             "[KVBOOST_L2_KEY_FILE]")
    parser.add_argument("--l2-tls-ca-file", type=Path, default=env("KVBOOST_L2_TLS_CA_FILE"),
                        help="rediss://: PEM of the private CA that signed Redis's certificate (default: the "
                             "system trust store) [KVBOOST_L2_TLS_CA_FILE]")
    parser.add_argument("--l2-tls-cert-file", type=Path, default=env("KVBOOST_L2_TLS_CERT_FILE"),
                        help="rediss://: PEM client certificate for Redis's tls-auth-clients (with "
                             "--l2-tls-key-file) [KVBOOST_L2_TLS_CERT_FILE]")
    parser.add_argument("--l2-tls-key-file", type=Path, default=env("KVBOOST_L2_TLS_KEY_FILE"),
                        help="rediss://: PEM private key of --l2-tls-cert-file [KVBOOST_L2_TLS_KEY_FILE]")
    parser.add_argument("--l2-promote-batch", type=int, default=env("KVBOOST_L2_PROMOTE_BATCH", "64"),
                        help="L2 hits a Lookup holds in memory at once while it copies them into LMDB "
                             "[KVBOOST_L2_PROMOTE_BATCH]")
    parser.add_argument("--tenancy-secret-file", type=Path, default=env("KVBOOST_TENANCY_SECRET_FILE"),
                        help="64 hex digits every tenant's key space derives from; required with --tenants-file "
                             "and --l2 (the same file on every daemon); without it a daemon keeps its own secret in "
                             "its LMDB. Make one: python -c \"import secrets; print(secrets.token_hex(32))\" "
                             "[KVBOOST_TENANCY_SECRET_FILE]")
    parser.add_argument("--max-store-chunks", type=int, default=env("KVBOOST_MAX_STORE_CHUNKS", "65536"),
                        help="chunks one Store stream may carry; more is RESOURCE_EXHAUSTED (split the stream) "
                             "[KVBOOST_MAX_STORE_CHUNKS]")
    parser.add_argument("--max-store-bytes", type=parse_size, default=env("KVBOOST_MAX_STORE_BYTES", "0"),
                        help="blob bytes one Store stream may carry (held in RAM until the stream ends); more is "
                             "RESOURCE_EXHAUSTED; 0 = --max-bytes [KVBOOST_MAX_STORE_BYTES]")
    parser.add_argument("--store-deadline", type=float, default=env("KVBOOST_STORE_DEADLINE", "120"),
                        help="seconds within which a Store stream must end (server side, whatever the client's "
                             "deadline); later is RESOURCE_EXHAUSTED; 0 = never [KVBOOST_STORE_DEADLINE]")
    parser.add_argument("--event-history", type=int, default=env("KVBOOST_EVENT_HISTORY", str(DEFAULT_HISTORY)),
                        help="KV events (WatchEvents) kept in memory, about 250 bytes each: a watcher that "
                             "reconnects within them resumes from its cursor, one further behind (or reading "
                             "more slowly than Stores publish) is answered 'lost' and gets a snapshot of the held "
                             "keys instead [KVBOOST_EVENT_HISTORY]")
    parser.add_argument("--log-level", default=env("KVBOOST_LOG_LEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="[KVBOOST_LOG_LEVEL]")
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    try:
        return DaemonConfig(
            data_dir=args.data_dir.expanduser(), listen=args.listen, max_bytes=args.max_bytes,
            map_size=args.map_size, metrics_port=args.metrics_port,
            auth_token_file=args.auth_token_file, tenants_file=args.tenants_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
            half_life_s=args.half_life, flush_interval_s=args.flush_interval,
            heap_trim_interval_s=args.heap_trim_interval,
            shutdown_grace_s=args.shutdown_grace, max_message_bytes=args.max_message_bytes,
            max_concurrent_streams=args.max_concurrent_streams, log_level=args.log_level,
            l2=args.l2, l2_password_file=args.l2_password_file, l2_write=args.l2_write,
            l2_queue_bytes=args.l2_queue_bytes, l2_wait_replicas=args.l2_wait_replicas,
            l2_timeout_s=args.l2_timeout, l2_retry_interval_s=args.l2_retry_interval,
            l2_sync_timeout_s=args.l2_sync_timeout, l2_key_file=args.l2_key_file,
            l2_tls_ca_file=args.l2_tls_ca_file, l2_tls_cert_file=args.l2_tls_cert_file,
            l2_tls_key_file=args.l2_tls_key_file, l2_promote_batch=args.l2_promote_batch,
            tenancy_secret_file=args.tenancy_secret_file, max_store_chunks=args.max_store_chunks,
            max_store_bytes=args.max_store_bytes, store_deadline_s=args.store_deadline,
            event_history=args.event_history,
        )
    except ValueError as error:
        parser.error(str(error))
