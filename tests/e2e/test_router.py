"""The router in front of two real replicas (daemon + service each, the tiny random Llama, byte tokenizer):
identity, prefix routing from the daemons' events, salts, round-robin, restarts, a flood of events, refusals."""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kvboost.v1 import inference_pb2 as pb
from tests.conftest import pick_free_port, wait_for
from tests.daemon_support import cache_stub, make_chunk, store_chunks
from tests.e2e.daemon_process import DaemonProcess, start_daemon
from tests.e2e.router_process import STATS_INTERVAL_S, RouterProcess, run_router, start_router
from tests.e2e.service_process import ServiceProcess, generate, start_service
from tests.e2e.stack_process import reference_ids, save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHUNK_SIZE = 32
EVENT_HISTORY = 64  # replica 0's daemon: a Store of more chunks than this outruns any watcher


def document(topic: str) -> str:
    """About 400 bytes (one token per byte): a dozen whole chunks."""
    return "".join(f"Note {index} on the {topic}: the ferry leaves gate {index % 7} at {6 + index}:15. "
                   for index in range(8))


@dataclass
class Replicas:
    """Two replicas and the router in front of them (restartable)."""

    tmp_path: Path
    model_dir: Path
    daemons: list[DaemonProcess]
    services: list[ServiceProcess]
    router: RouterProcess | None = None
    router_port: int = field(default_factory=pick_free_port)
    metrics_port: int = field(default_factory=pick_free_port)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [(service.address, daemon.address) for service, daemon in zip(self.services, self.daemons)]

    def start_router(self, *extra: str) -> RouterProcess:
        self.router = start_router(self.pairs, self.router_port, self.metrics_port, self.tmp_path / "router.log",
                                   *extra)
        return self.router

    def requests_served(self) -> list[int]:
        counts = []
        for service in self.services:
            with service.stub() as stub:
                counts.append(stub.Stats(pb.ServiceStatsRequest(), timeout=10).requests)
        return counts

    def indexed(self, index: int) -> float:
        return self.router.metric("kvboost_router_replica_indexed_chunks", self.services[index].address)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("router")
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    setup = Replicas(tmp_path, model_dir, [], [])
    try:
        for index in range(2):
            history = ("--event-history", str(EVENT_HISTORY)) if index == 0 else ()
            setup.daemons.append(start_daemon(tmp_path / f"lmdb-{index}", pick_free_port(), *history))
            setup.services.append(start_service(str(model_dir), setup.daemons[-1].address, pick_free_port(),
                                                tmp_path / f"service-{index}.log", "--chunk-size", str(CHUNK_SIZE)))
        setup.start_router()
        yield setup
    finally:  # what runs at the end, tests having restarted some of it
        for process in [setup.router] + setup.services + setup.daemons:
            if process is not None and process.process.poll() is None:
                process.terminate()


def warm_directly(service: ServiceProcess, text: str, cache_salt: str = "") -> pb.WarmResult:
    with service.stub() as stub:
        return stub.Warm(pb.WarmRequest(text=text, cache_salt=cache_salt), timeout=60)


def wait_until_indexed(replicas: Replicas, index: int, at_least: float) -> None:
    wait_for(lambda: replicas.indexed(index) >= at_least, f"replica {index}'s chunks in the router's index")


def test_greedy_output_through_the_router_is_the_replicas_and_plain_generates(replicas):
    prompt = document("identity") + "Question: which gate?"
    with replicas.router.stub() as stub:
        _, routed = generate(stub, prompt, max_new_tokens=12, mode=pb.PREFIX_CACHE)
    with replicas.services[0].stub() as stub:
        _, direct = generate(stub, prompt, max_new_tokens=12, mode=pb.PREFIX_CACHE)
    assert list(routed.output_token_ids) == list(direct.output_token_ids)
    assert list(routed.output_token_ids) == reference_ids(replicas.model_dir, prompt, 12)


