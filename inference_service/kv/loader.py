"""Places a run of stored 16-bit chunks into a slot in as few passes over their bytes as the device allows.

On a GPU each blob is copied once into reused page-locked (pinned) staging memory and goes on to the device by an
asynchronous copy on the current stream, so the step loop's next kernels queue behind it and the host never waits
per chunk; the CRC-32 of each staged copy runs on a small thread pool meanwhile (ISA-L releases the GIL), and NaN or
infinity is looked for once over the whole run. The run's checks end in one synchronisation: a chunk that fails any
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from inference_service.kv.codec import HEADER_SIZE, SECTION_ALIGNMENT, BlobHeader, byte_tensor, checksum_of, torch_dtype

logger = logging.getLogger(__name__)

STAGING_BUFFERS = 8  # pinned buffers in the ring: enough to keep the copy engine busy while the host fills the next
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
    """Pinned host buffers reused round robin; one is handed out again only once the device has read it and its
    checksum is done. One per engine (a request's load runs on the step loop, one at a time)."""

    def __init__(self, count: int = STAGING_BUFFERS) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._busy: list[tuple[torch.cuda.Event | None, Future | None]] = [(None, None)] * count
        self._next = 0
        self.bytes_pinned = 0

    def take(self, num_bytes: int) -> tuple[int, torch.Tensor]:
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        self.wait(index)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < num_bytes:
            self.bytes_pinned -= 0 if buffer is None else buffer.numel()
            buffer = torch.empty(max(num_bytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._buffers[index] = buffer
            self.bytes_pinned += buffer.numel()
        return index, buffer[:num_bytes]

    def hold(self, index: int, event: torch.cuda.Event, checksum: Future | None) -> None:
        self._busy[index] = (event, checksum)

    def wait(self, index: int) -> None:
        event, checksum = self._busy[index]
        if event is not None:
            event.synchronize()
        if checksum is not None:
            checksum.result()
        self._busy[index] = (None, None)


@dataclass
class RunLoad:
    """The chunks of one run copied so far, and the checks still owed on them."""

    buffers: tuple[torch.Tensor, torch.Tensor]
    verify: bool
    ring: StagingRing | None
    on_corrupt: Callable[[bytes], None] | None = None
    _checks: list[tuple[int, bytes, int, int, Future | None]] = field(default_factory=list)  # index, key, start, end
    _bounds: tuple[int, int] | None = None

    def add(self, index: int, key: bytes, blob, header: BlobHeader, start: int, end: int) -> None:
        """Copies the blob's K/V into slot rows [start, end) (copies_raw must hold). On a CPU a lent blob (a view
        valid until the next one) is checked here; elsewhere the checksum runs in the background until finish."""
        view = memoryview(blob).cast("B")
        keys, values = self.buffers
        shape = (keys.shape[0], keys.shape[1], end - start, keys.shape[3])
        key_bytes = keys.element_size() * shape[0] * shape[1] * shape[2] * shape[3]
        value_offset = -(-key_bytes // SECTION_ALIGNMENT) * SECTION_ALIGNMENT  # codec's layout at 16 bits
        if self.ring is not None and keys.device.type == "cuda":
            slot, staged = self.ring.take(len(view))
            staged.copy_(byte_tensor(view))
            checksum = _checksum_pool().submit(_matches, staged.numpy(), header.checksum) if self.verify else None
            payload = staged[HEADER_SIZE:].to(keys.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.ring.hold(slot, event, checksum)
        else:
            checksum = None
            if self.verify and not _matches(view, header.checksum):  # now: the view may not outlive this call
                checksum = _failed()
            payload = byte_tensor(view, HEADER_SIZE, header.payload_bytes)
        dtype = keys.dtype
        keys[:, :, start:end].copy_(payload[:key_bytes].view(dtype).view(shape), non_blocking=True)
        values[:, :, start:end].copy_(payload[value_offset:value_offset + key_bytes].view(dtype).view(shape),
                                      non_blocking=True)
        self._checks.append((index, key, start, end, checksum))
        low, high = self._bounds or (start, end)
        self._bounds = (min(low, start), max(high, end))

    def finish(self) -> int | None:
        """Waits for every check (one synchronisation); returns the run index of the first chunk that failed one
        (told to on_corrupt), or None when all passed. The copies are complete when this returns."""
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


def _matches(memory, expected: int) -> bool:
    return checksum_of(memoryview(memory).cast("B")) == expected


def _failed() -> Future:
    future: Future = Future()
    future.set_result(False)
    return future


def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32)))
