"""The KV-event publisher's freshness and cost, in process, on the real step loop.

One engine with L0 and an in-memory store, a ZMQ subscriber in this process; requests (each a new --tokens document)
alternate with the publisher on and off. Freshness: from a request's first chunk entering L0 to the first BlockStored
batch received after it (target <= 50 ms). Cost: the publisher thread's busy time over the "on" requests' wall time,
and their wall time on against off (target <= 1% of step-loop time).

    flock /tmp/kvboost-heavy.lock python bench/bench_kv_events.py                  # SmolLM2, 2k tokens, 2 x 12
    python bench/bench_kv_events.py --model tiny --tokens 256 --rounds 3           # smoke
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

WORDS = ("harbour tide pilot mooring ledger crane berth cargo anchor signal tier chunk prefix block router "
         "replica cache event stream").split()


def document(tokenizer, num_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    text = ""
    while len(tokenizer(text)["input_ids"]) < num_tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(64)) + ". "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:num_tokens])


class Subscriber:
    """Receives every batch on a SUB socket, with its arrival time (perf_counter)."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVTIMEO, 200)
        self.socket.connect(endpoint)
        self.arrivals: list[tuple[float, list[dict]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq
        from kvboost_common.kv_events.wire import decode_batch
        while not self._stop.is_set():
            try:
                frames = self.socket.recv_multipart()
            except zmq.Again:
                continue
            self.arrivals.append((time.perf_counter(), decode_batch(frames[2])[1]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a catalogue name, or tiny")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per document")
    parser.add_argument("--rounds", type=int, default=12, help="pairs of requests (publisher on, off)")
    parser.add_argument("--chunk-size", type=int, default=128)
    args = parser.parse_args(argv)

    from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
    from inference_service.serving.config import ServiceConfig
    from inference_service.serving.kv_events import start_kv_events
    from inference_service.store.memory import InMemoryStore
    from tests.conftest import pick_free_port

    model, tokenizer = harness.cpu_model(args.model)
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=args.chunk_size, l0_bytes=1 << 30,
                                                   kv_cache_bytes=1 << 30), InMemoryStore(), model_id=args.model)
    publisher = start_kv_events(ServiceConfig(kv_events_endpoint=str(pick_free_port())), engine)
    subscriber = Subscriber(publisher.config.endpoint)
    first_added: list[float] = []
    real_added = publisher.chunk_added

    def timed_added(key: bytes, parent: bytes | None = None) -> None:
        first_added.append(time.perf_counter())
        real_added(key, parent)

    publisher.chunk_added = timed_added
    l0 = engine.parts.l0
    try:
        engine.generate(GenerationParams(prompt=document(tokenizer, args.tokens, 10**6), max_new_tokens=1))  # warm-up
        time.sleep(0.5)  # the subscription reaches the PUB socket
        seconds = {"on": [], "off": []}
        freshness, busy_before = [], publisher.stats.busy_seconds
        for round_index in range(args.rounds):
            for mode in harness.in_turn(("on", "off"), round_index):
                l0.listener = publisher if mode == "on" else None
                text = document(tokenizer, args.tokens, 2 * round_index + (mode == "on"))
                del first_added[:]
                started = time.perf_counter()
                engine.generate(GenerationParams(prompt=text, max_new_tokens=1))
                engine.flush_writes(60)  # the chunks are in L0 (the write-back's own thread)
                seconds[mode].append(time.perf_counter() - started)
                if mode == "on":
                    publisher.flush()
                    time.sleep(0.05)
                    entered = first_added[0]
                    received = next(arrival for arrival, events in subscriber.arrivals
                                    if arrival >= entered and any(e["type"] == "BlockStored" for e in events))
                    freshness.append((received - entered) * 1000)
        busy = publisher.stats.busy_seconds - busy_before
        on, off = harness.median(seconds["on"]), harness.median(seconds["off"])
        print(f"model {args.model}, {args.tokens}-token documents, chunk {args.chunk_size}, block "
              f"{publisher.config.block_size}, {args.rounds} requests each way, alternating")
        print(f"freshness (L0 insert -> batch received), ms: median {harness.median(freshness):.2f}, "
              f"p99 {harness.percentile(freshness, 0.99):.2f}, max {max(freshness):.2f}")
        print(f"publisher thread busy: {busy * 1000:.1f} ms over {sum(seconds['on']) * 1000:.0f} ms of 'on' requests "
              f"= {100 * busy / sum(seconds['on']):.3f}%; batches sent {publisher.stats.batches_sent}, "
              f"events {publisher.stats.events_sent}")
        print(f"request wall time, median: on {on * 1000:.1f} ms, off {off * 1000:.1f} ms "
              f"({100 * (on - off) / off:+.2f}%)")
    finally:
        subscriber.close()
        publisher.close()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
