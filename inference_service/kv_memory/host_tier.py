"""The host tier: whole chunks' K/V in one region of page-locked host memory, in slabs of one chunk, that the copy
engine reads straight into a request's slot (CUDA); filled by chunks leaving L0 and by chunks fetched from the store."""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inference_service.kv_memory.l0_eviction import DEFAULT_HALF_LIFE_S, HeldElsewhere, L0Entry, plan_admission, record_hit

logger = logging.getLogger(__name__)

# A group of adjacent slabs goes to the device in one DMA into a temporary of at most this many bytes, then into the
# slot by one strided copy per buffer (tier_placement.PLACEMENT_GROUP_BYTES bounds L0's the same way).
MAX_GROUP_BYTES = 512 << 20


@dataclass(slots=True)
class HostTierStats:
    chunks_hit: int = 0  # whole chunks placed from the host tier
    bytes_placed: int = 0
    chunks_added: int = 0
    chunks_evicted: int = 0
    chunks_rejected: int = 0  # not kept: only their own ancestors could have made room, or orphans with no room


def empty_pinned(num_bytes: int) -> torch.Tensor:
    """num_bytes of page-locked host memory (the copy engine reads it without the driver's staging copy): allocated,
    then registered with CUDA. Not torch.empty(pin_memory=True): its caching allocator rounds every size up to a power
    of two (40 GiB would pin 64). Raises RuntimeError when the registration fails."""
    region = torch.empty(num_bytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(region.data_ptr(), num_bytes, 0)
    if int(error) != 0:
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # a failed runtime call leaves its error for the next launch check to find
            clear()
        raise RuntimeError(f"cudaHostRegister returned {error}")
    return region


def _unregister(region: torch.Tensor) -> None:
    """Ends the registration; holding `region` until then keeps its memory from going back to the heap first."""
    torch.cuda.cudart().cudaHostUnregister(region.data_ptr())


def allocate_region(num_bytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """(uint8 [num_bytes] host memory, whether it is pinned). Pinning that fails (RuntimeError: no driver, a locked
    memory limit) falls back to pageable memory, said in one log line: the tier still spares the daemon's reads
    and checksums, and the driver stages its copies."""
    if pin:
        try:
            return empty_pinned(num_bytes), True
        except RuntimeError as error:
            logger.warning("host tier: pinning %d bytes failed (%s); using pageable memory instead (copies to the "
                           "device go through the driver's staging buffer)", num_bytes, error)
    return torch.empty(num_bytes, dtype=torch.uint8), False


class HostTier:
    """Whole chunks' K/V by prefix key in slabs of one region, evicted leaf first by decayed frequency (l0_eviction),
    as L0 is; a chunk whose parent L0 holds (held_elsewhere) is no orphan.

    Exact: a slab holds the bytes of exactly the K/V its key names (computed here, or fetched and checked when they
    entered the process), so a placement is bitwise the daemon path's. Which keys may hit is decided by the run the
    daemon's Lookup confirmed (extended by what L0 answers for alone, by the delete epoch): a Delete or a namespace
    drop there reaches this tier. Stream ordering on CUDA: a slab is filled
    on a side stream that first waits for the event recorded after the last copy out of it, so it is never
    overwritten while the copy engine still reads it; a fill is complete (its entry visible) before add returns.
    Thread-safe: the write-back threads add, the step loop places.
    """

    def __init__(self, num_slabs: int, slab_shape: tuple[int, int, int, int], dtype: torch.dtype, pin: bool = False,
                 held_elsewhere: HeldElsewhere | None = None, half_life: float = DEFAULT_HALF_LIFE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """slab_shape: (layers, kv_heads, chunk tokens, head_dim) of one chunk's keys (its values the same)."""
        assert num_slabs > 0, f"num_slabs must be positive, got {num_slabs}"
        self.slab_shape = slab_shape
        self.dtype = dtype
        self.slab_bytes = 2 * _numel(slab_shape) * dtype.itemsize
        self._base, self.pinned = allocate_region(num_slabs * self.slab_bytes, pin)  # kept: it owns the registration
        self.region = self._base.view(num_slabs, self.slab_bytes)  # uint8 [slabs, slab bytes]; one allocation
        if self.pinned and self._base.device.type == "cpu" and torch.cuda.is_available():
            weakref.finalize(self, _unregister, self._base)
        self.max_bytes = num_slabs * self.slab_bytes
        self.held_elsewhere = held_elsewhere
        self.half_life = half_life
        self.stats = HostTierStats()
        self._clock = clock
        self._slab_of: dict[bytes, int] = {}  # every key with a slab, ready or being filled
        self._entries: dict[bytes, L0Entry] = {}  # the ready ones: what eviction weighs and placement reads
        self._free = list(range(num_slabs - 1, -1, -1))  # popped from the end: a prompt fills adjacent slabs
        self._read_done: dict[int, torch.cuda.Event] = {}  # slab -> recorded after the last copy out of it
        self._side_stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()

    @property
    def bytes_held(self) -> int:
        return len(self._entries) * self.slab_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def add(self, key: bytes, keys: torch.Tensor, values: torch.Tensor, parent: bytes | None = None) -> bool:
        """Copies one whole chunk's K/V (keys, values [layers, kv_heads, chunk tokens, head_dim], on any device) into
        a slab; returns whether the tier holds it. Not kept: another shape or dtype (a partial chunk), or no room that
        eviction may make (l0_eviction.plan_admission). Blocks this thread until the copy is done (never the step
        loop: on CUDA the copy runs on a side stream)."""
        if tuple(keys.shape) != self.slab_shape or keys.dtype != self.dtype or values.shape != keys.shape:
            return False
        incoming = L0Entry(self.slab_bytes, parent, 1.0, self._clock())
        with self._lock:
            if key in self._slab_of:
                return True
            slab = self._take_slab(key, incoming)
            if slab is None:
                self.stats.chunks_rejected += 1
                return False
            self._slab_of[key] = slab
            read_done = self._read_done.pop(slab, None)
        try:
            self._fill(slab, keys, values, read_done)
        except BaseException:
            with self._lock:
                del self._slab_of[key]
                self._free.append(slab)
            raise
        with self._lock:
            self._entries[key] = incoming
            self.stats.chunks_added += 1
        return True

    def _take_slab(self, key: bytes, incoming: L0Entry) -> int | None:
        """A free slab, or one freed by evicting (under the lock)."""
        if self._free:
            return self._free.pop()
        held = len(self._entries) * self.slab_bytes  # slabs being filled are neither held nor free
        victims = plan_admission(self._entries, key, incoming, held, self.half_life, self.held_elsewhere)
        if not victims:
            return None
        victim = victims[0]  # every slab is one chunk: one victim makes room
        del self._entries[victim]
        self.stats.chunks_evicted += 1
        return self._slab_of.pop(victim)

    def _fill(self, slab: int, keys: torch.Tensor, values: torch.Tensor, read_done) -> None:
        target = self.region[slab].view(self.dtype).view(2, *self.slab_shape)  # [2, layers, kv_heads, n, head_dim]
        if keys.device.type != "cuda":
            if read_done is not None:
                read_done.synchronize()  # a host write: the copy engine must be done reading the slab
            target[0].copy_(keys)
            target[1].copy_(values)
            return
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(keys.device)
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(keys.device))  # the K/V are written by then
        if read_done is not None:
            stream.wait_event(read_done)  # the slab's last copy to the device has read it
        with torch.cuda.stream(stream):
            target[0].copy_(keys, non_blocking=True)
            target[1].copy_(values, non_blocking=True)
            filled = torch.cuda.Event()
            filled.record(stream)
        filled.synchronize()  # this (background) thread waits; the entry is visible once the bytes are in the slab

    def place_run(self, keys: Sequence[bytes], start: int, buffers: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Copies the leading whole chunks the tier holds (keys, one after another from position `start`) into the
        buffers (keys, values [layers, kv_heads, capacity, head_dim]); returns how many. Counts a hit on each.

        Adjacent slabs go to the device in one DMA each group (straight from the region: no staging copy on the
        host), then into the slot's slice by one strided copy per buffer; an event recorded after them guards
        the slabs' reuse (see _fill). Issued under the lock, so no slab is refilled between choosing and copying.
        """
        now = self._clock()
        with self._lock:
            slabs: list[int] = []
            for key in keys:
                if key not in self._entries:
                    break
                self._entries[key] = record_hit(self._entries[key], now, self.half_life)
                slabs.append(self._slab_of[key])
            if not slabs:
                return 0
            position = start
            for first, count in _adjacent_groups(slabs, max(1, MAX_GROUP_BYTES // self.slab_bytes)):
                position = self._copy_group(first, count, position, buffers)
            self.stats.chunks_hit += len(slabs)
            self.stats.bytes_placed += len(slabs) * self.slab_bytes
        return len(slabs)

    def _copy_group(self, first: int, count: int, position: int, buffers: tuple[torch.Tensor, torch.Tensor]) -> int:
        layers, kv_heads, length, head_dim = self.slab_shape
        source = self.region[first : first + count]
        device = buffers[0].device
        if device.type == "cuda":
            source = source.to(device, non_blocking=True)  # one DMA from the pinned region
        kv = source.view(self.dtype).view(count, 2, layers, kv_heads, length, head_dim)
        end = position + count * length
        for index, buffer in enumerate(buffers):
            # [layers, kv_heads, count * length, head_dim] seen as [layers, kv_heads, count, length, head_dim]
            target = buffer[:, :, position:end].view(layers, kv_heads, count, length, head_dim)
            target.copy_(kv[:, index].permute(1, 2, 0, 3, 4))
        if device.type == "cuda":
            read = torch.cuda.Event()
            read.record(torch.cuda.current_stream(device))
            for slab in range(first, first + count):
                self._read_done[slab] = read
        return end

    def snapshot(self) -> dict:
        """Counters under ServiceStatsReply-style names."""
        with self._lock:
            return {"host_chunks_hit": self.stats.chunks_hit, "host_bytes_placed": self.stats.bytes_placed,
                    "host_bytes_held": len(self._entries) * self.slab_bytes, "host_chunks_held": len(self._entries),
                    "host_chunks_evicted": self.stats.chunks_evicted, "host_chunks_rejected": self.stats.chunks_rejected,
                    "host_tier_bytes": self.max_bytes, "host_tier_pinned": self.pinned}


def _adjacent_groups(slabs: Sequence[int], max_count: int) -> list[tuple[int, int]]:
    """(first slab, count) runs of consecutive slab indices, each at most max_count long."""
    groups: list[tuple[int, int]] = []
    for slab in slabs:
        if groups and groups[-1][0] + groups[-1][1] == slab and groups[-1][1] < max_count:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((slab, 1))
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def host_tier_for(max_bytes: int, slab_shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                  kv_cache_bits: int, held_elsewhere: HeldElsewhere | None = None) -> HostTier | None:
    """The host tier of max_bytes (whole slabs; None: off, as at 0 or too small for one chunk), pinned on CUDA. Kept
    only at 16-bit storage, as L0 (l0_tier.l0_tier_for says why)."""
    num_slabs = max_bytes // (2 * _numel(slab_shape) * dtype.itemsize) if max_bytes and kv_cache_bits == 16 else 0
    if not num_slabs:
        return None
    return HostTier(num_slabs, slab_shape, dtype, pin=device.type == "cuda", held_elsewhere=held_elsewhere)
