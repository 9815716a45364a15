"""`python -m client.stack up|down|status`: the cache daemon, inference service and HTTP gateway as background processes.

By default the inference service and the HTTP gateway run in one process (`python -m kvboost_server`: the gateway
calls the servicer in process, and the service still serves its gRPC contract on --address), beside the cache
daemon: it streams more tokens/s at 8 and 16 clients with a lower TTFT than the gateway as a process of its own
(docs/benchmarks.md, "Against llama-server"). `--separate-gateway` runs the gateway as its own process over gRPC
(three processes), `--no-gateway` the daemon and the service only.

Pid files, logs and the LMDB data live under the run folder (default `.run/`); `up` waits on each
server's gRPC health service (and HTTP /health where it serves HTTP), `down` stops them in reverse order
(SIGTERM, then SIGKILL).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from client.cache_client import DEFAULT_DAEMON_ADDRESS
from client.healthcheck import check_health, wait_until_serving
from client.library import DEFAULT_ADDRESS

EXIT_OK, EXIT_FAILED = 0, 1
DEFAULT_GATEWAY_ADDRESS = "127.0.0.1:8000"
_LOG_TAIL_LINES = 30


@dataclass(slots=True, frozen=True)
class Component:
    """One process of the stack: its python module, address and files under the run folder."""

    name: str  # file stem: <name>.pid, <name>.log
    title: str
    module: str
    address: str
    arguments: tuple[str, ...]
    http_health: bool = False  # health is GET http://<address>/health (200 = serving), not gRPC health
    http_address: str = ""  # a gRPC server that also serves HTTP here: both must be serving

    def health(self, timeout: float = 2.0) -> str:
        """SERVING, another health status, or UNREACHABLE."""
        if self.http_health:
            return http_health_status(f"http://{self.address}/health", timeout)
        status = check_health(self.address, timeout=timeout)
        if status == "SERVING" and self.http_address:
            return http_health_status(f"http://{self.http_address}/health", timeout)
        return status

    def pid_file(self, run_dir: Path) -> Path:
        return run_dir / f"{self.name}.pid"

    def log_file(self, run_dir: Path) -> Path:
        return run_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.arguments]


def build_components(args: argparse.Namespace) -> list[Component]:
    """Daemon first, then the service and the gateway (one process, or two with --separate-gateway): the order of
    `up`; `down` goes in reverse."""
    run_dir = Path(args.run_dir).resolve()
    daemon_arguments = ["--data-dir", str(run_dir / "lmdb"), "--listen", args.daemon_address]
    if args.max_bytes is not None:
        daemon_arguments += ["--max-bytes", str(args.max_bytes)]
    service_arguments = ["--listen", args.address, "--cache-addr", args.daemon_address]
    if args.model:
        service_arguments += ["--model", args.model]
    components = [Component("daemon", "cache daemon", "cache_daemon", args.daemon_address,
                            tuple(daemon_arguments + args.daemon_arg))]
    if args.gateway and not args.separate_gateway:
        arguments = service_arguments + args.service_arg + ["--gateway", "--listen", args.gateway_address]
        components.append(Component("server", "inference service and HTTP gateway", "kvboost_server", args.address,
                                    tuple(arguments + args.gateway_arg), http_address=args.gateway_address))
        return components
    components.append(Component("service", "inference service", "inference_service", args.address,
                                tuple(service_arguments + args.service_arg)))
    if args.gateway:
        gateway_arguments = ["--listen", args.gateway_address, "--service-addr", args.address]
        components.append(Component("gateway", "HTTP gateway", "http_gateway", args.gateway_address,
                                    tuple(gateway_arguments + args.gateway_arg), http_health=True))
    return components


def http_health_status(url: str, timeout: float = 2.0) -> str:
    """SERVING when GET url answers 200, HTTP <code> for another answer, UNREACHABLE for none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return "SERVING" if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except (urllib.error.URLError, OSError):
        return "UNREACHABLE"


def wait_until_http_serving(url: str, deadline_s: float, is_alive=lambda: True) -> str:
    """Polls url until it answers 200, deadline_s passes or is_alive() turns false; returns the last status."""
    give_up_at = time.monotonic() + deadline_s
    status = "UNREACHABLE"
    while is_alive() and time.monotonic() < give_up_at:
        status = http_health_status(url, timeout=1.0)
        if status == "SERVING":
            break
        time.sleep(0.1)
    return status


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def is_running(pid: int, module: str) -> bool:
    """True when `pid` is a live (not zombie) process running `python -m module`."""
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            arguments = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            return False
        return state != "Z" and module.encode() in arguments
    try:  # no /proc (macOS): trust the pid file
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_pid(component: Component, run_dir: Path) -> int | None:
    pid = read_pid(component.pid_file(run_dir))
    return pid if pid is not None and is_running(pid, component.module) else None