def test_a_question_goes_to_the_replica_its_document_was_warmed_on(replicas):
    text = document("lighthouse")
    before = replicas.indexed(1)
    warmed = warm_directly(replicas.services[1], text)  # straight to replica 1: only its daemon's events tell
    wait_until_indexed(replicas, 1, before + warmed.chunks_stored)
    served_before = replicas.requests_served()
    with replicas.router.stub() as stub:
        results = [generate(stub, text + f"Question {turn}: when?", max_new_tokens=2)[1] for turn in range(3)]
    served = [after - earlier for after, earlier in zip(replicas.requests_served(), served_before)]
    assert served == [0, 3]
    assert all(result.cached_tokens >= warmed.token_count - warmed.token_count % CHUNK_SIZE for result in results)


def test_a_salted_question_goes_where_that_salt_was_warmed(replicas):
    text, salt = document("island camp"), "tenant=alice;salt="
    before = replicas.indexed(0)
    warmed = warm_directly(replicas.services[0], text, cache_salt=salt)
    wait_until_indexed(replicas, 0, before + warmed.chunks_stored)
    served_before = replicas.requests_served()
    with replicas.router.stub() as stub:
        _, salted = generate(stub, text + "When?", max_new_tokens=2, cache_salt=salt)
        _, unsalted = generate(stub, text + "When?", max_new_tokens=2)
    # Unsalted, no whole chunk of it is cached anywhere (a few leading tokens may be shared with other notes).
    assert salted.cached_tokens >= warmed.token_count - warmed.token_count % CHUNK_SIZE
    assert unsalted.cached_tokens < CHUNK_SIZE
    assert [after - earlier for after, earlier in zip(replicas.requests_served(), served_before)][0] >= 1


def test_round_robin_alternates(replicas, tmp_path):
    router = start_router(replicas.pairs, pick_free_port(), pick_free_port(), tmp_path / "round-robin.log",
                          "--policy", "round-robin")
    try:
        order = []
        with router.stub() as stub:
            for turn in range(4):
                before = replicas.requests_served()
                generate(stub, f"Round {turn}.", max_new_tokens=1)
                order.append([after - earlier for after, earlier in zip(replicas.requests_served(), before)].index(1))
        assert order == [0, 1, 0, 1]
    finally:
        router.terminate()


def test_a_restarted_router_rebuilds_its_index_from_snapshots(replicas):
    assert replicas.router.terminate() == 0
    text = document("west marina")
    # On replica 1, while no router runs: no event reaches one. (A fresh router with nothing indexed would send
    # the question to replica 0, the first of equals.)
    warmed = warm_directly(replicas.services[1], text)
    replicas.start_router()
    wait_until_indexed(replicas, 1, warmed.chunks_stored)
    assert replicas.router.metric("kvboost_router_replica_resyncs", replicas.services[1].address) == 1
    served_before = replicas.requests_served()
    with replicas.router.stub() as stub:
        _, result = generate(stub, text + "When?", max_new_tokens=2)
    assert result.cached_tokens >= warmed.token_count - warmed.token_count % CHUNK_SIZE
    assert [after - earlier for after, earlier in zip(replicas.requests_served(), served_before)] == [0, 1]


def test_a_flood_of_events_is_lost_resynced_and_indexed(replicas):
    address = replicas.services[0].address
    resyncs, before = replicas.router.metric("kvboost_router_replica_resyncs", address), replicas.indexed(0)
    flood = [make_chunk(f"flood {index}", 64) for index in range(3 * EVENT_HISTORY)]
    with cache_stub(replicas.daemons[0].address) as stub:
        store_chunks(stub, flood)  # one commit: more events than the daemon's history holds
    wait_until_indexed(replicas, 0, before + len(flood))
    assert replicas.router.metric("kvboost_router_replica_resyncs", address) == resyncs + 1
    assert replicas.router.metric("kvboost_router_replica_events_live", address) == 1


