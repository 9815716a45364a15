"""Request ids: the caller's when it sends one, else a fresh short random id."""
from __future__ import annotations

import secrets


def new_request_id(given: str = "") -> str:
    return given or secrets.token_hex(6)