def start(component: Component, run_dir: Path, timeout_s: float) -> int:
    """Starts the component in its own session with output to its log; waits until it is SERVING.

    Raises:
        RuntimeError: when the process exits or is not serving within `timeout_s`; it is stopped first.
    """
    log_path = component.log_file(run_dir)
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(component.command())}\n".encode())
        log.flush()
        process = subprocess.Popen(component.command(), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    component.pid_file(run_dir).write_text(f"{process.pid}\n")

    def is_alive() -> bool:
        return process.poll() is None

    give_up_at = time.monotonic() + timeout_s
    if component.http_health:
        status = wait_until_http_serving(f"http://{component.address}/health", timeout_s, is_alive)
    else:
        status = wait_until_serving(component.address, timeout_s, is_alive=is_alive)
        if status == "SERVING" and component.http_address:  # its HTTP listener opens once the model is loaded
            status = wait_until_http_serving(f"http://{component.http_address}/health",
                                             max(1.0, give_up_at - time.monotonic()), is_alive)
    if status == "SERVING":
        return process.pid
    reason = (f"exited with status {process.returncode}" if process.poll() is not None
              else f"not serving after {timeout_s:.0f} s (health: {status})")
    stop(component, run_dir, grace_s=5.0)
    raise RuntimeError(f"the {component.title} {reason}; last lines of {log_path}:\n{log_tail(log_path)}")


def stop(component: Component, run_dir: Path, grace_s: float) -> str:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; removes the pid file. Returns what happened."""
    pid_file = component.pid_file(run_dir)
    pid = read_pid(pid_file)
    if pid is None or not is_running(pid, component.module):
        pid_file.unlink(missing_ok=True)
        return "not running"
    os.kill(pid, signal.SIGTERM)
    outcome = "stopped"
    if not wait_for_exit(pid, component.module, grace_s):
        os.kill(pid, signal.SIGKILL)
        wait_for_exit(pid, component.module, 5.0)
        outcome = f"killed (still running {grace_s:g} s after SIGTERM)"
    pid_file.unlink(missing_ok=True)
    return outcome


def wait_for_exit(pid: int, module: str, timeout_s: float) -> bool:
    """Waits for `pid` to end: on a pidfd where the OS has them, else by polling. True when it ended."""
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while is_running(pid, module):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if pidfd is not None:
                select.select([pidfd], [], [], remaining)
            else:
                time.sleep(min(0.1, remaining))
            _maybe_reap(pid)
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _maybe_reap(pid: int) -> None:
    # Only when this process started it (tests calling main() in-process): collect the zombie.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def every_component(args: argparse.Namespace) -> list[Component]:
    """The components of every layout (daemon, server, service, gateway), each once."""
    found: dict[str, Component] = {}
    for layout in ({"gateway": True, "separate_gateway": False}, {"gateway": True, "separate_gateway": True}):
        for component in build_components(argparse.Namespace(**{**vars(args), **layout})):
            found.setdefault(component.name, component)
    return list(found.values())


def others_running(args: argparse.Namespace, run_dir: Path, components: list[Component]) -> list[Component]:
    """Running processes of this run folder that are not among `components` (another layout's)."""
    names = {component.name for component in components}
    return [component for component in every_component(args)
            if component.name not in names and running_pid(component, run_dir) is not None]


def command_up(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    (run_dir / "lmdb").mkdir(parents=True, exist_ok=True)
    components = build_components(args)
    others = others_running(args, run_dir, components)
    if others:  # its servers hold the ports this layout would take
        print(f"error: {', '.join(component.title for component in others)} already running from {run_dir} in "
              "another layout (--separate-gateway, --no-gateway or neither); stop the stack first with `make down` "
              "(or `python -m client.stack down`)", file=sys.stderr)
        return EXIT_FAILED
    for component in components:
        pid = running_pid(component, run_dir)
        if pid is not None:
            print(f"{component.title} already running (pid {pid}, {component.address})")
            continue
        print(f"starting the {component.title} on {component.address} (log {component.log_file(run_dir)}) ...",
              flush=True)
        try:
            pid = start(component, run_dir, args.timeout)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_FAILED
        print(f"{component.title} serving (pid {pid}, {component.address})")
    _write_state(run_dir, args)
    gateway = f", OpenAI-compatible HTTP gateway http://{args.gateway_address}/v1" if args.gateway else ""
    together = " (one process)" if args.gateway and not args.separate_gateway else ""
    print(f"stack up: inference service {args.address}{gateway}{together}, cache daemon {args.daemon_address}; "
          f"stop it with `make down` or `python -m client.stack down`")
    return EXIT_OK


def command_down(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    args = _with_state(args, run_dir)
    components = build_components(args)
    # Whatever else of this run folder still runs (a layout stack.json does not record: an `up` that failed half
    # way) goes first: the daemon is last in every layout.
    for component in list(reversed(others_running(args, run_dir, components))) + list(reversed(components)):
        print(f"{component.title}: {stop(component, run_dir, args.grace)}")
    (run_dir / "stack.json").unlink(missing_ok=True)
    return EXIT_OK


def command_status(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    all_serving = True
    components = build_components(_with_state(args, run_dir))
    width = max(len(component.title) for component in components)
    for component in components:
        pid = running_pid(component, run_dir)
        health = component.health() if pid is not None else "-"
        all_serving &= health == "SERVING"
        print(f"{component.title:<{width}} {'pid ' + str(pid) if pid else 'not running':<12} "
              f"{component.address:<22} {health}")
    return EXIT_OK if all_serving else EXIT_FAILED


def _write_state(run_dir: Path, args: argparse.Namespace) -> None:
    # `down` and `status` read the addresses `up` used, whatever flags they are given themselves.
    state = {"address": args.address, "daemon_address": args.daemon_address,
             "gateway_address": args.gateway_address, "gateway": args.gateway,
             "separate_gateway": args.separate_gateway}
    (run_dir / "stack.json").write_text(json.dumps(state) + "\n")


def _with_state(args: argparse.Namespace, run_dir: Path) -> argparse.Namespace:
    try:
        state = json.loads((run_dir / "stack.json").read_text())
    except (OSError, ValueError):
        return args
    state.setdefault("separate_gateway", True)  # written before the one-process default: three processes
    return argparse.Namespace(**{**vars(args), **state})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client.stack", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--run-dir", default=os.environ.get("KVBOOST_RUN_DIR", ".run"),
                        help="pid files, logs and LMDB data (env KVBOOST_RUN_DIR, default %(default)s)")
    parser.add_argument("--address", default=os.environ.get("KVBOOST_ADDRESS", DEFAULT_ADDRESS),
                        help="inference service listen address (env KVBOOST_ADDRESS, default %(default)s)")
    parser.add_argument("--daemon-address", default=os.environ.get("KVBOOST_DAEMON_ADDRESS", DEFAULT_DAEMON_ADDRESS),
                        help="cache daemon listen address (env KVBOOST_DAEMON_ADDRESS, default %(default)s)")
    parser.add_argument("--gateway-address", default=os.environ.get("KVBOOST_GATEWAY_LISTEN", DEFAULT_GATEWAY_ADDRESS),
                        help="HTTP gateway listen address (env KVBOOST_GATEWAY_LISTEN, default %(default)s)")
    parser.add_argument("--no-gateway", dest="gateway", action="store_false",
                        help="start the daemon and the service only, without the HTTP gateway")
    parser.add_argument("--separate-gateway", action="store_true",
                        help="run the HTTP gateway as its own process, calling the service over gRPC (three processes); "
                             "by default the gateway and the service share one process (python -m kvboost_server)")
    parser.add_argument("--model", help="model name or path (default: the service's, env KVBOOST_MODEL)")
    parser.add_argument("--max-bytes",
                        help="daemon byte budget, e.g. 512M or 8G (default: the daemon's, env KVBOOST_MAX_BYTES)")
    parser.add_argument("--daemon-arg", action="append", default=[], help="extra daemon flag (repeatable)")
    parser.add_argument("--service-arg", action="append", default=[], help="extra service flag (repeatable)")
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="extra gateway flag (repeatable; in one process its --service-addr, --token and --tls "
                             "do not apply)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for each server to be SERVING (default %(default)s)")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds between SIGTERM and SIGKILL on down (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"up": command_up, "down": command_down, "status": command_status}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
