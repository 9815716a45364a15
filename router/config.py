"""The router's configuration: one dataclass filled from CLI flags with KVBOOST_ROUTER_* environment defaults."""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from kvboost_common.addresses import check_listen_address, is_local, is_unix, split_host_port
from kvboost_common.auth import load_token
from kvboost_common.env_defaults import env_default_reader
from router.policies import POLICIES

DEFAULT_LISTEN = "127.0.0.1:50050"
WARM_TARGETS = ("picked", "all")


@dataclass(slots=True, frozen=True)
class ReplicaAddress:
    """One replica: its inference service and the cache daemon that service uses."""

    service: str
    daemon: str

    def __post_init__(self) -> None:
        for role, address in (("service", self.service), ("daemon", self.daemon)):
            try:
                check_listen_address(address)
            except ValueError:
                raise ValueError(f"--replica {self}: the {role} address must be HOST:PORT or unix:PATH, "
                                 f"got {address!r}") from None

    def __str__(self) -> str:
        return f"{self.service}={self.daemon}"


def parse_replica(text: str) -> ReplicaAddress:
    """'SERVICE_ADDR=DAEMON_ADDR' -> ReplicaAddress. Raises ValueError naming the flag's form."""
    service, separator, daemon = text.strip().partition("=")
    if not separator or not service or not daemon:
        raise ValueError(f"--replica must be SERVICE_ADDR=DAEMON_ADDR (e.g. 127.0.0.1:50051=127.0.0.1:50052), "
                         f"got {text!r}")
    return ReplicaAddress(service, daemon)


