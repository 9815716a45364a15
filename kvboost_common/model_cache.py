"""Where converted models live on disk, found without converting anything: the service converts, the router
only reads the same folders to load the replicas' tokenizer."""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvboost_common import catalogue
from kvboost_common.catalogue import CatalogueModel, sha256_file

DONE_MARKER = ".kvboost-converted"  # JSON {"source": GGUF path, "sha256": its digest}; older copies: the path only


def model_cache_dir() -> Path:
    return Path(os.environ.get("KVBOOST_MODEL_DIR", Path.home() / ".cache" / "kvboost" / "models"))


def converted_dir(entry: CatalogueModel) -> Path:
    return model_cache_dir() / entry.name


def gguf_converted_dir(gguf: Path) -> tuple[Path, str]:
    """(converted folder, SHA-256) of a GGUF file given by path: a catalogue model's own folder when its bytes
    are one, else one named by the digest."""
    digest = sha256_file(gguf)
    entry = next((entry for entry in catalogue.CATALOGUE if entry.sha256 == digest), None)
    return (converted_dir(entry) if entry is not None else model_cache_dir() / f"gguf-{digest[:16]}"), digest


def read_marker(folder: Path) -> dict | None:
    """The conversion record of a folder this project converted; None for any other folder."""
    marker = folder / DONE_MARKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return {"source": text}  # written before fingerprints existed
    return record if isinstance(record, dict) else {"source": text}
