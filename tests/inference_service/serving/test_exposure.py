"""The inference service warns when it listens beyond loopback without a bearer token (nothing is bound here)."""
from __future__ import annotations

import asyncio
import logging

import pytest

import inference_service.serving.server as server_module
from inference_service.serving.config import ServiceConfig


@pytest.mark.parametrize("listen, with_token, warned", [
    ("127.0.0.1:50051", False, False),
    ("localhost:50051", False, False),
    ("0.0.0.0:50051", False, True),
    ("[::]:50051", False, True),
    ("10.1.2.3:50051", False, True),
    ("0.0.0.0:50051", True, False),
])
def test_listening_beyond_loopback_without_a_token_warns(listen, with_token, warned, tmp_path, monkeypatch,
                                                         caplog) -> None:
    # The check runs on the configured address; the port itself is never opened.
    monkeypatch.setattr(server_module, "bind", lambda server, listen, tls_cert, tls_key: 50051)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = ServiceConfig(listen=listen, auth_token_file=str(token_file) if with_token else "")

    async def build():
        server_module.build_server(config)

    with caplog.at_level(logging.WARNING, logger="inference_service.serving.server"):
        asyncio.run(build())
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert bool(warnings) is warned, warnings
    if warned:
        assert listen in warnings[0] and "--auth-token-file" in warnings[0]


def test_the_default_listen_address_is_loopback() -> None:
    assert ServiceConfig().listen.startswith("127.0.0.1:") and ServiceConfig().listens_on_loopback
