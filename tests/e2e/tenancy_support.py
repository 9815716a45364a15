"""Tenants files, per-tenant call metadata and /metrics scraping for the tenancy e2e tests."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

TOKENS = {"alice": "alice-0f3c9a7d-token", "bob": "bob-8e21b4c6-token", "ops": "ops-5d7a0e93-token"}


def write_tenants_file(folder: Path, tokens: dict[str, str] = TOKENS, budgets: dict[str, int] | None = None) -> Path:
    """alice and bob are tenants (bob's token in a token file), ops is the admin; budgets: tenant -> max_bytes."""
    (folder / "bob.token").write_text(tokens["bob"] + "\n")
    path = folder / "tenants.json"
    tenants = {
        "alice": {"token": tokens["alice"]},
        "bob": {"token_file": "bob.token"},
        "ops": {"token": tokens["ops"], "admin": True},
    }
    for name, max_bytes in (budgets or {}).items():
        tenants[name]["max_bytes"] = max_bytes
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def write_token_file(folder: Path, name: str, tokens: dict[str, str] = TOKENS) -> Path:
    path = folder / f"{name}.service-token"
    path.write_text(tokens[name])
    return path


def as_tenant(name: str, tokens: dict[str, str] = TOKENS) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {tokens[name]}")]


def scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        return response.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    label_text = ",".join(f'{key}="{value}"' for key, value in labels.items())
    pattern = re.escape(name + (f"{{{label_text}}}" if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    assert match is not None, f"{name} {labels} not in the scrape:\n{text}"
    return float(match.group(1))
