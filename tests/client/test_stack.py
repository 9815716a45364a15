"""client.stack with stand-in server processes: start and health wait, idempotent up, status, graceful down."""
from __future__ import annotations

from pathlib import Path

import pytest

from client import stack
from tests.conftest import pick_free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE_MODULE = "tests.stack_fake_server"


def parse(run_dir: Path, *extra: str):
    return stack.build_parser().parse_args(["up", "--run-dir", str(run_dir), "--timeout", "30", *extra])


@pytest.fixture()
def fake_stack(monkeypatch, tmp_path):
    """Swaps the real servers for stand-ins; yields (run_dir, daemon flags, service flags) to adjust;
    always stops what was started."""
    monkeypatch.chdir(ROOT)
    daemon_address, service_address = (f"127.0.0.1:{pick_free_port()}" for _ in range(2))
    flags = {"daemon": ["--listen", daemon_address], "service": ["--listen", service_address]}

    def build_components(args):
        return [
            stack.Component("daemon", "cache daemon", FAKE_MODULE, daemon_address, tuple(flags["daemon"])),
            stack.Component("service", "inference service", FAKE_MODULE, service_address, tuple(flags["service"])),
        ]

    monkeypatch.setattr(stack, "build_components", build_components)
    run_dir = tmp_path / "run"
    try:
        yield run_dir, flags
    finally:
        stack.command_down(argparse_for(run_dir, grace=0.5))


def argparse_for(run_dir: Path, grace: float = 5.0):
    return stack.build_parser().parse_args(["down", "--run-dir", str(run_dir), "--grace", str(grace)])


def test_components_carry_the_real_flags(tmp_path) -> None:
    flags = ("--address", "127.0.0.1:7001", "--daemon-address", "127.0.0.1:7002", "--model", "m", "--max-bytes", "1000",
             "--service-arg=--chunk-size=64", "--daemon-arg=--metrics-port=0", "--gateway-address", "127.0.0.1:7003",
             "--gateway-arg=--timeout=30")
    daemon, server = stack.build_components(parse(tmp_path, *flags))  # the default: service and gateway together
    assert daemon.command()[1:] == ["-m", "cache_daemon", "--data-dir", str(tmp_path.resolve() / "lmdb"),
                                    "--listen", "127.0.0.1:7002", "--max-bytes", "1000", "--metrics-port=0"]
    assert server.command()[1:] == ["-m", "kvboost_server", "--listen", "127.0.0.1:7001", "--cache-addr",
                                    "127.0.0.1:7002", "--model", "m", "--chunk-size=64", "--gateway", "--listen",
                                    "127.0.0.1:7003", "--timeout=30"]
    assert (server.address, server.http_address, server.http_health) == ("127.0.0.1:7001", "127.0.0.1:7003", False)

    daemon, service, gateway = stack.build_components(parse(tmp_path, *flags, "--separate-gateway"))
    assert service.command()[1:] == ["-m", "inference_service", "--listen", "127.0.0.1:7001",
                                     "--cache-addr", "127.0.0.1:7002", "--model", "m", "--chunk-size=64"]
    assert gateway.command()[1:] == ["-m", "http_gateway", "--listen", "127.0.0.1:7003", "--service-addr",
                                     "127.0.0.1:7001", "--timeout=30"]
    assert gateway.http_health and not service.http_health and not service.http_address


def test_no_gateway_leaves_it_out(tmp_path) -> None:
    for extra in ((), ("--separate-gateway",)):
        assert [component.name for component in stack.build_components(parse(tmp_path, "--no-gateway", *extra))] == [
            "daemon", "service"]


def test_defaults_leave_model_and_budget_to_the_servers(tmp_path, monkeypatch) -> None:
    for name in ("KVBOOST_ADDRESS", "KVBOOST_DAEMON_ADDRESS", "KVBOOST_RUN_DIR", "KVBOOST_GATEWAY_LISTEN"):
        monkeypatch.delenv(name, raising=False)
    args = stack.build_parser().parse_args(["up"])
    daemon, server = stack.build_components(args)
    assert (args.run_dir, daemon.address, server.address, server.http_address) == (
        ".run", "127.0.0.1:50052", "127.0.0.1:50051", "127.0.0.1:8000")
    assert "--max-bytes" not in daemon.arguments and "--model" not in server.arguments


def test_a_stack_started_before_the_one_process_default_is_stopped_as_three(tmp_path) -> None:
    tmp_path.joinpath("stack.json").write_text('{"address": "127.0.0.1:7001", "daemon_address": "127.0.0.1:7002", '
                                               '"gateway_address": "127.0.0.1:7003", "gateway": true}')
    args = stack._with_state(stack.build_parser().parse_args(["down", "--run-dir", str(tmp_path)]), tmp_path)
    assert [component.name for component in stack.build_components(args)] == ["daemon", "service", "gateway"]


def test_up_is_idempotent_status_reports_down_stops(fake_stack, capsys) -> None:
    run_dir, _ = fake_stack
    assert stack.command_up(parse(run_dir)) == 0
    out = capsys.readouterr().out
    assert "cache daemon serving (pid " in out and "inference service serving (pid " in out
    pids = {name: stack.read_pid(run_dir / f"{name}.pid") for name in ("daemon", "service")}
    assert all(pids.values())
    assert (run_dir / "lmdb").is_dir() and (run_dir / "daemon.log").is_file()

    assert stack.command_up(parse(run_dir)) == 0
    out = capsys.readouterr().out
    assert f"cache daemon already running (pid {pids['daemon']}" in out
    assert f"inference service already running (pid {pids['service']}" in out

    assert stack.command_status(argparse_for(run_dir)) == 0
    assert capsys.readouterr().out.count("SERVING") == 2

    assert stack.command_down(argparse_for(run_dir)) == 0
    assert capsys.readouterr().out == "inference service: stopped\ncache daemon: stopped\n"
    assert not (run_dir / "daemon.pid").exists() and not (run_dir / "service.pid").exists()
    assert not any(stack.is_running(pid, FAKE_MODULE) for pid in pids.values())
    assert stack.command_status(argparse_for(run_dir)) == 1
    assert capsys.readouterr().out.count("not running") == 2


def test_a_server_that_exits_fails_up_with_its_log_tail(fake_stack, capsys) -> None:
    run_dir, flags = fake_stack
    flags["service"].append("--fail")
    assert stack.command_up(parse(run_dir)) == 1
    err = capsys.readouterr().err
    assert "error: the inference service exited with status 3; last lines of" in err
    assert "fake server: cannot open the data folder" in err
    assert not (run_dir / "service.pid").exists()


def test_down_kills_a_server_that_ignores_sigterm(fake_stack, capsys) -> None:
    run_dir, flags = fake_stack
    flags["daemon"].append("--ignore-sigterm")
    assert stack.command_up(parse(run_dir)) == 0
    capsys.readouterr()
    assert stack.command_down(argparse_for(run_dir, grace=0.5)) == 0
    assert capsys.readouterr().out == ("inference service: stopped\n"
                                       "cache daemon: killed (still running 0.5 s after SIGTERM)\n")


def test_a_stale_pid_file_is_not_taken_for_a_running_server(fake_stack, capsys) -> None:
    run_dir, _ = fake_stack
    run_dir.mkdir(parents=True)
    (run_dir / "daemon.pid").write_text("1\n")  # pid 1 runs, but it is not the daemon
    assert stack.command_up(parse(run_dir)) == 0
    assert "starting the cache daemon" in capsys.readouterr().out
    assert stack.read_pid(run_dir / "daemon.pid") != 1
