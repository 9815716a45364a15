"""Decode steps replayed from CUDA graphs: the buckets, the padding rows and the inputs, checked on the CPU as a dry run
(the same buckets run eagerly) against the eager lean step, and captured for real on a GPU (`-m gpu`)."""
from __future__ import annotations

import pytest
import torch

from inference_service.model import graph_step
from inference_service.model.lean_step import LeanStep
from inference_service.model.graph_step import GraphSteps, bucket, graph_support
from inference_service.kv_memory.kv_buffers import kv_geometry
from inference_service.model.model_step import ModelStep
from inference_service.kv_memory.slot_buffers import SlotBuffers
from inference_service.model.step_runner import StepRunner, choose_runner, probe_mismatch


def test_buckets_are_powers_of_two_within_their_bounds():
    assert [bucket(v, 1, 24) for v in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    assert [bucket(v, 256, 1000) for v in (1, 256, 257, 600, 1000)] == [256, 256, 512, 1000, 1000]


def test_graphs_need_cuda_and_the_lean_step(tiny_llama):
    model, _ = tiny_llama
    assert "CUDA" in graph_support(torch.device("cpu"), LeanStep(model))
    assert "transformers" in graph_support(torch.device("cuda"), ModelStep(model))
    assert graph_support(torch.device("cuda"), LeanStep(model)) == ""


def buffers_pair(model, num_slots=6, capacity=300):
    geometry = kv_geometry(model.config)
    generator = torch.Generator().manual_seed(3)
    pair = [SlotBuffers(geometry, num_slots, capacity, model.device, model.dtype) for _ in range(2)]
    noise = torch.randn(pair[0].keys.shape, generator=generator).to(model.device, model.dtype)
    step = LeanStep(model)
    for slots in pair:
        slots.keys.copy_(noise)
        slots.values.copy_(noise.flip(-1))
        for slot in range(num_slots):
            slots.written(slot, 20)
    return (StepRunner(pair[0], step),
            StepRunner(pair[1], step, GraphSteps(step, pair[1].keys, pair[1].values, capacity, eager=True)))


@pytest.mark.parametrize("rows", [{0: (5, 20)}, {2: (7, 3)}, {1: (9, 21), 4: (11, 280), 5: (1, 40)}])
def test_a_bucket_step_is_the_exact_step_on_every_decoding_row(tiny_llama, rows):
    """Padding rows and masked columns change nothing but rounding (the CPU's SDPA blocks columns differently)."""
    model, _ = tiny_llama
    eager, bucketed = buffers_pair(model)
    for _ in range(3):  # the same rows step on: positions move, the bucket stays
        expected, got = eager.decode(rows), bucketed.decode(rows)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        rows = {slot: (token + 1, position + 1) for slot, (token, position) in rows.items()}
    for slot, (_, position) in rows.items():  # the columns each row wrote (past them both zero differently)
        torch.testing.assert_close(bucketed.buffers.keys[:, slot, :, :position],
                                   eager.buffers.keys[:, slot, :, :position], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bucketed.buffers.values[:, slot, :, :position],
                                   eager.buffers.values[:, slot, :, :position], atol=1e-5, rtol=1e-5)
    untouched = [slot for slot in range(6) if slot not in rows]
    assert torch.equal(bucketed.buffers.keys[:, untouched, :, :20], eager.buffers.keys[:, untouched, :, :20]), \
        "idle rows wrote"
    assert bucketed.graphs.num_replays == 3


def test_steps_past_the_captured_buckets_run_eagerly(tiny_llama, monkeypatch):
    monkeypatch.setattr(graph_step, "MAX_GRAPHS", 1)
    model, _ = tiny_llama
    eager, bucketed = buffers_pair(model)
    for rows in ({0: (5, 20)}, {3: (6, 20)}):  # the second needs a second bucket
        torch.testing.assert_close(bucketed.decode(rows), eager.decode(rows), atol=1e-5, rtol=1e-5)
    assert bucketed.graphs.num_replays == 1


@pytest.mark.gpu
def test_captured_graphs_replay_the_eager_step_bitwise(tiny_llama):
    import copy

    model = copy.deepcopy(tiny_llama[0]).to("cuda")
    step = LeanStep(model)
    assert probe_mismatch(model, step, graphs=True) == ""
    geometry = kv_geometry(model.config)
    runner = choose_runner(model, SlotBuffers(geometry, 4, 300, model.device, model.dtype))
    assert runner.name == "lean+graphs" and runner.graphs is not None


def test_a_capture_that_fails_while_serving_leaves_the_step_eager(tiny_llama, monkeypatch):
    model, _ = tiny_llama
    eager, bucketed = buffers_pair(model)

    def fails(self, num_rows, columns):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(GraphSteps, "_capture", fails)
    for position in (20, 21):  # the failed step, then the next: both eager, both exact
        rows = {1: (5, position)}
        assert torch.equal(eager.decode(rows), bucketed.decode(rows))
    assert "out of memory" in bucketed.graphs.failure and not bucketed.graphs.can_run(1, 22)
    assert bucketed.graphs.num_replays == 0


@pytest.mark.gpu
def test_a_capture_succeeds_while_another_thread_copies_k_v_off_the_device(tiny_llama):
    """The write-back thread encodes chunks (device -> host copies, allocations) while the step loop captures a bucket:
    neither may fail (in CUDA's default capture mode both did: the copy raised, the capture was invalidated)."""
    import copy
    import threading

    model = copy.deepcopy(tiny_llama[0]).to("cuda")
    geometry = kv_geometry(model.config)
    buffers = SlotBuffers(geometry, 6, 300, model.device, model.dtype)
    step = LeanStep(model)
    graphs = GraphSteps(step, buffers.keys, buffers.values, 300)
    runner = StepRunner(buffers, step, graphs)
    source = torch.randn(4, 64, 1024, device="cuda")
    stop, started, errors = threading.Event(), threading.Event(), []

    def write_back():
        try:
            while not stop.is_set():
                host = (source * 2).cpu()  # an allocation on the device and a synchronous copy, as encoding does
                started.set()
                assert host.shape == source.shape
        except Exception as error:  # noqa: BLE001 - the test reports whatever the copy raised
            errors.append(error)

    thread = threading.Thread(target=write_back)
    thread.start()
    try:
        assert started.wait(30), "the copying thread never copied"
        for rows in ({0: (5, 20)}, {0: (5, 20), 1: (6, 30)}, {slot: (7, 40) for slot in range(5)}):
            runner.decode(rows)  # each shape captures a new bucket while the copies run
    finally:
        stop.set()
        thread.join()
    assert errors == [] and graphs.failure == ""
    assert len(graphs._graphs) == 3 and all(g.graph is not None for g in graphs._graphs.values())