@dataclass(slots=True, frozen=True)
class RouterConfig:
    replicas: tuple[ReplicaAddress, ...] = ()
    listen: str = DEFAULT_LISTEN
    policy: str = "prefix"
    tokenizer: str = ""  # where to load the replicas' tokenizer; empty: from the model name the replicas report
    cache_tenant: str = ""  # count only this daemon tenant's chunks; empty: any tenant the events show
    content_weight: float = 0.5
    load_cost_tokens: float = 256.0
    warm: str = "picked"  # Warm goes to the replica the policy picks, or to all
    stats_interval_s: float = 0.5  # replicas' health and Stats are read this often
    startup_timeout_s: float = 120.0  # how long start-up waits for every replica's ModelInfo
    metrics_port: int = 0
    max_message_bytes: int = 64 << 20
    auth_token_file: str = ""  # clients must send `authorization: Bearer <token>`
    tls_cert: str = ""
    tls_key: str = ""
    replica_auth_token_file: str = ""  # the router's own calls to replicas (ModelInfo, Stats); forwarded calls
    replica_tls: bool = False  # carry the caller's metadata as it came
    replica_tls_ca: str = ""
    cache_auth_token_file: str = ""  # WatchEvents on every daemon: an admin token, or the services' tenant's
    cache_tls: bool = False
    cache_tls_ca: str = ""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        _require(len(self.replicas) > 0, "give at least one --replica SERVICE_ADDR=DAEMON_ADDR")
        services = [replica.service for replica in self.replicas]
        _require(len(set(services)) == len(services), f"a service appears twice among --replica flags: {services}")
        try:
            check_listen_address(self.listen)
        except ValueError:
            raise ValueError(f"--listen must be HOST:PORT or unix:PATH, got {self.listen!r}") from None
        _require(self.policy in POLICIES, f"--policy must be one of {POLICIES}, got {self.policy!r}")
        _require(0.0 <= self.content_weight <= 1.0, f"--content-weight must be in [0, 1], got {self.content_weight}")
        _require(self.load_cost_tokens >= 0, f"--load-cost-tokens must be >= 0, got {self.load_cost_tokens}")
        _require(self.warm in WARM_TARGETS, f"--warm must be one of {WARM_TARGETS}, got {self.warm!r}")
        _require(self.stats_interval_s > 0, f"--stats-interval must be positive, got {self.stats_interval_s}")
        _require(self.startup_timeout_s > 0, f"--startup-timeout must be positive, got {self.startup_timeout_s}")
        _require(0 <= self.metrics_port < 65536, f"--metrics-port out of range: {self.metrics_port}")
        _require(self.max_message_bytes >= 1 << 20,
                 f"--max-message-bytes must be at least 1048576, got {self.max_message_bytes}")
        _require(bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key go together")

    @property
    def host(self) -> str:
        """The listen host; loopback for a unix socket (where the metrics port then listens)."""
        return "127.0.0.1" if is_unix(self.listen) else split_host_port(self.listen)[0]

    @property
    def listens_on_loopback(self) -> bool:
        return is_local(self.listen)

    def auth_token(self) -> str | None:
        return _read_secret(self.auth_token_file)

    def replica_auth_token(self) -> str | None:
        return _read_secret(self.replica_auth_token_file)

    def cache_auth_token(self) -> str | None:
        return _read_secret(self.cache_auth_token_file)

    def describe(self) -> str:
        """One line per setting for the start-up log (secrets appear as file paths only)."""
        shown = {**asdict(self), "replicas": [str(replica) for replica in self.replicas]}
        return "\n".join(f"  {name} = {value!r}" for name, value in shown.items())


def _read_secret(path: str) -> str | None:
    return load_token(path) if path else None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    defaults = RouterConfig.__dataclass_fields__
    default = env_default_reader(environ)

    def given(name: str):
        return defaults[name].default

    parser = argparse.ArgumentParser(
        prog="python -m router",
        description="KVBoost router: the inference service's gRPC API in front of several replicas, each request "
                    "sent where its prompt's K/V are already cached (followed through every daemon's KV events). "
                    "Every flag defaults to the KVBOOST_ROUTER_<NAME> environment variable when it is set.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--replica", dest="replicas", action="append", default=None, metavar="SERVICE_ADDR=DAEMON_ADDR",
        help="a replica: its inference service's address and the address of the cache daemon that service uses "
             "(its --cache-addr as this host reaches it); repeat for every replica (KVBOOST_ROUTER_REPLICAS: "
             "comma-separated)")
    add("--listen", default=default("ROUTER_LISTEN", given("listen")),
        help="HOST:PORT to serve the InferenceService API on, or unix:PATH (KVBOOST_ROUTER_LISTEN)")
    add("--policy", default=default("ROUTER_POLICY", given("policy")), choices=POLICIES,
        help="prefix: the replica whose daemon holds most of the prompt (exact prefix run, stored partial chunk, "
             "content hits at --content-weight), against its load at --load-cost-tokens per request; least-loaded: "
             "fewest running + queued requests; round-robin: each replica in turn (KVBOOST_ROUTER_POLICY)")
    add("--tokenizer", default=default("ROUTER_TOKENIZER", given("tokenizer")),
        help="folder (or cached hub name) of the replicas' tokenizer; empty: found from the model the replicas "
             "report in ModelInfo (a catalogue model's converted folder on this host). Checked at start against a "
             "replica's Tokenize either way (KVBOOST_ROUTER_TOKENIZER)")
    add("--cache-tenant", default=default("ROUTER_CACHE_TENANT", given("cache_tenant")),
        help="the daemon tenant the replicas' services store as (their --cache-auth-token-file's tenant): with an "
             "admin --cache-auth-token-file only that tenant's chunks count; empty: any tenant's "
             "(KVBOOST_ROUTER_CACHE_TENANT)")
    add("--content-weight", type=float, default=default("ROUTER_CONTENT_WEIGHT", given("content_weight")),
        help="prefix policy: the share of a content hit's tokens counted as saved (repair recomputes part of "
             "them), in [0, 1] (KVBOOST_ROUTER_CONTENT_WEIGHT)")
    add("--load-cost-tokens", type=float, default=default("ROUTER_LOAD_COST_TOKENS", given("load_cost_tokens")),
        help="prefix policy: prompt tokens of prefill one running or queued request on a replica is worth; "
             "higher spreads load sooner, 0 follows the cache alone (KVBOOST_ROUTER_LOAD_COST_TOKENS)")
    add("--warm", default=default("ROUTER_WARM", given("warm")), choices=WARM_TARGETS,
        help="where Warm goes: picked = the replica the policy picks for that text (as the questions about it "
             "will be), all = every healthy replica; a call's `kvboost-warm: all|picked` metadata overrides it "
             "(KVBOOST_ROUTER_WARM)")
    add("--stats-interval", dest="stats_interval_s", type=float,
        default=default("ROUTER_STATS_INTERVAL", given("stats_interval_s")),
        help="seconds between reads of every replica's health and Stats (running + queued requests); an "
             "unhealthy replica is skipped until a read finds it serving (KVBOOST_ROUTER_STATS_INTERVAL)")
    add("--startup-timeout", dest="startup_timeout_s", type=float,
        default=default("ROUTER_STARTUP_TIMEOUT", given("startup_timeout_s")),
        help="seconds start-up waits for every replica's ModelInfo (replicas load their model first) "
             "(KVBOOST_ROUTER_STARTUP_TIMEOUT)")
    add("--metrics-port", type=int, default=default("ROUTER_METRICS_PORT", given("metrics_port")),
        help="Prometheus /metrics HTTP port on the listen host (per replica: requests routed, retries, load, "
             "health, chunks indexed, events, resyncs); 0 = off (KVBOOST_ROUTER_METRICS_PORT)")
    add("--max-message-bytes", type=int, default=default("ROUTER_MAX_MESSAGE_BYTES", given("max_message_bytes")),
        help="largest gRPC message received or sent, bytes (KVBOOST_ROUTER_MAX_MESSAGE_BYTES)")
    add("--auth-token-file", default=default("ROUTER_AUTH_TOKEN_FILE", given("auth_token_file")),
        help="file holding the bearer token clients must send; the caller's metadata, token included, goes on "
             "to the replica unchanged (KVBOOST_ROUTER_AUTH_TOKEN_FILE)")
    add("--tls-cert", default=default("ROUTER_TLS_CERT", given("tls_cert")),
        help="PEM certificate chain to serve TLS (KVBOOST_ROUTER_TLS_CERT)")
    add("--tls-key", default=default("ROUTER_TLS_KEY", given("tls_key")),
        help="PEM private key to serve TLS (KVBOOST_ROUTER_TLS_KEY)")
    add("--replica-auth-token-file",
        default=default("ROUTER_REPLICA_AUTH_TOKEN_FILE", given("replica_auth_token_file")),
        help="bearer token file for the router's own calls to the replicas (ModelInfo, Tokenize at start, Stats, "
             "health) (KVBOOST_ROUTER_REPLICA_AUTH_TOKEN_FILE)")
    add("--replica-tls", action="store_true", default=default("ROUTER_REPLICA_TLS", given("replica_tls")),
        help="connect to the replicas over TLS (KVBOOST_ROUTER_REPLICA_TLS=1)")
    add("--replica-tls-ca", default=default("ROUTER_REPLICA_TLS_CA", given("replica_tls_ca")),
        help="PEM roots for the replicas' certificates; implies --replica-tls (KVBOOST_ROUTER_REPLICA_TLS_CA)")
    add("--cache-auth-token-file", default=default("ROUTER_CACHE_AUTH_TOKEN_FILE", given("cache_auth_token_file")),
        help="bearer token file for WatchEvents on every daemon: an admin token (every tenant's events) or the "
             "tenant token the services use (that tenant's only) (KVBOOST_ROUTER_CACHE_AUTH_TOKEN_FILE)")
    add("--cache-tls", action="store_true", default=default("ROUTER_CACHE_TLS", given("cache_tls")),
        help="connect to the daemons over TLS (KVBOOST_ROUTER_CACHE_TLS=1)")
    add("--cache-tls-ca", default=default("ROUTER_CACHE_TLS_CA", given("cache_tls_ca")),
        help="PEM roots for the daemons' certificates; implies --cache-tls (KVBOOST_ROUTER_CACHE_TLS_CA)")
    add("--log-level", default=default("ROUTER_LOG_LEVEL", given("log_level")),
        help="DEBUG, INFO, WARNING or ERROR (KVBOOST_ROUTER_LOG_LEVEL)")
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """Flags over environment over defaults; exits with a usage message on a bad value."""
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args = vars(parser.parse_args(argv))
    texts = args.pop("replicas") or [text for text in environ.get("KVBOOST_ROUTER_REPLICAS", "").split(",") if text]
    try:
        return RouterConfig(replicas=tuple(parse_replica(text) for text in texts), **args)
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
