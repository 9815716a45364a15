"""The replicas' tokenizer, loaded here from its files with the `tokenizers` library and jinja2, without transformers.

The service loads its tokenizer with AutoTokenizer (transformers, torch). From a folder with a tokenizer.json the
router builds the same tokenizer from the same files: the backend from tokenizer.json, the special tokens from
tokenizer_config.json, the chat template from chat_template.jinja (or the config), rendered by router.chat_template;
tests/router/test_tokenizer.py compares the ids with AutoTokenizer's. Anything else (a hub name in the local cache, a
folder without tokenizer.json, a config option that rewrites the backend) loads through transformers, imported only
then. Either way start-up checks the result against a replica's own Tokenize (router.startup).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from tokenizers import AddedToken, Tokenizer

from kvboost_common import catalogue
from kvboost_common.model_cache import converted_dir, gguf_converted_dir, read_marker
from router.chat_template import render_chat

# The named special tokens every tokenizer may have; a config may name more (any other "*_token" string).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json options under which transformers changes the backend after reading tokenizer.json.
_BACKEND_OPTIONS = ("fix_mistral_regex", "split_special_tokens", "add_prefix_space")
_OPTION_KEYS = {"add_bos_token", "add_eos_token", "add_prefix_space", "split_special_tokens", "fix_mistral_regex"}


class TokenizerNotFound(RuntimeError):
    """The replicas' tokenizer is not on this host; the message says what to pass."""


class FileTokenizer:
    """The calls kvboost_keys and router.startup make of a transformers tokenizer, answered from the files.

    tokenizer(text, add_special_tokens) and apply_chat_template(...) give the ids AutoTokenizer gives for the same
    folder; backend_tokenizer and added_tokens_decoder are the `tokenizers` objects the token cache splits with.
    """

    def __init__(self, backend: Tokenizer, special_tokens: Mapping[str, str], chat_template: str | dict | None,
                 name_or_path: str = "") -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        self.name_or_path = name_or_path

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def apply_chat_template(self, conversation: Sequence[Mapping[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True):
        """The rendered text (tokenize=False), else its ids without the tokenizer's own special tokens, as a dict
        {"input_ids": ids} when return_dict. Raises ValueError when the tokenizer has no (default) chat template."""
        rendered = render_chat(self._template(), conversation, add_generation_prompt, self.special_tokens_map)
        if not tokenize:
            return rendered
        ids = self.backend_tokenizer.encode(rendered, add_special_tokens=False).ids
        return {"input_ids": ids} if return_dict else ids

    def _template(self) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            raise ValueError(f"the tokenizer from {self.name_or_path or 'its files'} has no default chat template")
        return template


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


def load_tokenizer(source: str):
    """A FileTokenizer when source is a folder this module reads alone, else transformers' tokenizer (imported
    only then). Raises OSError or ValueError when source holds no tokenizer (nothing is downloaded)."""
    folder = Path(source).expanduser()
    if folder.is_dir() and uses_files_alone(folder):
        return read_tokenizer_folder(folder)
    from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(source, local_files_only=True)


def uses_files_alone(folder: Path) -> bool:
    """True when the folder has a tokenizer.json and no config option under which transformers rewrites it."""
    if not (folder / "tokenizer.json").is_file():
        return False
    config = _read_config(folder)
    return not any(config.get(option) for option in _BACKEND_OPTIONS)


def read_tokenizer_folder(folder: Path) -> FileTokenizer:
    """Raises OSError for unreadable files, ValueError for a tokenizer.json or config that does not parse."""
    config = _read_config(folder)
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # transformers encodes without truncation or padding unless asked, and never splits special tokens.
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = False
    special_tokens = named_special_tokens(config)
    _add_missing_tokens(backend, special_tokens.values(), config)
    return FileTokenizer(backend, special_tokens, _chat_template(folder, config), str(folder))


def named_special_tokens(config: Mapping) -> dict[str, str]:
    """{name: text} of the named special tokens set in tokenizer_config.json (the template sees each by name)."""
    named = {}
    extra = config.get("extra_special_tokens")
    entries = list(config.items()) + (list(extra.items()) if isinstance(extra, dict) else [])
    for key, value in entries:
        if key in _OPTION_KEYS or not (key in NAMED_SPECIAL_TOKENS or key.endswith("_token")):
            continue
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(text, str):
            named[key] = text
    return named


def _add_missing_tokens(backend: Tokenizer, named: Sequence[str] | object, config: Mapping) -> None:
    """Adds, as transformers does on load, the config's added tokens and special tokens that tokenizer.json lacks."""
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    declared = [_added_token(entry) for _, entry in sorted((config.get("added_tokens_decoder") or {}).items(),
                                                           key=lambda item: int(item[0]))]
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
    candidates = declared + [_added_token(token, special=True) for token in (*named, *extra)]
    for token in candidates:
        if token.content in present:
            continue
        present.add(token.content)
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _added_token(entry, special: bool | None = None) -> AddedToken:
    if isinstance(entry, str):
        return AddedToken(entry, special=bool(special), normalized=False)
    flags = {name: entry[name] for name in ("lstrip", "rstrip", "single_word", "normalized") if name in entry}
    is_special = entry.get("special", False) if special is None else special
    return AddedToken(entry["content"], special=is_special, **flags)


def _chat_template(folder: Path, config: Mapping) -> str | dict | None:
    """chat_template.jinja and additional_chat_templates/*.jinja before the config's chat_template (a text, or a
    list of {name, template}); a dict when there are several."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    configured = config.get("chat_template")
    if isinstance(configured, list):
        return {entry["name"]: entry["template"] for entry in configured}
    return configured


def _read_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config
