"""K/V slots', L0's and the host tier's bytes by default from the machine (the device's free memory on CUDA, RAM on a
CPU), and the one owner of the tiers: build_tiers makes L0 and the host tier, wired to each other, once (plan_memory
and plan_host_tier are pure; size_tiers reads the machine)."""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from inference_service.kv_memory.host_tier import HostTier, host_tier_for
from inference_service.kv_memory.l0_tier import L0Tier, l0_tier_for
from inference_service.store.protocol import ChunkStore, NullStore

logger = logging.getLogger(__name__)

GIB = 1 << 30
# CUDA: what stays free beside the weights, the K/V slots and L0 for activations (a prefill piece's MLP and logits,
# the placement's temporaries) and the lazily captured decode graphs: a tenth of the device, at least 2 GiB.
CUDA_RESERVE_SHARE = 0.10
CUDA_MIN_RESERVE_BYTES = 2 * GIB
CUDA_KV_SHARE = 0.5  # of what is left when both are auto: half for running requests' slots, half for L0
# CPU: a share of the RAM available at start-up each (pages are committed as written, so neither is taken up front).
CPU_KV_SHARE = 0.25
CPU_L0_SHARE = 0.25
# The host tier, auto (CUDA only: on a CPU L0 already is host memory): a quarter of the RAM available at start, less
# what L0 takes of it, at most HOST_TIER_MAX_BYTES: pinning is slow (tens of seconds for hundreds of GiB) and
# pinned pages are never swapped, so the rest stays for the page cache the daemon's map reads through.
HOST_TIER_SHARE = 0.25
HOST_TIER_MAX_BYTES = 64 * GIB
MIN_BYTES = 64 << 20  # less than this for K/V slots means the machine cannot serve: refused with the reason


class TierSettings(Protocol):
    """The EngineConfig fields (inference_service/config.py declares them) the plan reads; read through this
    Protocol so that K/V memory sits below the config."""

    kv_cache_bytes: int | None
    l0_bytes: int | None
    host_tier_bytes: int | None
    kv_cache_bits: int
    chunk_size: int


Settings = TypeVar("Settings", bound=TierSettings)  # size_tiers returns the config type it was given


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    kv_cache_bytes: int
    l0_bytes: int
    basis: str  # one line for the start-up log: what the auto values came from


def plan_memory(device_type: str, free_bytes: int, total_bytes: int, kv_cache_bytes: int | None,
                l0_bytes: int | None) -> MemoryPlan:
    """The K/V slots' and L0's bytes; None asks for auto, a number is kept as given.

    device_type "cuda": free_bytes is the device's free memory after the weights, total_bytes its size; the auto
    values share what is left after the reserve (CUDA_RESERVE_SHARE), and one given value leaves the rest to the
    other. Otherwise free_bytes is the RAM available (MemAvailable), and each auto value is its own share of it.

    Raises:
        ValueError: auto K/V slots would get less than MIN_BYTES (the message says what to set).
    """
    if device_type == "cuda":
        reserve = max(CUDA_MIN_RESERVE_BYTES, int(total_bytes * CUDA_RESERVE_SHARE))
        usable = max(0, free_bytes - reserve)
        basis = (f"{free_bytes / GIB:.1f} GiB free on the device after the weights, {reserve / GIB:.1f} GiB kept "
                 f"for activations and captured graphs")
        if kv_cache_bytes is None:
            kv_cache_bytes = int(usable * CUDA_KV_SHARE) if l0_bytes is None else usable - l0_bytes
            _check_kv(kv_cache_bytes, basis, l0_bytes)
        if l0_bytes is None:
            l0_bytes = max(0, usable - kv_cache_bytes)
        return MemoryPlan(kv_cache_bytes, l0_bytes, basis)
    basis = f"{free_bytes / GIB:.1f} GiB of RAM available"
    if kv_cache_bytes is None:
        kv_cache_bytes = int(free_bytes * CPU_KV_SHARE)
        _check_kv(kv_cache_bytes, basis, l0_bytes)
    if l0_bytes is None:
        l0_bytes = int(free_bytes * CPU_L0_SHARE)
    return MemoryPlan(kv_cache_bytes, l0_bytes, basis)


def plan_host_tier(device_type: str, available_bytes: int, l0_host_bytes: int) -> int:
    """The auto host tier's bytes: on CUDA HOST_TIER_SHARE of the RAM available less l0_host_bytes (what L0 takes of
    host memory: 0 when it lives on the device), at most HOST_TIER_MAX_BYTES; 0 on a CPU (L0 is host memory)."""
    if device_type != "cuda":
        return 0
    return max(0, min(HOST_TIER_MAX_BYTES, int(available_bytes * HOST_TIER_SHARE) - l0_host_bytes))


def _check_kv(kv_cache_bytes: int, basis: str, l0_bytes: int | None) -> None:
    if kv_cache_bytes < MIN_BYTES:
        given = f", --l0-bytes {l0_bytes}" if l0_bytes is not None else ""
        raise ValueError(f"--kv-cache-bytes auto: {basis}{given} leave {max(0, kv_cache_bytes)} bytes for K/V slots "
                         f"(at least {MIN_BYTES} needed): set --kv-cache-bytes to a number, or lower --l0-bytes")


