"""`python -m cache_daemon` / `kvboost-cache-daemon`: run the cache daemon until SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Sequence

from cache_daemon.config import parse_config
from cache_daemon.errors import StartupError
from cache_daemon.logs import configure_logging
from cache_daemon.server import serve
from kvboost_common.heap import freeze_startup_heap


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    configure_logging(config.log_level)
    freeze_startup_heap()  # what the imports built; the index loads after it
    try:
        asyncio.run(serve(config))
    except StartupError as error:
        logging.getLogger("cache_daemon").error("%s", error)
        sys.exit(1)


if __name__ == "__main__":
    main()
