"""Model names, paths and the weights fingerprint that keys the cache namespace."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from inference_service.engine.engine import Engine, EngineConfig
from inference_service.model import weights
from inference_service.store.memory import InMemoryStore
from kvboost_common import catalogue
from kvboost_common.catalogue import CatalogueError
from tests.factories import build_tiny_model

# The real function: the fast suite's guard replaces weights.prepare_model while a test runs.
PREPARE_MODEL = weights.prepare_model


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    monkeypatch.setenv("KVBOOST_MODEL_DIR", str(folder))
    return folder


def save(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_folder_fingerprints_follow_the_bytes_not_the_name(tmp_path, model_dir):
    model_a, tokenizer = build_tiny_model("llama", seed=0)
    model_b, _ = build_tiny_model("llama", seed=1)
    first = weights.files_fingerprint(save(model_a, tokenizer, tmp_path / "a"))
    assert weights.files_fingerprint(save(model_a, tokenizer, tmp_path / "copy-of-a")) == first
    # Other weights saved under the same path: another fingerprint, never the cached one.
    assert weights.files_fingerprint(save(model_b, tokenizer, tmp_path / "a")) != first
    assert first.startswith("files-sha256:")
    cached = json.loads((model_dir / "fingerprints.json").read_text())
    assert str((tmp_path / "a").resolve()) in cached


def test_a_converted_folder_is_named_by_its_gguf_digest(tmp_path, model_dir):
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / ".kvboost-converted").write_text(json.dumps({"source": "/x.gguf", "sha256": "ab" * 32}))
    assert weights.weights_fingerprint(str(folder)) == f"gguf-sha256:{'ab' * 32}"
    assert weights.weights_fingerprint("org/name-not-on-disk") is None


def test_a_gguf_path_of_a_catalogue_model_resolves_to_its_converted_copy(tmp_path, model_dir, monkeypatch):
    gguf = tmp_path / "downloaded.gguf"
    gguf.write_bytes(b"GGUF fake weights")
    entry = catalogue.CatalogueModel(name="fake-coder", description="", gguf_file="fake.gguf",
                                     size_bytes=gguf.stat().st_size,
                                     sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(), parts=("fake-part1==1",))
    monkeypatch.setattr(catalogue, "CATALOGUE", (*catalogue.CATALOGUE, entry))
    converted = model_dir / entry.name
    converted.mkdir(parents=True)
    (converted / ".kvboost-converted").write_text(json.dumps({"source": str(gguf), "sha256": entry.sha256}))
    by_name = weights.resolve_model_path("fake-coder")
    by_path = weights.resolve_model_path(str(gguf))
    assert by_name == by_path == str(converted)
    assert weights.weights_fingerprint(by_name) == f"gguf-sha256:{entry.sha256}"


def test_an_unprepared_catalogue_model_says_how_to_prepare_it(model_dir):
    with pytest.raises(CatalogueError, match=r"make model MODEL=qwen2.5-coder-0.5b"):
        weights.resolve_model_path("qwen2.5-coder-0.5b")


def test_an_unknown_name_is_refused_without_reaching_a_hub(model_dir):
    with pytest.raises(CatalogueError, match="nothing is downloaded at run time"):
        weights.resolve_model_path("no-such-org/no-such-model")


def test_a_folder_kvboost_did_not_make_is_never_replaced(model_dir, monkeypatch):
    entry = replace(catalogue.QWEN_CODER_05B)
    (model_dir / entry.name).mkdir(parents=True)
    (model_dir / entry.name / "notes.txt").write_text("the user's")
    monkeypatch.setattr(catalogue, "fetch_gguf", lambda *a, **k: pytest.fail("must refuse before fetching"))
    with pytest.raises(CatalogueError, match="was not converted by KVBoost"):
        PREPARE_MODEL(entry.name)
    assert (model_dir / entry.name / "notes.txt").read_text() == "the user's"


def test_clean_models_removes_only_what_it_made(model_dir):
    ours = model_dir / "qwen2.5-coder-0.5b"
    ours.mkdir(parents=True)
    (ours / ".kvboost-converted").write_text("{}")
    theirs = model_dir / "my-model"
    theirs.mkdir()
    gguf = model_dir / "gguf"
    gguf.mkdir()
    (gguf / catalogue.QWEN_CODER_05B.gguf_file).write_bytes(b"x")
    (gguf / "my-own.gguf").write_bytes(b"y")
    removed = weights.clean_models()
    assert len(removed) == 2
    assert not ours.exists() and theirs.is_dir() and (gguf / "my-own.gguf").is_file()


def test_the_namespace_names_the_weights_not_the_model_string():
    model, tokenizer = build_tiny_model("qwen2", seed=0)
    other, _ = build_tiny_model("qwen2", seed=1)
    config = EngineConfig(chunk_size=8)
    engines = [Engine(model, tokenizer, config, InMemoryStore(), model_id="name-a"),
               Engine(model, tokenizer, config, InMemoryStore(), model_id="name-b"),
               Engine(other, tokenizer, config, InMemoryStore(), model_id="name-a")]
    try:
        namespaces = [engine.parts.namespace for engine in engines]
        assert namespaces[0] == namespaces[1] != namespaces[2]
        assert engines[0].weights_id.startswith("state-sha256:")
    finally:
        for engine in engines:
            engine.close()


def test_the_cli_lists_the_catalogue(model_dir, capsys):
    assert weights.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in catalogue.names()) and "not prepared" in listed
    with pytest.raises(CatalogueError, match="not in the model catalogue; choose from SmolLM2"):
        PREPARE_MODEL("no-such-model")
