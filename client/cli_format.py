"""Human-readable renderings of results for the `kvboost` CLI (the --json forms need none)."""
from __future__ import annotations

from client.results import CacheStats, GenerationResult, VerifyReport, WarmResult


def generation_summary(result: GenerationResult) -> str:
    """One line of figures printed after the streamed text."""
    return (
        f"[{result.mode}] prompt {result.prompt_tokens} tokens, cached {result.cached_tokens} "
        f"(reuse {result.kv_reuse_ratio:.2f}), recomputed {result.recomputed_tokens}; "
        f"TTFT {result.ttft_ms:.1f} ms; {result.generated_tokens} tokens at {result.tokens_per_sec:.1f} tok/s; "
        f"total {result.total_ms:.1f} ms; finish {result.finish_reason or '-'}"
        + ("; DEGRADED: cache daemon unreachable" if result.degraded else "")
        + (f"; APPROXIMATE: {result.approximate_tokens} prompt tokens reused from content hits (may differ from "
           "baseline)" if result.approximate else "")
    )


def warm_line(name: str, result: WarmResult) -> str:
    line = f"{name}: {result.chunks_stored} chunks stored, {result.token_count} tokens (chunk size {result.chunk_size}"
    if result.partial_tail_tokens:
        line += f", last {result.partial_tail_tokens} tokens as a partial chunk"
    return line + ")"


def key_value_lines(values: dict) -> str:
    """`name: value` lines with the values aligned; lists and nested objects are left out."""
    scalars = {name: value for name, value in values.items() if not isinstance(value, (list, tuple, dict))}
    width = max(len(name) for name in scalars)
    return "\n".join(f"{name:<{width}}  {_format_value(value)}" for name, value in scalars.items())


def cache_stats_text(stats: CacheStats) -> str:
    text = key_value_lines(stats.to_dict())
    if stats.namespaces:
        rows = [("namespace", "entries", "bytes", "pinned")]
        rows += [(ns.namespace, str(ns.entries), str(ns.bytes), str(ns.pinned)) for ns in stats.namespaces]
        text += "\n\n" + table(rows)
    if stats.l2 is not None:
        text += "\n\nL2 tier\n" + key_value_lines(stats.l2.to_dict())
    return text


def verify_text(report: VerifyReport) -> str:
    rows = [("identical", "cosine", "KL", "matching", "cached", "prompt")]
    for check in report.prompts:
        rows.append((
            "yes" if check.token_identical else "NO",
            f"{check.first_token_cosine:.6f}",
            f"{check.first_token_kl:.2e}",
            str(check.matching_prefix_tokens),
            str(check.cached_tokens),
            shorten(check.prompt, 50),
        ))
    return table(rows) + f"\n\n{report.identical}/{report.total} prompts token-identical"


def table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns separated by two spaces; the first row is the header."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def shorten(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
