"""Files that map bearer tokens to named principals (the daemon's tenants, the gateway's API keys).

One JSON shape for both, so an operator writes one kind of file:

    {"tenants": {"alice": {"token_file": "alice.token"},
                 "ops":   {"token": "...", "admin": true}}}

Each principal has exactly one of `token` / `token_file` (relative to the file's folder), an optional
`admin` flag, and whatever extra fields the reader allows (the daemon: `max_bytes`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_COMMON_FIELDS = frozenset({"token", "token_file", "admin"})


@dataclass(slots=True, frozen=True)
class Principal:
    """Who a token speaks for, with the reader's extra fields as written in the file."""

    name: str
    admin: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def parse_principals(document: object, base_dir: Path, extra_fields: Iterable[str] = ()) -> dict[str, Principal]:
    """Token -> Principal. Raises ValueError naming what is wrong: the shape, an unknown field, a bad name,
    a missing, empty or shared token, a non-boolean admin flag, no principal at all."""
    allowed = _COMMON_FIELDS | set(extra_fields)
    if not isinstance(document, dict) or set(document) != {"tenants"} or not isinstance(document["tenants"], dict):
        raise ValueError('the file must be a JSON object {"tenants": {NAME: {...}, ...}}')
    by_token: dict[str, Principal] = {}
    for name, fields in document["tenants"].items():
        if not isinstance(fields, dict) or set(fields) - allowed:
            raise ValueError(f"tenant {name!r}: expected an object with fields among {sorted(allowed)}")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"tenant name {name!r} must match {NAME_PATTERN.pattern}")
        token = _token_of(name, fields, base_dir)
        if token in by_token:
            raise ValueError(f"tenants {by_token[token].name!r} and {name!r} share a token")
        if not isinstance(fields.get("admin", False), bool):
            raise ValueError(f"tenant {name!r}: admin must be true or false")
        extra = {key: value for key, value in fields.items() if key not in _COMMON_FIELDS}
        by_token[token] = Principal(name=name, admin=fields.get("admin", False), extra=extra)
    if not by_token:
        raise ValueError("the file names no tenant")
    return by_token


def load_principals(path: Path | str, extra_fields: Iterable[str] = ()) -> dict[str, Principal]:
    """Token -> Principal from a file; token_file paths are relative to its folder."""
    try:
        document = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from error
    return parse_principals(document, Path(path).parent, extra_fields)


def _token_of(name: str, fields: dict, base_dir: Path) -> str:
    if ("token" in fields) == ("token_file" in fields):
        raise ValueError(f"tenant {name!r}: give exactly one of token and token_file")
    if "token" in fields:
        token = fields["token"]
    else:
        path = Path(fields["token_file"]).expanduser()
        token = (path if path.is_absolute() else base_dir / path).read_text()
    if not isinstance(token, str) or not token.strip() or any(char.isspace() for char in token.strip()):
        raise ValueError(f"tenant {name!r}: the token must be a non-empty string without whitespace")
    return token.strip()
