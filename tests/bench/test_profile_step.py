"""bench/profile_step.py on the tiny model: each case's wall time, limit and split, and the serving figure."""
from __future__ import annotations

import re

import pytest

from bench import profile_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_it_splits_each_case_beside_its_limit_and_measures_serving(capsys) -> None:
    assert profile_step.main(["--model", "tiny", "--cases", "1x20", "3x30", "--steps", "2", "--bandwidth-gib", "0.05",
                              "--serving", "--serving-tokens", "6", "--serving-rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"decode step (?:split|lean); memory bandwidth \(sum over 0.05 GiB, median of 7\): [\d.]+ GB/s", out)
    cases = re.findall(r"(\d+) row\(s\) x ~(\d+) tokens: step [\d.]+ ms wall .* limit [\d.]+ ms = ", out)
    assert [rows for rows, _ in cases] == ["1", "3"]
    for part in ("weight reads (matmuls)", "attention (SDPA)", "cache upkeep", "Python between ops",
                 "sampling (ops)", "detokenize + stream (Python)", "step loop (scheduler, rows)"):
        assert len(re.findall(re.escape(part) + r" +[\d.]+ ms +[\d.]+%", out)) == 2, part
    assert re.search(r"one stream, 6 tokens: engine [\d.]+ tokens/s, through gRPC [\d.]+ tokens/s", out)


def test_weight_bytes_count_a_tied_matrix_once_and_an_untied_embedding_not_at_all() -> None:
    from tests.factories import build_tiny_model

    model, _ = build_tiny_model("llama")
    everything = sum(parameter.numel() * 4 for parameter in model.parameters())
    embedding = model.get_input_embeddings().weight.numel() * 4
    assert not model.config.tie_word_embeddings
    assert profile_step.weight_bytes(model) == everything - embedding
