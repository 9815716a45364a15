"""K/V slots and L0 sized from the machine when auto (None): the device's free memory on CUDA, RAM on a CPU."""
from __future__ import annotations

import pytest

from inference_service.kv_memory.memory_plan import GIB, cgroup_room, mem_available, plan_memory, tokens_held

SMOLLM2_FP32_TOKEN = 46_080  # K/V bytes of one token: 30 layers x 2 x 3 kv heads x 64 dims x 4 bytes
LLAMA8B_BF16_TOKEN = 131_072  # 32 layers x 2 x 8 kv heads x 128 dims x 2 bytes


def test_on_a_cpu_each_auto_tier_takes_a_quarter_of_the_ram_available():
    plan = plan_memory("cpu", 20 * GIB, 24 * GIB, None, None)
    assert (plan.kv_cache_bytes, plan.l0_bytes) == (5 * GIB, 5 * GIB)
    assert "20.0 GiB of RAM available" in plan.basis


def test_six_2k_token_smollm2_documents_fit_in_l0_by_default_on_a_24_gib_machine():
    documents = 6 * 2048 * SMOLLM2_FP32_TOKEN  # ~566 MB, which the fixed 512 MiB did not hold
    for available in (12 * GIB, 23 * GIB):  # other processes may hold half of the machine
        assert plan_memory("cpu", available, 24 * GIB, None, None).l0_bytes > documents


def test_on_cuda_the_free_memory_less_the_reserve_is_shared_and_a_number_wins():
    # An H200-sized device with 8B weights loaded: 123 GiB free of 140; the reserve is 14 GiB.
    plan = plan_memory("cuda", 123 * GIB, 140 * GIB, None, None)
    assert plan.kv_cache_bytes == plan.l0_bytes == int(109 * GIB / 2)
    assert tokens_held(plan.l0_bytes, LLAMA8B_BF16_TOKEN) >= 32_768  # a 32k-token prompt repeated is held whole
    assert plan_memory("cuda", 123 * GIB, 140 * GIB, 8 * GIB, None).l0_bytes == 101 * GIB  # the rest goes to L0
    assert plan_memory("cuda", 123 * GIB, 140 * GIB, None, 16 * GIB).kv_cache_bytes == 93 * GIB
    given = plan_memory("cuda", 123 * GIB, 140 * GIB, 8 * GIB, 1 * GIB)
    assert (given.kv_cache_bytes, given.l0_bytes) == (8 * GIB, 1 * GIB)
    small = plan_memory("cuda", 10 * GIB, 16 * GIB, None, None)  # the 2 GiB floor of the reserve
    assert small.kv_cache_bytes == small.l0_bytes == 4 * GIB
    assert plan_memory("cuda", 123 * GIB, 140 * GIB, 200 * GIB, None).l0_bytes == 0  # slots take it all: L0 off


@pytest.mark.parametrize("free, l0, message", [
    (2 * GIB, None, "leave 0 bytes for K/V slots"),  # nothing beyond the reserve
    (123 * GIB, 120 * GIB, "--l0-bytes 128849018880 leave 0 bytes"),
])
def test_auto_slots_that_get_nothing_are_refused_with_what_to_set(free, l0, message):
    with pytest.raises(ValueError, match="set --kv-cache-bytes to a number, or lower --l0-bytes") as error:
        plan_memory("cuda", free, 140 * GIB, None, l0)
    assert message in str(error.value)


def test_mem_available_is_read_from_proc_meminfo_text():
    text = "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n"
    assert mem_available(text) == 20_000_000 * 1024
    assert mem_available("MemTotal: 1 kB\n") is None


def test_a_containers_memory_limit_bounds_what_auto_sees():
    # MemAvailable is the host's inside a container: the cgroup's limit less its usage is what this process may take.
    total = 24 * GIB
    assert cgroup_room("4294967296\n", "1073741824\n", total) == 3 * GIB  # v2: a 4 GiB limit, 1 GiB used
    assert cgroup_room("max\n", "1073741824\n", total) is None  # v2: no limit
    assert cgroup_room("9223372036854771712\n", "5\n", total) is None  # v1: its no-limit value
    assert cgroup_room("1073741824", "2147483648", total) == 0  # over its limit already: nothing to take
