"""Only the engine's step loop runs torch ops on an OpenMP team of its own (inference_service/model/threads.py)."""
from __future__ import annotations


def test_helper_threads_run_torch_ops_without_a_team_of_their_own_and_the_calling_thread_keeps_its_count() -> None:
    # model/threads.py: only the step loop may own an OpenMP team (a second one makes libgomp stop spinning).
    import threading

    import torch

    from inference_service.model.threads import confine_to_this_thread
    from inference_service.reuse.writeback import WriteBack
    from inference_service.store.protocol import NullStore

    before, seen = torch.get_num_threads(), {}

    def helper() -> None:
        confine_to_this_thread()
        seen["helper"] = torch.get_num_threads()

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert seen["helper"] == 1 and torch.get_num_threads() == before
    writeback = WriteBack(NullStore(), 16, lambda chunks, size: None)
    try:
        assert writeback._executor.submit(torch.get_num_threads).result(timeout=30) == 1
    finally:
        writeback.close()


def test_the_store_thread_runs_below_the_step_loops_priority_and_the_l0_thread_does_not() -> None:
    # On two cores a write-back's encoding took CPU time from the next request's prefill (bench_long_doc's rounds).
    import os
    import sys
    import threading

    import pytest

    from inference_service.reuse.writeback import WriteBack
    from inference_service.store.protocol import NullStore

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are Linux's")
    nice = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # noqa: E731
    ours = nice()
    writeback = WriteBack(NullStore(), 16, lambda chunks, size: None)
    try:
        assert writeback._executor.submit(nice).result(timeout=30) == min(19, ours + 10)
        assert writeback._l0_executor.submit(nice).result(timeout=30) == ours
        assert nice() == ours  # the calling thread keeps its own
    finally:
        writeback.close()
