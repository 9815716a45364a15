"""Where a streamed token's time goes between the step loop and the client's socket, on the running stack.

Per stack (`three`: daemon, service, gateway; `one`: `python -m kvboost_server`) and number of streams, N clients
stream chat completions (temperature 0, ignore_eos): an unprofiled window measures tokens/s at the clients and each
process's CPU time (every thread, from /proc) per token; a second window runs py-spy on the service and the gateway and
splits each process's CPU by the component its samples' innermost named frame belongs to (COMPONENTS below). Both
windows share the cores with the clients and the second with py-spy: its delivered rate is printed beside the first.

    flock /tmp/kvboost-bench.lock python bench/bench_token_path.py                      # 1 and 16 streams, both stacks
    python bench/bench_token_path.py --streams 1 --stacks one --tokens 64               # a quick look
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

from bench import harness  # noqa: E402
from bench_peers import OneProcessStack, OurStack, Server  # noqa: E402

# Libraries whose frames say nothing of what their caller does with them: a sample in torch's, transformers' or
# tokenizers' code counts for the innermost project frame that called it (model step, sampling, detokenizing).
PASS_THROUGH = ("/torch/", "/transformers/", "/tokenizers/", "/numpy/", "/safetensors/")
# (a fragment of the frame's full file name, the component), tried on each frame from the innermost outwards (after
# the frames of PASS_THROUGH); the first match wins.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("inference_service/model/detokenizer.py", "detokenize"),
    ("inference_service/model/sampling.py", "sampling + stop checks"),
    ("inference_service/model/logprobs.py", "sampling + stop checks"),
    ("inference_service/engine_parts/generation.py", "sampling + stop checks"),
    ("inference_service/engine_parts/logprobs.py", "sampling + stop checks"),
    ("inference_service/model/", "model step"),
    ("inference_service/kv_memory/slot_buffers.py", "model step"),  # the step's own K/V slots
    ("inference_service/kv_memory/kv_buffers.py", "model step"),
    ("inference_service/kv_memory/", "cache reuse + write-back"),  # the ledger, L0, the host tier, placement
    ("inference_service/engine/", "step loop bookkeeping"),
    ("inference_service/reuse/", "cache reuse + write-back"),
    ("inference_service/kv/", "cache reuse + write-back"),
    ("inference_service/store/", "cache reuse + write-back"),
    ("/google/protobuf/", "protobuf messages"),
    ("_pb2", "protobuf messages"),
    ("inference_service/serving/proto_convert.py", "protobuf messages"),
    ("/grpc/", "gRPC runtime"),
    ("/json/", "JSON/SSE encoding"),
    ("http_gateway/sse.py", "JSON/SSE encoding"),
    ("http_gateway/stream_chunks.py", "JSON/SSE encoding"),
    ("inference_service/serving/", "service streaming hand-off"),
    ("inference_service/engine_parts/", "service streaming hand-off"),
    ("kvboost_server/", "in-process upstream"),
    ("http_gateway/", "gateway handlers"),
    ("/uvicorn/", "HTTP server (uvicorn/starlette)"),
    ("/starlette/", "HTTP server (uvicorn/starlette)"),
    ("/fastapi/", "HTTP server (uvicorn/starlette)"),
    ("/h11/", "HTTP server (uvicorn/starlette)"),
    ("/httptools/", "HTTP server (uvicorn/starlette)"),
    ("/anyio/", "HTTP server (uvicorn/starlette)"),
    ("/asyncio/", "event loop"),
    ("/threading.py", "thread hand-offs"),
    ("/queue.py", "thread hand-offs"),
    ("/concurrent/futures/", "thread hand-offs"),
)


def py_spy() -> str | None:
    """py-spy beside this Python (a virtual environment's bin) or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def component_of(stack: str) -> str:
    """The component of one collapsed py-spy stack ("frame (file:line);...", outermost first, full file names)."""
    for frame in reversed(stack.split(";")):
        if any(fragment in frame for fragment in PASS_THROUGH):
            continue
        for fragment, component in COMPONENTS:
            if fragment in frame:
                return component
    return "other Python"


def parse_raw(path: Path) -> Counter:
    """py-spy's raw (collapsed) output: 'thread (id): frame;frame;... count' per line -> samples per component."""
    samples: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples[component_of(stack)] += int(count)
    return samples


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """{thread id: (its name, utime + stime so far in seconds)} for every live thread of the process."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        threads[int(task.name)] = (text[text.index("(") + 1:text.rindex(")")], harness.cpu_seconds(text))
    return threads


def snapshot(pid: int) -> tuple[float, dict]:
    """utime + stime of the whole process so far (ended threads included), and by thread."""
    return harness.cpu_seconds(Path(f"/proc/{pid}/stat").read_text()), thread_cpu_s(pid)


def cpu_by_thread_name(before: tuple[float, dict], after: tuple[float, dict]) -> Counter:
    """CPU seconds spent between two snapshots, by thread name (threads born meanwhile counted from 0); what
    threads that ended meanwhile spent is "(ended threads)"."""
    spent: Counter = Counter()
    for tid, (name, seconds) in after[1].items():
        spent[name] += seconds - before[1].get(tid, (name, 0.0))[1]
    ended = (after[0] - before[0]) - sum(spent.values())
    if ended > 0:
        spent["(ended threads)"] += ended
    return spent


@dataclass
class Window:
    tokens: int = 0
    wall_s: float = 0.0
    decode_rate: float = 0.0  # the streams' decode rates summed (tokens after the first per second, each stream)
    cpu_s: dict = field(default_factory=dict)  # process name -> Counter of CPU seconds by thread name
    samples: dict = field(default_factory=dict)  # process name -> Counter of components
    main_names: dict = field(default_factory=dict)  # process name -> its main thread's OS name, which every thread
    # CPython and OpenMP start inherits (gRPC's C core names its own)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def load(server: Server, streams: int, tokens: int, processes: dict[str, int], profile_rate: int,
         work_dir: Path) -> Window:
    """streams clients at once, each one streamed chat of `tokens` new tokens; CPU per process over the window,
    and py-spy over the service/gateway processes when profile_rate > 0."""
    window = Window()
    messages = [[{"role": "user", "content": f"Story {index}: write a long story about a lighthouse keeper."}]
                for index in range(streams)]

    def client(index: int):
        with httpx.Client() as http:
            return server.chat(messages[index], tokens, http, ignore_eos=True)

    profilers = []
    if profile_rate:
        for name, pid in processes.items():
            if name in ("clients", "daemon"):
                continue
            out = work_dir / f"{name}-{streams}-{time.monotonic_ns()}.txt"
            profilers.append((name, out, subprocess.Popen(
                [py_spy(), "record", "--pid", str(pid), "--rate", str(profile_rate),
                 "--format", "raw", "--threads", "--nonblocking", "--full-filenames", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=(work_dir / f"{out.stem}.log").open("wb"))))
        time.sleep(1.0)  # py-spy attaches
    before = {name: snapshot(pid) for name, pid in processes.items()}
    replies, window.wall_s = harness.at_once(client, streams)
    window.cpu_s = {name: cpu_by_thread_name(before[name], snapshot(pid)) for name, pid in processes.items()}
    window.tokens = sum(reply.completion_tokens for reply in replies)
    window.decode_rate = sum(reply.decode_tps for reply in replies)
    if not window.tokens:
        raise RuntimeError(f"{server.name}: no tokens came back from {streams} stream(s); see the logs")
    window.main_names = {name: Path(f"/proc/{pid}/comm").read_text().strip() for name, pid in processes.items()}
    for name, out, profiler in profilers:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(timeout=60)
        if not out.exists():
            print(f"  py-spy wrote nothing for {name} (pid {processes[name]}): see {work_dir / (out.stem + '.log')}")
        window.samples[name] = parse_raw(out) if out.exists() else Counter()
    return window


def grpc_window(address: str, streams: int, tokens: int) -> tuple[float, float]:
    """The same load through the service's gRPC contract (no HTTP): (the streams' decode rates summed, at the gRPC
    clients: tokens after the first per second between a stream's first and last token; the same sum of the step
    loop's own rates, GenerationResult.tokens_per_sec: each request's tokens after the first per second as the step
    loop chose them)."""
    import grpc
    from kvboost.v1 import inference_pb2 as pb
    from kvboost.v1 import inference_pb2_grpc

    def client(index: int) -> tuple[float, float]:
        first = last = None
        rate = count = 0
        with grpc.insecure_channel(address) as channel:
            request = pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content=f"Story {index}: write a long story about a lighthouse "
                                                               "keeper.")],
                max_new_tokens=tokens, temperature=0, ignore_eos=True)
            for event in inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=600):
                if event.token_ids:
                    last = time.perf_counter()
                    first = first or last
                if event.HasField("result"):
                    rate, count = event.result.tokens_per_sec, event.result.generated_tokens
        return ((count - 1) / (last - first) if first is not None and last > first and count > 1 else 0.0), rate

    rates = harness.at_once(client, streams)[0]
    return sum(delivered for delivered, _ in rates), sum(rate for _, rate in rates)


def report(stack: str, streams: int, rounds: list[tuple[tuple[float, float], Window]], profiled: Window) -> None:
    print(f"\n{stack}, {streams} stream(s): decode tokens/s, the streams' rates summed (tokens after the first per "
          "second, each stream), gRPC and HTTP windows alternating:")
    for over_grpc, window in rounds:
        print(f"  HTTP {window.decode_rate:6.1f} ({window.tokens} tokens in {window.wall_s:.1f} s with the prefills: "
              f"{window.tokens_per_s:.1f}/s); gRPC {over_grpc[0]:6.1f}, the step loop's own {over_grpc[1]:6.1f}; "
              f"HTTP / step loop {window.decode_rate / max(over_grpc[1], 1e-9):.2f}x")
    print(f"  under py-spy: HTTP {profiled.decode_rate:.1f}")
    plain = rounds[-1][1]
    per_token = 1000 / plain.tokens
    print("  CPU per token delivered (the last HTTP window), by process and thread name:")
    for name, by_thread in plain.cpu_s.items():
        threads = ", ".join(f"{thread} {seconds * per_token:.2f}" for thread, seconds in by_thread.most_common()
                            if seconds * per_token >= 0.01)
        print(f"    {name:8s} {sum(by_thread.values()) * per_token:6.2f} ms  ({threads})")
    for name, samples in profiled.samples.items():
        python_s = profiled.cpu_s[name].get(profiled.main_names[name], 0.0)
        total = sum(samples.values())
        if not total:
            continue
        per = 1000 / profiled.tokens
        print(f"  {name}: its '{profiled.main_names[name]}' threads' CPU ({python_s * per:.2f} ms a token under "
              "py-spy, MKL's OpenMP workers included) split by py-spy's samples of its Python threads:")
        for component, count in samples.most_common():
            print(f"    {component:34s} {count / total:6.1%}  {count / total * python_s * per:6.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", nargs="+", default=["three", "one"], choices=["three", "one"],
                        help="three: daemon, service and gateway processes (client.stack up --separate-gateway); one: "
                             "python -m kvboost_server (gateway and service in one process, as make up runs it) over "
                             "the same daemon")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16], help="concurrent streams per window")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--threads", type=int, default=2, help="the service's OMP_NUM_THREADS")
    parser.add_argument("--rounds", type=int, default=2, help="alternating gRPC and HTTP windows per case")
    args = parser.parse_args(argv)
    if py_spy() is None:
        parser.error("py-spy is not installed: pip install -e '.[bench]' (or make setup)")
    work_dir = Path(tempfile.mkdtemp(prefix="kvboost-token-path-"))
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, SmolLM2-135M-Instruct fp32, {os.cpu_count()} "
          f"cores, {args.tokens} tokens a stream, py-spy at {args.rate} Hz; logs in {work_dir}")
    with ExitStack() as stack:
        three = OurStack(work_dir, args.threads).start()
        stack.callback(three.stop)
        gateway, service, daemon = three.processes
        stacks = {}
        if "three" in args.stacks:
            stacks["three"] = (three.base_url, service.address,
                               {"service": service.process.pid, "gateway": gateway.process.pid})
        if "one" in args.stacks:
            one = OneProcessStack(work_dir, daemon.address).start()
            stack.callback(one.stop)
            stacks["one"] = (one.base_url, one.grpc_address, {"server": one.process.pid})
        for streams in args.streams:
            for name, (base_url, grpc_address, processes) in stacks.items():
                server = Server(name, base_url, "SmolLM2-135M-Instruct")
                processes = {**processes, "daemon": daemon.process.pid, "clients": os.getpid()}
                load(server, 1, 8, processes, 0, work_dir)  # warm-up
                rounds = []
                for _ in range(args.rounds):  # gRPC and HTTP alternate
                    over_grpc = grpc_window(grpc_address, streams, args.tokens)
                    rounds.append((over_grpc, load(server, streams, args.tokens, processes, 0, work_dir)))
                profiled = load(server, streams, args.tokens, processes, args.rate, work_dir)
                report(name, streams, rounds, profiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