def mem_available(meminfo: str) -> int | None:
    """MemAvailable from /proc/meminfo's text, in bytes; None when it is not there."""
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            return int(rest.split()[0]) * 1024
    return None


# The memory limit of this process's cgroup and what it uses now: (limit, usage) files, cgroup v2 first, then v1.
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def cgroup_room(limit_text: str, usage_text: str, total: int) -> int | None:
    """Bytes the cgroup still lets this process take (limit - usage); None without a limit ("max", or v1's
    no-limit value, which is larger than the machine)."""
    limit_text = limit_text.strip()
    if not limit_text or limit_text == "max":
        return None
    limit = int(limit_text)
    if limit >= total:
        return None
    return max(0, limit - int(usage_text.strip() or 0))


def host_memory() -> tuple[int, int]:
    """(available, total) RAM in bytes: /proc/meminfo's MemAvailable where there is one, else free pages; within a
    container's memory limit (cgroup), what the limit leaves when that is less (MemAvailable is the host's)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as meminfo:
            available = mem_available(meminfo.read())
    except OSError:
        available = None
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    for limit_path, usage_path in CGROUP_FILES:
        try:
            with open(limit_path) as limit_file, open(usage_path) as usage_file:
                room = cgroup_room(limit_file.read(), usage_file.read(), total)
        except (OSError, ValueError):
            continue
        if room is not None:
            available = min(available, room)
        break
    return available, total


def tokens_held(num_bytes: int, bytes_per_token: int) -> int:
    return num_bytes // bytes_per_token if bytes_per_token else 0


def size_tiers(config: Settings, model, geometry) -> Settings:
    """The config with auto (None) kv_cache_bytes and l0_bytes sized from the machine: the device's free memory
    after the weights on CUDA, the RAM available on a CPU (memory_plan.plan_memory); says at start what each holds."""
    device = model.device
    per_token = 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * model.dtype.itemsize
    config = _size_host_tier(config, device, per_token)
    if config.kv_cache_bytes is not None and config.l0_bytes is not None:
        return config
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free, total = host_memory()
    plan = plan_memory(device.type, free, total, config.kv_cache_bytes, config.l0_bytes)
    logger.info("memory (%s): K/V slots %.2f GiB%s = %d tokens, L0 %.2f GiB%s = %d tokens (%d bytes a token)",
                plan.basis, plan.kv_cache_bytes / 2**30, "" if config.kv_cache_bytes is None else " (given)",
                tokens_held(plan.kv_cache_bytes, per_token), plan.l0_bytes / 2**30,
                "" if config.l0_bytes is None else " (given)", tokens_held(plan.l0_bytes, per_token), per_token)
    return dataclasses.replace(config, kv_cache_bytes=plan.kv_cache_bytes, l0_bytes=plan.l0_bytes)


def _size_host_tier(config: Settings, device: torch.device, per_token: int) -> Settings:
    """The config with an auto (None) host_tier_bytes sized (plan_host_tier); says what the tier holds."""
    given = config.host_tier_bytes is not None
    if given:
        host_bytes = config.host_tier_bytes
    else:
        l0_host = config.l0_bytes or 0 if device.type != "cuda" else 0
        host_bytes = plan_host_tier(device.type, host_memory()[0], l0_host)
    if host_bytes:
        logger.info("host tier %.2f GiB%s = %d tokens (%s host memory, one region in slabs of a chunk)",
                    host_bytes / GIB, " (given)" if given else f" ({HOST_TIER_SHARE:.0%} of the RAM available, at "
                    f"most {HOST_TIER_MAX_BYTES // GIB} GiB)", tokens_held(host_bytes, per_token),
                    "pinned" if device.type == "cuda" else "pageable")
    elif not given:
        logger.info("host tier off: on a CPU L0 already is host memory")
    return dataclasses.replace(config, host_tier_bytes=host_bytes) if not given else config


@dataclass(slots=True, frozen=True)
class Tiers:
    """L0 and the host tier (either None: off), built once by build_tiers and handed to the write-back, which fills
    them, and to the engine's parts, from which requests are placed."""

    l0: L0Tier | None
    host: HostTier | None


def wire_tiers(l0: L0Tier | None, host: HostTier | None) -> Tiers:
    """The two tiers, L0 over the host tier: what L0 evicts moves to the host tier, and the host tier counts L0's
    chunks as held when it evicts (a host chunk whose parent L0 holds is no orphan)."""
    if l0 is not None and host is not None:
        l0.spill = host.add
        host.held_elsewhere = l0.__contains__
    return Tiers(l0, host)


def build_tiers(config: TierSettings, model, geometry, store: ChunkStore) -> Tiers:
    """L0 and the host tier for a sized config (size_tiers), wired to each other (wire_tiers); no tier without
    a cache."""
    l0 = l0_tier_for(config.l0_bytes, config.kv_cache_bits, store)
    if isinstance(store, NullStore):  # every request runs without a cache
        return Tiers(None, None)
    slab_shape = (geometry.num_layers, geometry.num_kv_heads, config.chunk_size, geometry.head_dim)
    host = host_tier_for(config.host_tier_bytes or 0, slab_shape, model.dtype, model.device, config.kv_cache_bits)
    return wire_tiers(l0, host)