def test_a_restarted_daemon_is_resynced_and_its_replica_found_again(replicas):
    address = replicas.services[1].address
    text = document("fish market")
    warmed = warm_directly(replicas.services[1], text)  # where this router sent more requests: only its index
    wait_until_indexed(replicas, 1, warmed.chunks_stored)
    resyncs = replicas.router.metric("kvboost_router_replica_resyncs", address)
    daemon = replicas.daemons[1]
    assert daemon.kill() == -9
    replicas.daemons[1] = start_daemon(replicas.tmp_path / "lmdb-1", int(daemon.address.rsplit(":", 1)[1]))
    wait_for(lambda: replicas.router.metric("kvboost_router_replica_resyncs", address) == resyncs + 1,
             "the router's resync with the new incarnation")
    # The service finds its daemon again by itself (a request may run degraded, without the cache, until then).
    whole_chunks = warmed.token_count - warmed.token_count % CHUNK_SIZE
    with replicas.services[1].stub() as stub:
        wait_for(lambda: generate(stub, text + "When?", max_new_tokens=2)[1].cached_tokens >= whole_chunks,
                 "replica 1 to serve from its restarted daemon")
    time.sleep(3 * STATS_INTERVAL_S)  # the router's next Stats read sees it no longer degraded
    assert replicas.router.metric("kvboost_router_replica_degraded", address) == 0
    served_before = replicas.requests_served()
    expected_before = replicas.router.metric("kvboost_router_expected_exact_tokens")
    with replicas.router.stub() as stub:
        _, result = generate(stub, text + "When?", max_new_tokens=2)
    assert result.cached_tokens >= whole_chunks
    # Chosen for what the resynced index says replica 1 holds, not by a tie-break.
    assert replicas.router.metric("kvboost_router_expected_exact_tokens") - expected_before >= whole_chunks
    assert [after - earlier for after, earlier in zip(replicas.requests_served(), served_before)] == [0, 1]


def test_replicas_with_different_chunk_sizes_are_refused_at_start(replicas, tmp_path):
    odd = start_service(str(replicas.model_dir), replicas.daemons[0].address, pick_free_port(),
                        tmp_path / "odd-service.log", "--chunk-size", str(CHUNK_SIZE // 2))
    try:
        refused = run_router([replicas.pairs[0], (odd.address, replicas.daemons[0].address)], pick_free_port())
    finally:
        odd.terminate()
    assert refused.returncode == 2
    assert "replicas differ in namespace or chunk size" in refused.stderr
    assert f"chunk_size {CHUNK_SIZE // 2}" in refused.stderr and odd.address in refused.stderr


@pytest.mark.slow
def test_a_replica_killed_mid_stream_fails_that_stream_and_later_requests_go_elsewhere(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    with ExitStack() as stack:
        pairs, services = [], []
        # At exit, whichever service processes the list then holds (replica 0 is replaced below).
        stack.callback(lambda: [service.terminate() for service in services if service.process.poll() is None])
        for index in range(2):
            daemon = start_daemon(tmp_path / f"lmdb-{index}", pick_free_port())
            stack.callback(daemon.terminate)
            services.append(start_service(str(model_dir), daemon.address, pick_free_port(),
                                          tmp_path / f"service-{index}.log", "--chunk-size", str(CHUNK_SIZE)))
            pairs.append((services[-1].address, daemon.address))
        router = start_router(pairs, pick_free_port(), pick_free_port(), tmp_path / "router.log",
                              "--policy", "round-robin")
        stack.callback(router.terminate)
        with router.stub() as stub:
            # Round-robin's first request goes to replica 0: a long one, killed under it after its first event.
            stream = stub.Generate(pb.GenerateRequest(prompt="Long story: ", max_new_tokens=4000, ignore_eos=True),
                                   timeout=120)
            next(stream)
            assert services[0].kill() == -9
            with pytest.raises(grpc.RpcError) as failed:
                list(stream)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"replica 0 ({services[0].address}) failed after" in failed.value.details()
            # Later requests go to replica 1, whatever round-robin's turn.
            for turn in range(3):
                assert generate(stub, f"After {turn}.", max_new_tokens=1)[1].generated_tokens == 1
            assert router.metric("kvboost_router_replica_healthy", services[0].address) == 0
            # Brought back on its port, replica 0 is probed, found serving and takes its turns again.
            services[0] = start_service(str(model_dir), pairs[0][1], int(services[0].address.rsplit(":", 1)[1]),
                                        tmp_path / "service-0-again.log", "--chunk-size", str(CHUNK_SIZE))
            wait_for(lambda: router.metric("kvboost_router_replica_healthy", services[0].address) == 1,
                     "replica 0 back in the router's rotation")
            with services[0].stub() as direct:
                before = direct.Stats(pb.ServiceStatsRequest(), timeout=10).requests
                for turn in range(2):
                    generate(stub, f"Back {turn}.", max_new_tokens=1)
                assert direct.Stats(pb.ServiceStatsRequest(), timeout=10).requests == before + 1
