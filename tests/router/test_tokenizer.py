"""Where the router finds the replicas' tokenizer, and that it loads it without torch, tokenizing as AutoTokenizer."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvboost_common import catalogue
from router.startup import tokenize_probes
from router.tokenizer import TokenizerNotFound, load_tokenizer, tokenizer_source
from tests.factories import build_byte_tokenizer


def test_an_explicit_tokenizer_wins_and_other_names_pass_through(tmp_path):
    assert tokenizer_source(catalogue.DEFAULT_MODEL, override="/srv/tokenizer") == "/srv/tokenizer"
    assert tokenizer_source(str(tmp_path)) == str(tmp_path)


def test_a_catalogue_model_is_its_converted_folder_when_prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_MODEL_DIR", str(tmp_path))
    with pytest.raises(TokenizerNotFound, match="make model MODEL=SmolLM2-135M-Instruct"):
        tokenizer_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    folder = tmp_path / catalogue.DEFAULT_MODEL
    folder.mkdir()
    (folder / ".kvboost-converted").write_text('{"sha256": "x"}')
    assert tokenizer_source("smollm2-135m") == str(folder)


def test_the_loaded_tokenizer_tokenizes_every_probe_as_the_original(tmp_path):
    original = build_byte_tokenizer()
    original.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert [ids for _, _, ids in tokenize_probes(loaded)] == [ids for _, _, ids in tokenize_probes(original)]


def test_loading_a_tokenizer_loads_no_torch(tmp_path):
    build_byte_tokenizer().save_pretrained(tmp_path)
    probe = (f"import sys\nfrom router.tokenizer import load_tokenizer\nload_tokenizer({str(tmp_path)!r})('x')\n"
             "print('torch' in sys.modules)\n")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"
