"""The gateway's configuration: one dataclass filled from CLI flags with KVBOOST_* environment defaults."""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from http_gateway.auth import Keys
from kvboost_common.auth import load_token
from kvboost_common.env_defaults import env_default_reader

DEFAULT_LISTEN = "127.0.0.1:8000"
DEFAULT_SERVICE_ADDR = "127.0.0.1:50051"


@dataclass(slots=True, frozen=True)
class GatewayConfig:
    listen: str = DEFAULT_LISTEN
    service_addr: str = DEFAULT_SERVICE_ADDR
    token: str = ""  # bearer token sent to the inference service
    token_file: str = ""  # ... or read from this file
    tls: bool = False  # TLS to the inference service
    tls_ca: str = ""  # PEM roots for the service's certificate; empty: the system roots
    api_key_file: str = ""  # HTTP clients must send `Authorization: Bearer <key>`; empty: no check
    keys_file: str = ""  # API keys of many tenants (the daemon's tenants-file format); excludes api_key_file
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    max_concurrent_requests: int = 256  # requests in flight (streams included) before 429
    https_cert: str = ""  # PEM certificate chain: serve HTTPS instead of HTTP
    https_key: str = ""  # ... and its private key
    served_model_name: str = ""  # the model id clients use; empty: the service's model name
    default_max_tokens: int = 512  # chat completions that set no max_tokens (completions default to 16, as OpenAI)
    timeout_s: float = 600.0  # deadline of every gRPC call
    retry_after_s: float = 1.0  # Retry-After of a 429
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        _require(":" in self.listen, f"--listen must be HOST:PORT, got {self.listen!r}")
        _require(":" in self.service_addr, f"--service-addr must be HOST:PORT, got {self.service_addr!r}")
        _require(not (self.token and self.token_file), "--token and --token-file exclude each other")
        _require(not self.tls_ca or self.tls, "--tls-ca needs --tls")
        _require(self.default_max_tokens > 0, f"--default-max-tokens must be positive, got {self.default_max_tokens}")
        _require(self.timeout_s > 0, f"--timeout must be positive, got {self.timeout_s}")
        _require(self.retry_after_s >= 0, f"--retry-after must be >= 0, got {self.retry_after_s}")
        _require(not (self.api_key_file and self.keys_file),
                 "--api-key-file (one key for every client) and --keys-file (a key per tenant) exclude each other")
        _require(self.max_body_bytes >= 1024, f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        _require(self.max_concurrent_requests > 0,
                 f"--max-concurrent-requests must be positive, got {self.max_concurrent_requests}")
        _require(bool(self.https_cert) == bool(self.https_key), "--https-cert and --https-key go together")

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    def service_token(self) -> str | None:
        """The bearer token for the inference service, or None."""
        if self.token_file:
            return load_token(self.token_file)
        return self.token or None

    def keys(self) -> Keys:
        """Who may call, read from --api-key-file or --keys-file. Raises OSError or ValueError naming the problem."""
        return Keys.from_files(load_token(self.api_key_file) if self.api_key_file else None, self.keys_file)

    def describe(self) -> str:
        """One line per setting for the start-up log (secrets appear as file paths or `***`)."""
        shown = {**asdict(self), "token": "***" if self.token else ""}
        return "\n".join(f"  {name} = {value!r}" for name, value in shown.items())


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    defaults = GatewayConfig()
    default = env_default_reader(environ)

    parser = argparse.ArgumentParser(
        prog="kvboost-gateway",
        description="OpenAI-compatible HTTP gateway (chat and completions, SSE streaming, tokenize) in front of "
                    "the KVBoost inference service. Every flag defaults to the KVBOOST_<NAME> environment variable "
                    "named in its help when it is set.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--listen", default=default("GATEWAY_LISTEN", defaults.listen),
        help="HOST:PORT the HTTP server binds; loopback unless told otherwise (KVBOOST_GATEWAY_LISTEN)")
    add("--service-addr", default=default("ADDRESS", defaults.service_addr),
        help="inference service HOST:PORT, as the kvboost CLI's --address (KVBOOST_ADDRESS)")
    add("--token", default=default("TOKEN", defaults.token),
        help="bearer token sent to the inference service, as the CLI's --token (KVBOOST_TOKEN)")
    add("--token-file", default=default("AUTH_TOKEN_FILE", defaults.token_file),
        help="read that token from this file, as the CLI's --token-file (KVBOOST_AUTH_TOKEN_FILE)")
    add("--tls", action=argparse.BooleanOptionalAction, default=default("SERVICE_TLS", defaults.tls),
        help="connect to the inference service over TLS (KVBOOST_SERVICE_TLS=1)")
    add("--tls-ca", default=default("SERVICE_TLS_CA", defaults.tls_ca),
        help="PEM roots for the service's certificate; empty: the system roots (KVBOOST_SERVICE_TLS_CA)")
    add("--api-key-file", default=default("GATEWAY_API_KEY_FILE", defaults.api_key_file),
        help="file holding the key HTTP clients must send as `Authorization: Bearer <key>` (the openai SDK's "
             "api_key); empty: no check. /health and /metrics stay open (KVBOOST_GATEWAY_API_KEY_FILE)")
    add("--keys-file", default=default("GATEWAY_KEYS_FILE", defaults.keys_file),
        help='API keys of many tenants, in the daemon\'s tenants-file format {"tenants": {NAME: {"token": KEY | '
             '"token_file": PATH, "admin": BOOL}}}: each request\'s cache scope is its tenant\'s, pins need an '
             'admin key; excludes --api-key-file (KVBOOST_GATEWAY_KEYS_FILE)')
    add("--max-body-bytes", type=int, default=default("GATEWAY_MAX_BODY_BYTES", defaults.max_body_bytes),
        help="largest request body accepted; larger ones get 413 (KVBOOST_GATEWAY_MAX_BODY_BYTES)")
    add("--max-concurrent-requests", type=int,
        default=default("GATEWAY_MAX_CONCURRENT_REQUESTS", defaults.max_concurrent_requests),
        help="requests in flight at once (streams until they end); more get 429 with Retry-After "
             "(KVBOOST_GATEWAY_MAX_CONCURRENT_REQUESTS)")
    add("--https-cert", default=default("GATEWAY_HTTPS_CERT", defaults.https_cert),
        help="PEM certificate chain: serve HTTPS on --listen instead of HTTP (KVBOOST_GATEWAY_HTTPS_CERT)")
    add("--https-key", default=default("GATEWAY_HTTPS_KEY", defaults.https_key),
        help="PEM private key of --https-cert (KVBOOST_GATEWAY_HTTPS_KEY)")
    add("--served-model-name", default=default("SERVED_MODEL_NAME", defaults.served_model_name),
        help="the model id /v1/models lists and requests name; empty: the service's model name "
             "(KVBOOST_SERVED_MODEL_NAME)")
    add("--default-max-tokens", type=int, default=default("GATEWAY_DEFAULT_MAX_TOKENS", defaults.default_max_tokens),
        help="max_tokens of chat completions that set none (capped by the context); completions default to 16 as "
             "OpenAI's do (KVBOOST_GATEWAY_DEFAULT_MAX_TOKENS)")
    add("--timeout", dest="timeout_s", type=float, default=default("GATEWAY_TIMEOUT", defaults.timeout_s),
        help="seconds before a call to the service fails with 504 (KVBOOST_GATEWAY_TIMEOUT)")
    add("--retry-after", dest="retry_after_s", type=float,
        default=default("GATEWAY_RETRY_AFTER", defaults.retry_after_s),
        help="Retry-After seconds of a 429 when the service's queue is full (KVBOOST_GATEWAY_RETRY_AFTER)")
    add("--log-level", default=default("LOG_LEVEL", defaults.log_level),
        help="DEBUG, INFO, WARNING or ERROR (KVBOOST_LOG_LEVEL)")
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Flags over environment over defaults; exits with a usage message on a bad value."""
    parser = build_parser(os.environ if environ is None else environ)
    args = parser.parse_args(argv)
    try:
        return GatewayConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
