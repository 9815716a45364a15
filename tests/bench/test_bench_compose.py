"""bench/bench_compose.py without an engine: the document it builds and how it judges the targets."""
from __future__ import annotations

from bench.bench_compose import CHUNK_SIZE, Summary, build_document, format_summary


def words(text: str) -> int:
    return len(text.split())


def summary(**overrides) -> Summary:
    values = dict(engine="20.10.24", compose="2.40.3", healthy_s=33.0, prompt_tokens=1650, document_tokens=1630,
                  baseline_ms=3000.0, cached_ms=150.0, read_mode="locked_map", fetch_bytes=0, reuse_after_restart=0.95, runs=5)
    return Summary(**{**values, **overrides})


def test_the_document_reaches_the_target_and_ends_inside_a_chunk() -> None:
    document = build_document(words, target=300)
    assert words(document) >= 300 and words(document) % CHUNK_SIZE != 0
    assert words("".join(document.splitlines(keepends=True)[:-1])) < 300, "no passage more than needed"


def test_a_whole_number_of_chunks_gets_one_more_passage() -> None:
    # Counts after each passage: under the target, then at it but a whole number of chunks, then past it.
    counts = iter([128, 256, 257])
    document = build_document(lambda text: next(counts), target=200)
    assert len(document.splitlines()) == 3


def test_the_summary_states_each_target() -> None:
    assert format_summary(summary()) == [
        "Docker Engine 20.10.24, Compose 2.40.3",
        "cold start to all healthy: 33.0 s (target <= 60 s: met)",
        "document 1630 tokens (12 chunks + 94), prompt 1650 tokens; 5 runs each, alternating",
        "TTFT p50: BASELINE 3000 ms, PREFIX_CACHE 150.0 ms: 20.0x (target >= 15x: met); read mode locked_map, 0 blob bytes over Fetch",
        "reuse on the first request after down/up: 0.950 (target >= 0.9: met)",
    ]
    missed = format_summary(summary(healthy_s=61.0, cached_ms=250.0, reuse_after_restart=0.5))
    assert all("missed" in missed[line] for line in (1, 3, 4))
