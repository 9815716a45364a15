"""The replicas' tokenizer, loaded here without torch: transformers' tokenizers backend over the same files.

The service loads its tokenizer with AutoTokenizer, which pulls torch in; the router reads the same
tokenizer.json, tokenizer_config.json and chat template with the tokenizers-backed class, and start-up checks
the result against a replica's own Tokenize (router.startup), so a tokenizer class with behaviour of its own
cannot go unnoticed.
"""
from __future__ import annotations

from pathlib import Path

from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

from kvboost_common import catalogue
from kvboost_common.model_cache import converted_dir, gguf_converted_dir, read_marker


class TokenizerNotFound(RuntimeError):
    """The replicas' tokenizer is not on this host; the message says what to pass."""


def tokenizer_source(model: str, override: str = "") -> str:
    """Where the replicas' tokenizer is: --tokenizer when given; for the model name the replicas report, a
    catalogue model's or a GGUF file's converted folder on this host; else the name itself (a folder, or a
    hub name in the local cache).

    Raises:
        TokenizerNotFound: a catalogue model or GGUF file that was never converted on this host.
    """
    if override:
        return override
    entry = catalogue.find(model)
    if entry is not None:
        return _converted(converted_dir(entry), f"run `make model MODEL={entry.name}` on this host")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted(gguf_converted_dir(path)[0], "start a service with it on this host once")
    return model


def _converted(folder: Path, remedy: str) -> str:
    if read_marker(folder) is None:
        raise TokenizerNotFound(f"the replicas' model has no converted copy at {folder}: {remedy}, or pass "
                                "--tokenizer with the folder of the replicas' tokenizer")
    return str(folder)


def load_tokenizer(source: str) -> PreTrainedTokenizerFast:
    """Raises OSError or ValueError when source holds no tokenizer (nothing is downloaded)."""
    return PreTrainedTokenizerFast.from_pretrained(source, local_files_only=True)
