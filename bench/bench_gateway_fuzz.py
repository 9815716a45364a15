"""The gateway under a flood of random, extreme and malformed requests on SmolLM2 (max_tokens <= 4): every one
answered, none with a 5xx, an ordinary greedy request answering the same before and after, and each process's
resident memory sampled as the flood goes on (it should level off, not grow with the request count).

    flock /tmp/kvboost-bench.lock python bench/bench_gateway_fuzz.py --requests 10000 --clients 4
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000, help="fuzzed requests in all")
    parser.add_argument("--clients", type=int, default=4, help="concurrent HTTP clients")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="'tiny': the random 2-layer test Llama")
    parser.add_argument("--seed", type=int, default=20261125, help="seed of the request generator")
    parser.add_argument("--samples", type=int, default=10, help="RSS samples over the flood")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the stack's files go (default: a temp dir)")
    args = parser.parse_args(argv)

    import tempfile

    import httpx

    from tests.conftest import pick_free_port
    from tests.e2e.daemon_process import start_daemon
    from tests.e2e.gateway_process import running_gateways
    from tests.e2e.service_process import running_service
    from tests.e2e.stack_process import save_tiny_model
    from tests.e2e.test_gateway_fuzz import ENDPOINTS, random_body

    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="kvboost-fuzz-"))
    model = str(save_tiny_model(work_dir / "tiny-model")) if args.model == "tiny" else args.model
    ordinary = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "temperature": 0}
    with ExitStack() as stack:
        daemon = start_daemon(work_dir / "lmdb", pick_free_port())
        stack.callback(daemon.terminate)
        service = stack.enter_context(running_service(model, daemon.address, pick_free_port(),
                                                      work_dir / "service.log", timeout_s=300))
        (gateway,) = stack.enter_context(running_gateways((service.address, pick_free_port(),
                                                           work_dir / "gateway.log")))
        pids = {"daemon": daemon.process.pid, "service": service.process.pid, "gateway": gateway.process.pid}
        rng = random.Random(args.seed)
        bodies = [(endpoint, random_body(rng, endpoint)) for endpoint in
                  (rng.choice(ENDPOINTS) for _ in range(args.requests))]
        statuses: dict[int, int] = {}
        failures: list[tuple] = []
        lock = threading.Lock()
        next_index = [0]
        samples: list[tuple[int, dict[str, float]]] = []

        def worker() -> None:
            with httpx.Client(base_url=gateway.base_url, timeout=300) as client:
                while True:
                    with lock:
                        index = next_index[0]
                        next_index[0] += 1
                    if index >= len(bodies):
                        return
                    endpoint, body = bodies[index]
                    response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
                    with lock:
                        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                        if response.status_code >= 500:
                            failures.append((endpoint, body[:200], response.status_code, response.text[:200]))

        with httpx.Client(base_url=gateway.base_url, timeout=300) as client:
            before = client.post("/v1/chat/completions", json=ordinary).json()["choices"][0]["message"]["content"]
        samples.append((0, {name: rss_mib(pid) for name, pid in pids.items()}))
        started = time.perf_counter()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        step = max(1, args.requests // args.samples)
        while any(thread.is_alive() for thread in threads):
            time.sleep(0.5)
            done = sum(statuses.values())
            if done >= len(samples) * step and done < args.requests:
                samples.append((done, {name: rss_mib(pid) for name, pid in pids.items()}))
        elapsed = time.perf_counter() - started
        samples.append((sum(statuses.values()), {name: rss_mib(pid) for name, pid in pids.items()}))
        with httpx.Client(base_url=gateway.base_url, timeout=300) as client:
            after = client.post("/v1/chat/completions", json=ordinary).json()["choices"][0]["message"]["content"]

    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, model {args.model}, {args.requests} fuzzed "
          f"requests from {args.clients} clients in {elapsed:.0f} s (seed {args.seed})")
    print("statuses: " + ", ".join(f"{status} x {count}" for status, count in sorted(statuses.items())))
    print(f"answered {sum(statuses.values())} of {args.requests}; responses >= 500: {len(failures)}")
    for failure in failures[:5]:
        print("  ", json.dumps(failure)[:400])
    print(f"ordinary greedy request before and after: {'same' if before == after else 'DIFFERENT'} ({before!r})")
    print("RSS MiB by requests done: " + "; ".join(
        f"{done}: " + ", ".join(f"{name} {value:.0f}" for name, value in rss.items()) for done, rss in samples))
    half = [rss for done, rss in samples if done >= args.requests // 2]
    for name in pids:
        values = [rss[name] for rss in half]
        print(f"{name}: RSS over the second half of the flood {min(values):.0f}-{max(values):.0f} MiB "
              f"(start {samples[0][1][name]:.0f}, peak {max(rss[name] for _, rss in samples):.0f})")
    return 0 if not failures and before == after and sum(statuses.values()) == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
