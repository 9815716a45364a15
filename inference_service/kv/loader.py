"""Places a run of stored 16-bit chunks into a slot in as few passes over their bytes as the device allows.

On a GPU each blob is copied once into reused page-locked (pinned) staging memory by a small thread pool, several
blobs at once, each piece's CRC-32 computed right behind its copy while it is still in the CPU's cache (ISA-L and
numpy release the GIL), so host memory is crossed three times per byte (read, write, the device's read), not four;
each staged blob then goes on to the device by an asynchronous copy on the current stream, in order, so the step
loop's next kernels queue behind it and the host never waits per chunk. NaN or infinity is looked for once over the
whole run. The run's checks end in one synchronisation: a chunk that fails any
of them ends the run there, as a failure in the per-chunk path does (its slot rows are recomputed by the prefill).
On a CPU there is nothing to stage: each blob is copied straight from the store's memory into the slot, as before.

Only blobs that are byte for byte what the slot needs take this path (16 bits, the slot's dtype, stored at the same
position, keys as computed); every other blob (quantized, rotated, a longer continuation) goes through
kv.blobs.decode_hit and place_hit_, which refuse, decode and rotate.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kvboost_common.checksum import crc32
from inference_service.kv.codec import HEADER_SIZE, SECTION_ALIGNMENT, BlobHeader, byte_tensor, checksum_of, torch_dtype

logger = logging.getLogger(__name__)

STAGING_BUFFERS = 8  # pinned buffers in the ring: enough to keep the copy engine busy while the host fills the next
STAGING_AHEAD = STAGING_BUFFERS - 2  # blobs being staged at once (fewer than the ring: a buffer is queued before reuse)
CHECKSUM_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_rings = threading.local()


def staging_ring() -> StagingRing:
    """The calling thread's ring (the step loop loads one request at a time)."""
    ring = getattr(_rings, "ring", None)
    if ring is None:
        ring = _rings.ring = StagingRing()
    return ring


def _checksum_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(CHECKSUM_THREADS, thread_name_prefix="kvboost-crc")
        return _pool


