"""`python -m http_gateway` / `kvboost-gateway`: the OpenAI-compatible HTTP gateway on uvicorn."""
from __future__ import annotations

import logging
import sys

import uvicorn

from http_gateway.app import build_app
from http_gateway.config import parse_config
from kvboost_common.heap import freeze_startup_heap

logger = logging.getLogger("http_gateway")


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        app = build_app(config)
    except (OSError, ValueError) as error:  # the key files
        logger.error("cannot start: %s", error)
        return 2
    logger.info("KVBoost HTTP gateway on %s://%s, inference service %s\n%s", "https" if config.https_cert else "http",
                config.listen, config.service_addr, config.describe())
    freeze_startup_heap()
    # uvicorn's access log is off: the gateway logs each request once, with its request id.
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=10, ssl_certfile=config.https_cert or None,
                ssl_keyfile=config.https_key or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
