"""`python -m http_gateway.healthcheck [URL]`: exit 0 when the gateway's /health answers 200 (the service serves)."""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m http_gateway.healthcheck", description=__doc__)
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help="the gateway's /health URL (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except (urllib.error.URLError, OSError) as error:
        print(f"{args.url}: unreachable ({error})")
        return 1
    print(f"{args.url}: {status}")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