def copies_raw(header: BlobHeader, start: int, num_tokens: int, buffers: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the blob's payload is exactly the slot rows [start, start + num_tokens) need (see the module doc)."""
    keys = buffers[0]
    return (header.bits == 16 and torch_dtype(header.dtype) == keys.dtype and not header.keys_before_rope
            and header.start_position == start
            and header.shape == (keys.shape[0], keys.shape[1], num_tokens, keys.shape[3]))


class StagingRing:
    """Pinned host buffers reused round robin, each grown to the largest blob it held (8 x 16 MiB for an 8B model's
    128-token chunks); one is handed out again only once the device has read it. One per thread that loads (the
    step loop, one request at a time): see staging_ring."""

    def __init__(self, count: int = STAGING_BUFFERS, pinned: bool = True) -> None:
        self.pinned = pinned  # False: plain memory (a CPU run of the same pipeline, for tests)
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._read_by: list[torch.cuda.Event | None] = [None] * count  # the device copy that reads each buffer
        self._next = 0
        self.bytes_pinned = 0

    def take(self, num_bytes: int) -> tuple[int, torch.Tensor]:
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        self.wait(index)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < num_bytes:
            self.bytes_pinned -= 0 if buffer is None else buffer.numel()
            buffer = torch.empty(max(num_bytes, 1 << 20), dtype=torch.uint8, pin_memory=self.pinned)
            self._buffers[index] = buffer
            self.bytes_pinned += buffer.numel()
        return index, buffer[:num_bytes]

    def hold(self, index: int, event: torch.cuda.Event | None) -> None:
        """Buffer `index` is being read by the device copy `event` follows (None: by nothing any more)."""
        self._read_by[index] = event

    def wait(self, index: int) -> None:
        event, self._read_by[index] = self._read_by[index], None
        if event is not None:
            event.synchronize()


@dataclass
class _Staging:
    """A blob being copied into pinned memory (and checked) on the pool, its device copies not yet queued."""

    copied: Future  # -> bool: the staged bytes' checksum matched (True when not verified)
    ring_slot: int
    staged: torch.Tensor
    blob: object  # kept alive until staged
    check: int  # its entry in RunLoad._checks


@dataclass
class RunLoad:
    """The chunks of one run copied so far, and the checks still owed on them.

    On a GPU, blobs are staged by the pool STAGING_AHEAD at a time (several memory copies in flight, each blob's
    checksum computed piece by piece right behind its copy, while the piece is still in the CPU's cache), and each
    staged blob's host-to-device copy is queued in order as soon as it is ready. The blobs must stay readable until
    finish(): a lent blob is a view into the daemon's map, valid while its fetch (one read transaction) is open.
    """

    buffers: tuple[torch.Tensor, torch.Tensor]
    verify: bool
    ring: StagingRing | None
    on_corrupt: Callable[[bytes], None] | None = None
    _checks: list[list] = field(default_factory=list)  # [index, key, start, end, Future | None]
    _bounds: tuple[int, int] | None = None
    _staging: deque = field(default_factory=deque)

    def add(self, index: int, key: bytes, blob, header: BlobHeader, start: int, end: int) -> None:
        """Copies the blob's K/V into slot rows [start, end) (copies_raw must hold). On a CPU the blob is checked
        and copied here; on a GPU it is staged in the background, and its checks end in finish()."""
        view = memoryview(blob).cast("B")
        self._checks.append([index, key, start, end, None])
        low, high = self._bounds or (start, end)
        self._bounds = (min(low, start), max(high, end))
        if self.ring is not None:
            ring_slot, staged = self.ring.take(len(view))
            expected = header.checksum if self.verify else None
            copied = _checksum_pool().submit(_stage, view, staged.numpy(), expected)
            self._staging.append(_Staging(copied, ring_slot, staged, blob, len(self._checks) - 1))
            while self._staging and (len(self._staging) > STAGING_AHEAD or self._staging[0].copied.done()):
                self._queue_device_copy(self._staging.popleft())
            return
        if self.verify and not _matches(view, header.checksum):  # now: a lent view may not outlive this call
            self._checks[-1][4] = _failed()
        self._place(byte_tensor(view, HEADER_SIZE, header.payload_bytes), start, end)

    def _queue_device_copy(self, staging: _Staging) -> None:
        matched = staging.copied.result()
        self._checks[staging.check][4] = _done(matched)
        payload = staging.staged[HEADER_SIZE:].to(self.buffers[0].device, non_blocking=True)
        _, _, start, end, _ = self._checks[staging.check]
        self._place(payload, start, end)
        event = None
        if payload.device.type == "cuda":  # the staging buffer is free once the device has read it
            event = torch.cuda.Event()
            event.record()
        self.ring.hold(staging.ring_slot, event)

    def _place(self, payload: torch.Tensor, start: int, end: int) -> None:
        """payload: a 16-bit blob's payload bytes (on the host or the device) -> slot rows [start, end)."""
        keys, values = self.buffers
        shape = (keys.shape[0], keys.shape[1], end - start, keys.shape[3])
        key_bytes = keys.element_size() * shape[0] * shape[1] * shape[2] * shape[3]
        value_offset = -(-key_bytes // SECTION_ALIGNMENT) * SECTION_ALIGNMENT  # codec's layout at 16 bits
        keys[:, :, start:end].copy_(payload[:key_bytes].view(keys.dtype).view(shape), non_blocking=True)
        values[:, :, start:end].copy_(payload[value_offset:value_offset + key_bytes].view(keys.dtype).view(shape),
                                      non_blocking=True)

    def finish(self) -> int | None:
        """Waits for every check (one synchronisation); returns the run index of the first chunk that failed one
        (told to on_corrupt), or None when all passed. The copies are complete when this returns."""
        while self._staging:
            self._queue_device_copy(self._staging.popleft())
        failed = next((i for i, (_, key, _, _, checksum) in enumerate(self._checks)
                       if checksum is not None and not checksum.result()), None)
        if failed is not None:
            logger.warning("chunk at position %d failed its checksum: recomputing from there", self._checks[failed][2])
        finite_upto = self._first_non_finite(len(self._checks) if failed is None else failed)
        first = finite_upto if failed is None or (finite_upto is not None and finite_upto < failed) else failed
        if first is None:
            return None
        if self.on_corrupt is not None:
            self.on_corrupt(self._checks[first][1])
        return self._checks[first][0]

    def _first_non_finite(self, count: int) -> int | None:
        if count == 0 or self._bounds is None:
            return None
        keys, values = self.buffers
        low, high = self._bounds
        if _finite(keys[:, :, low:high]) and _finite(values[:, :, low:high]):  # the one synchronisation
            return None
        for position, (_, _, start, end, _) in enumerate(self._checks[:count]):  # rare: find the chunk
            if not (_finite(keys[:, :, start:end]) and _finite(values[:, :, start:end])):
                logger.warning("chunk at position %d holds NaN or infinity: recomputing from there", start)
                return position
        return None


STAGE_PIECE = 2 << 20  # bytes copied, then checksummed while still in the CPU's cache


def _stage(view: memoryview, staged: np.ndarray, expected: int | None) -> bool:
    """Copies a blob into pinned memory piece by piece, each piece checksummed right after it is copied; returns
    whether the checksum matched (True when expected is None: the store already checked it)."""
    source = np.frombuffer(view, dtype=np.uint8)
    np.copyto(staged[:HEADER_SIZE], source[:HEADER_SIZE])
    crc = crc32(staged[:HEADER_SIZE - 4]) if expected is not None else 0
    for begin in range(HEADER_SIZE, len(source), STAGE_PIECE):
        piece = slice(begin, min(begin + STAGE_PIECE, len(source)))
        np.copyto(staged[piece], source[piece])
        if expected is not None:
            crc = crc32(staged[piece], crc)
    return expected is None or crc == expected


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _matches(memory, expected: int) -> bool:
    return checksum_of(memoryview(memory).cast("B")) == expected


def _failed() -> Future:
    return _done(False)


def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32)))
