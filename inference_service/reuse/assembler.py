"""Looks a prompt's chunks up, fetches the hits and places their K/V into the request's K/V buffers."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from inference_service.store.protocol import (AfterRun, ChunkStore, ContinuationQuery, DeleteEpoch, StoreLookup,
                                             StoreTimeout, StoreUnavailable)
from inference_service.kv.blobs import decode_hit, place_hit_
from inference_service.kv.codec import BlobError, BlobHeader, read_header
from inference_service.kv.loader import RunLoad, copies_raw, staging_ring
from kvboost_keys.prompts import PromptPlan
from kvboost_keys.chunking import Chunk
from inference_service.kv.rope import RopeParams
from inference_service.kv_memory.host_tier import HostTier
from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.reuse.prefetch import prefetched
from inference_service.reuse.load_choice import LoadChoice, RunPart
from inference_service.kv_memory.tier_placement import device_mark, place_from_tiers, tiers_holding
from inference_service.kv_memory.tier_rates import TierLoad, store_tier

logger = logging.getLogger(__name__)



@dataclass(slots=True)
class AssembledContext:
    """Buffers whose first num_cached_tokens positions hold cached K/V, ready for build_cache."""

    key_buffer: torch.Tensor | None  # [layers, kv_heads, capacity, head_dim]; None when nothing was reused
    value_buffer: torch.Tensor | None
    num_cached_tokens: int = 0
    num_cached_chunks: int = 0  # leading chunks whose K/V are in the buffers
    num_recomputed_tokens: int = 0  # cached tokens whose K/V were recomputed by repair
    num_bytes_fetched: int = 0
    degraded: bool = False  # the cache became unreachable; chunks placed before that are still used
    content_hits: dict[int, bytes] = field(default_factory=dict)  # looked up, not reused yet
    # The stored partial chunk placed after the leading chunks (its tokens are in num_cached_tokens); None: none.
    partial_key: bytes | None = None
    num_partial_tokens: int = 0  # of num_cached_tokens, those the partial chunk held
    repair_checked: bool = False  # cacheblend measured the content hits' risk (see kv.repair)
    repair_risk: float = 0.0
    fidelity_guard: bool = False  # the guard recomputed every content-hit token
    # Whole chunks placed from the store, not from L0: (prefix key, start, end, the key it chains from or None for
    # the prompt's first chunk) for L0 to keep, off the request path.
    fetched_whole: list[tuple[bytes, int, int, bytes | None]] = field(default_factory=list)
    num_tier_chunks: int = 0  # chunks placed from L0 or the host tier: the leading ones (the partial one, from L0, when
    # all came from there)
    approximate: bool = False  # content hits were placed: K/V computed under another prefix are in the context
    num_approximate_tokens: int = 0  # content-hit tokens whose K/V repair kept (not recomputed)
    num_load_skipped_tokens: int = 0  # cached tokens recomputed instead: predicted faster (ChooseLoad)
    tier_loads: list[TierLoad] = field(default_factory=list)  # what each tier placed, and how long it took
    num_lookups: int = 0  # Lookups assemble_context asked (on the step loop): 0 when the early one held
    # The delete epoch of the Lookup the prompt was placed after (None: none answered, or a store that keeps none):
    # the new chunks' write-back carries it, so a Delete after it keeps them out of the store (StoreItem.delete_epoch).
    delete_epoch: DeleteEpoch | None = None

    @property
    def num_fetched_blobs(self) -> int:
        """Blobs that came from the store (L0's chunks did not)."""
        return self.num_cached_chunks + (self.partial_key is not None) - self.num_tier_chunks


# (the run's parts by tier, the question's tokens after it, K/V bytes per token) -> how much of the run to load.
ChooseLoad = Callable[[Sequence[RunPart], int, int], LoadChoice]


@dataclass(slots=True, frozen=True)
class PartialHit:
    """A stored chunk that continues the prefix run: its key and the prompt's tokens whose K/V it gives (its
    first len(chunk.token_ids) tokens; leading: it may hold more, where the prompt went another way)."""

    key: bytes
    chunk: Chunk
    leading: bool = False
    in_l0: bool = False  # L0 holds it: placed from there, not fetched


def empty_context(degraded: bool = False) -> AssembledContext:
    return AssembledContext(None, None, degraded=degraded)


def assemble_context(
    store: ChunkStore,
    namespace: bytes,
    prompt: PromptPlan,
    buffers: tuple[torch.Tensor, torch.Tensor],
    with_content_hits: bool,
    rope: RopeParams | None = None,
    l0: L0Tier | None = None,
    choose_load: ChooseLoad | None = None,
    early: StoreLookup | LookupFailed | None = None,
    host: HostTier | None = None,
) -> AssembledContext:
    """Everything the store can give for this prompt, placed into `buffers` (the request's slot: keys, values
    [layers, kv_heads, capacity, head_dim]).

    Never raises for store trouble: an unreachable store gives an empty, degraded context; a bad or
    missing blob ends the reused run there. rope: rotates keys stored un-rotated into place (such blobs
    end the run when it is None). After the run of whole chunks, the stored chunk (whole or partial) chained from
    the run's last key that shares the most leading tokens with the prompt (reuse inside a chunk: a follow-up
    question, the next turn of a chat) is placed too; the same Lookup answers it (AfterRun), unless L0 took the
    run further or the daemon is older (then a second Lookup asks). A daemon without the continuation index still
    answers the longest stored partial chunk the prompt continues. early: that Lookup, asked already (look_up, on
    the submitting thread, so the step loop does not wait for it). host: the host tier, placed from after L0 and
    before the store, within the run the Lookup confirmed, as L0.
    """
    if isinstance(early, LookupFailed):  # the store did not answer it: not asked twice (a slow daemon stays slow)
        logger.warning("cache unavailable, serving without it: %s", early.reason)
        return empty_context(degraded=True)
    num_lookups = int(early is None)  # Lookups asked here, on the step loop
    try:
        lookup = early if early is not None else look_up(store, namespace, prompt, with_content_hits)
        # The run goes on through the chunks L0 serves alone (a prefix key names exactly one K/V, so this is exact):
        # those whose write-back is still in flight, and those the daemon evicted with no Delete since it last
        # confirmed them (the delete epoch: a Delete there still reaches L0).
        epoch = _confirmed_epoch(l0, prompt, lookup)
        run = lookup.prefix_run if l0 is None else l0.extend_run(prompt.prefix_keys, lookup.prefix_run, epoch)
        partial, asked_again = _find_partial(store, namespace, prompt, run, l0, lookup, epoch)
        num_lookups += asked_again
    except StoreUnavailable as error:
        logger.warning("cache unavailable, serving without it: %s", error)
        context = empty_context(degraded=True)
        context.num_lookups = num_lookups
        return context
    if run == 0 and partial is None:
        return AssembledContext(None, None, content_hits=lookup.content_hits, num_lookups=num_lookups,
                                delete_epoch=lookup.delete_epoch)
    context = fetch_prefix_run(store, prompt, run, buffers, rope, partial, l0, choose_load, host)
    context.content_hits = lookup.content_hits
    context.num_lookups = num_lookups
    context.delete_epoch = lookup.delete_epoch
    return context


MAX_AFTER_RUN_TOKENS = 1 << 17  # 512 KiB of token ids in one Lookup


def look_up(store: ChunkStore, namespace: bytes, prompt: PromptPlan, with_content_hits: bool) -> StoreLookup:
    """The prompt's one Lookup: its prefix run, its content hits (when asked) and what continues the run.
    Raises StoreUnavailable."""
    content_keys = list(prompt.content_keys) if with_content_hits else None
    # What continues the run rides along up to a size that keeps the Lookup small (4 bytes a token); a longer prompt
    # asks a second time (_find_partial).
    after_run = AfterRun(prompt.tokens_after_runs()) if prompt.num_tokens <= MAX_AFTER_RUN_TOKENS else None
    return store.lookup(namespace, list(prompt.prefix_keys), content_keys, after_run=after_run)


@dataclass(slots=True, frozen=True)
class LookupFailed:
    """An early Lookup the store did not answer (unreachable, or past its deadline): the request runs without the
    cache, as it would had the step loop asked."""

    reason: str


def early_lookup(store: ChunkStore, namespace: bytes, prompt: PromptPlan,
                 with_content_hits: bool) -> StoreLookup | LookupFailed:
    """look_up as soon as the prompt is planned, off the step loop."""
    try:
        return look_up(store, namespace, prompt, with_content_hits)
    except StoreUnavailable as error:
        return LookupFailed(str(error))


def _confirmed_epoch(l0: L0Tier | None, prompt: PromptPlan, lookup: StoreLookup) -> DeleteEpoch | None:
    """Tells L0 what the Lookup found; the Lookup's delete epoch when it is L0's current one (L0 may then answer
    alone for what the daemon confirmed at it), else None (an older answer, or a store that keeps no epoch)."""
    if l0 is None or lookup.delete_epoch is None:
        return None
    found = list(prompt.prefix_keys[: lookup.prefix_run])
    if lookup.partial_key is not None:
        found.append(lookup.partial_key)
    return lookup.delete_epoch if l0.confirm(lookup.delete_epoch, found) else None


def _find_partial(store: ChunkStore, namespace: bytes, prompt: PromptPlan, run: int,
                  l0: L0Tier | None = None, first: StoreLookup | None = None,
                  epoch: DeleteEpoch | None = None) -> tuple[PartialHit | None, bool]:
    """The stored chunk that continues a run of `run` whole chunks; first: the run's Lookup, which answered this
    when it was asked with AfterRun and its run is `run` (else a second Lookup asks); and whether it asked one.
    epoch: the Lookup's delete epoch when L0 may answer alone at it (L0Tier.serves_alone)."""
    start, length = prompt.partial_span(run)
    if length <= 0:
        return None, False
    tokens = tuple(prompt.token_ids[start : start + length])  # the partial candidates' tokens
    answered = first is not None and first.continued and first.prefix_run == run
    # The keys of the first n tokens, longest first: only L0 (or a second Lookup) needs them.
    candidates = prompt.partial_candidates(run)[1] if l0 is not None or not answered else []
    # The longest candidate L0 serves alone (candidates run longest first).
    in_l0 = next((length - rank for rank, key in enumerate(candidates)
                  if l0 is not None and l0.serves_alone(key, epoch)), 0)
    if in_l0 == length:  # L0 holds every token a partial chunk could cover here: no answer can beat it, ask none
        return PartialHit(candidates[0], Chunk(tokens, start, 0), in_l0=True), False
    if answered:
        exact, exact_key = first.partial_tokens, first.partial_key
        continuation_key, continuation_tokens = first.continuation_key, first.continuation_tokens
    else:
        found = store.lookup(namespace, [], None, candidates, ContinuationQuery(prompt.parent_key(run), tokens))
        exact = 0 if found.partial_index is None else length - found.partial_index  # longest first
        exact_key = None if found.partial_index is None else candidates[found.partial_index]
        continuation_key, continuation_tokens = found.continuation_key, found.continuation_tokens
    shared = min(continuation_tokens, len(tokens))
    if exact and exact >= in_l0 and l0 is not None and exact_key in l0:
        in_l0 = exact  # the daemon's own partial chunk, placed from L0's copy
    if in_l0 and in_l0 >= max(shared, exact):
        return PartialHit(candidates[length - in_l0], Chunk(tokens[:in_l0], start, 0), in_l0=True), not answered
    if shared > exact:
        return PartialHit(continuation_key, Chunk(tokens[:shared], start, 0), leading=True), not answered
    if exact:
        return PartialHit(exact_key, Chunk(tokens[:exact], start, 0)), not answered
    return None, not answered


def fetch_prefix_run(
    store: ChunkStore, prompt: PromptPlan, run: int, buffers: tuple[torch.Tensor, torch.Tensor],
    rope: RopeParams | None = None, partial: PartialHit | None = None, l0: L0Tier | None = None,
    choose_load: ChooseLoad | None = None, host: HostTier | None = None,
) -> AssembledContext:
    """Copies the first `run` chunks (then the partial chunk, if any) into their slices of the buffers: the
    leading ones L0 or the host tier holds from there, the rest fetched from the store and decoded. choose_load,
    asked before anything is placed, may cut the run to a prefix (by tier): the rest is prefilled, and a run cut
    before the store's chunks asks the store for no bytes.

    buffers: keys, values [layers, kv_heads, capacity, head_dim]. A missing blob, one that fails to
    decode, one that does not fit its chunk, or one whose keys cannot be rotated into place ends the
    run there.
    """
    keys, values = buffers
    per_token = 2 * keys.shape[0] * keys.shape[1] * keys.shape[3] * keys.element_size()  # K/V bytes of one token
    skipped = 0
    if choose_load is not None:
        run, partial, skipped = _chosen_run(choose_load, store, prompt, run, partial, l0, host, per_token)
        if run == 0 and partial is None:
            return AssembledContext(None, None, num_load_skipped_tokens=skipped)
    run_chunks, run_keys = list(prompt.chunks.chunks[:run]), list(prompt.prefix_keys[:run])
    l0_partial = partial is not None and partial.in_l0
    if l0_partial:  # the partial chunk right after the run: placed with it when L0 holds the whole run
        run_chunks.append(partial.chunk)
        run_keys.append(partial.key)
    from_tiers, tier_loads = place_from_tiers(l0, host, run_chunks, run_keys, buffers, per_token)
    if l0_partial:
        if from_tiers == run + 1:
            return AssembledContext(keys, values, partial.chunk.end, run, partial_key=partial.key,  # all from L0
                                    num_partial_tokens=len(partial.chunk.token_ids), num_tier_chunks=from_tiers,
                                    tier_loads=tier_loads)
        from_tiers = min(from_tiers, run)
        partial = None  # evicted since, or a whole chunk before it comes from the daemon: the tail is recomputed
    chunks = list(prompt.chunks.chunks[from_tiers:run])
    keys_to_fetch = list(prompt.prefix_keys[from_tiers:run])
    if partial is not None:
        chunks.append(partial.chunk)
        keys_to_fetch.append(partial.key)
    if not chunks:
        if from_tiers == 0:
            return AssembledContext(None, None, num_load_skipped_tokens=skipped)
        return AssembledContext(keys, values, prompt.chunks.chunks[from_tiers - 1].end, from_tiers,
                                num_tier_chunks=from_tiers, tier_loads=tier_loads, num_load_skipped_tokens=skipped)
    started = time.perf_counter()
    before = device_mark(buffers)
    leading_index = run - from_tiers if partial is not None and partial.leading else -1
    shape = (keys.shape[0], keys.shape[1], chunks[-1].end, keys.shape[3])
    verify = not getattr(store, "verifies_blobs", False)  # one checksum per blob is enough
    num_placed = 0
    degraded = False
    blobs = None
    sizes: list[int] = []  # bytes of each placed blob
    load = RunLoad((keys, values), verify, staging_ring() if keys.device.type == "cuda" else None,
                   on_corrupt=lambda key: report_corrupt(store, key))
    try:
        blobs = store.fetch(keys_to_fetch)
        lent = getattr(blobs, "lent", False)  # views into shared memory, valid until the fetch is closed
        if not lent:
            blobs = prefetched(blobs)
        for index, (chunk, expected_key, (key, blob)) in enumerate(zip(chunks, keys_to_fetch, blobs)):
            header = _raw_header(expected_key, key, blob, chunk, index == leading_index, (keys, values))
            if header is not None:  # byte for byte the slot's rows: staged, copied, checked with the whole run
                load.add(index, key, blob, header, chunk.start, chunk.end)
            else:
                decoded = decode_hit(expected_key, key, blob, chunk.start, len(chunk.token_ids), shape, verify,
                                     rope=rope, device=keys.device, borrow=lent,
                                     on_corrupt=lambda key: report_corrupt(store, key), leading=index == leading_index)
                span = slice(chunk.start, chunk.end)
                if decoded is None or not place_hit_(keys[:, :, span], values[:, :, span], decoded, chunk.start, rope):
                    break
            num_placed += 1
            sizes.append(len(blob))
    except StoreTimeout as error:  # a slow transfer: the chunks placed so far are good, the rest is computed
        logger.warning("cache fetch ran past its deadline, %d of %d chunks placed: %s", num_placed, len(chunks), error)
    except StoreUnavailable as error:  # the chunks placed so far are still good
        logger.warning("cache unavailable during fetch, %d of %d chunks placed: %s", num_placed, len(chunks), error)
        degraded = True
    finally:
        try:
            failed = load.finish()  # staged chunks' checksums and the NaN check; before close: lent blobs are read
        finally:
            close = getattr(blobs, "close", None)
            if close is not None:
                close()  # stops a stream we no longer read
    if failed is not None:
        num_placed = min(num_placed, failed)
    num_bytes = sum(sizes[:num_placed])
    fetched_whole = [(keys_to_fetch[i], chunks[i].start, chunks[i].end,
                      prompt.parent_key(from_tiers + i) if from_tiers + i else None)  # None: the prompt's first chunk
                     for i in range(min(num_placed, run - from_tiers))] if l0 is not None or host is not None else []
    if num_placed == 0 and from_tiers == 0:
        return AssembledContext(None, None, num_bytes_fetched=num_bytes, degraded=degraded,
                                num_load_skipped_tokens=skipped)
    if num_placed == 0:
        return AssembledContext(keys, values, prompt.chunks.chunks[from_tiers - 1].end, from_tiers, degraded=degraded,
                                num_tier_chunks=from_tiers, tier_loads=tier_loads, num_load_skipped_tokens=skipped)
    store_load = TierLoad(store_tier(store), num_placed, (chunks[num_placed - 1].end - chunks[0].start) * per_token,
                          time.perf_counter() - started, None if before is None else (before, device_mark(buffers)))
    placed_partial = partial is not None and num_placed == len(chunks)
    return AssembledContext(keys, values, chunks[num_placed - 1].end, min(from_tiers + num_placed, run),
                            num_bytes_fetched=num_bytes, degraded=degraded,
                            partial_key=partial.key if placed_partial else None,
                            num_partial_tokens=len(partial.chunk.token_ids) if placed_partial else 0,
                            fetched_whole=fetched_whole, num_tier_chunks=from_tiers,
                            tier_loads=[*tier_loads, store_load], num_load_skipped_tokens=skipped)


def _chosen_run(choose_load: ChooseLoad, store: ChunkStore, prompt: PromptPlan, run: int, partial: PartialHit | None,
                l0: L0Tier | None, host: HostTier | None, per_token: int) -> tuple[int, PartialHit | None, int]:
    """The run (whole chunks) and partial chunk choose_load keeps, and the cached tokens it gives up. The run's parts
    are what would place each chunk: L0 or the host tier for the leading chunks they hold, then the store (the
    partial chunk from L0 only after a run the tiers hold whole, as fetch_prefix_run places it)."""
    chunks = list(prompt.chunks.chunks[:run])
    held = tiers_holding(l0, host, chunks, prompt.prefix_keys[:run])
    if partial is not None and partial.in_l0:
        if len(held) < run or l0 is None or not l0.holds(partial.key, len(partial.chunk.token_ids)):
            partial = None  # fetch_prefix_run would recompute it: not part of the choice
    tiers = held + [store_tier(store)] * (run - len(held))
    if partial is not None:
        chunks.append(partial.chunk)
        tiers.append("l0" if partial.in_l0 else store_tier(store))
    if not chunks:
        return run, partial, 0
    parts: list[RunPart] = []
    part_chunks: list[int] = []
    for chunk, tier in zip(chunks, tiers):
        if parts and parts[-1].tier == tier:
            parts[-1] = RunPart(tier, parts[-1].num_tokens + len(chunk.token_ids))
            part_chunks[-1] += 1
        else:
            parts.append(RunPart(tier, len(chunk.token_ids)))
            part_chunks.append(1)
    choice = choose_load(parts, prompt.num_tokens - chunks[-1].end, per_token)
    num_loaded = sum(part_chunks[: choice.num_parts])
    skipped = chunks[-1].end - chunks[0].start - choice.num_tokens
    return min(num_loaded, run), partial if num_loaded == len(chunks) else None, skipped


def _raw_header(expected_key: bytes, key: bytes, blob, chunk: Chunk, leading: bool,
                buffers: tuple[torch.Tensor, torch.Tensor]) -> BlobHeader | None:
    """The blob's header when its payload is byte for byte the chunk's slot rows (kv.loader.copies_raw); None sends
    it through decode_hit, which also refuses and logs what cannot stand for the chunk."""
    if blob is None or key != expected_key or leading:
        return None
    try:
        header = read_header(blob)
    except BlobError:
        return None
    return header if copies_raw(header, chunk.start, len(chunk.token_ids), buffers) else None


def report_corrupt(store: ChunkStore, key: bytes) -> None:
    """Tells a store that can hear it (the daemon) that a blob failed its checksum here."""
    report = getattr(store, "report_corrupt", None)
    if report is not None:
        report([key])
