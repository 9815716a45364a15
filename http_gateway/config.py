"""The gateway's configuration: one dataclass filled from CLI flags with KVBOOST_* environment defaults."""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

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

    def api_key(self) -> str | None:
        return load_token(self.api_key_file) if self.api_key_file else None

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
