"""Faults against a real daemon process: kill -9 during concurrent Store bursts, a read-only data dir, a full budget."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from kvboost.v1 import cache_pb2

from tests.conftest import pick_free_port
from tests.daemon_support import cache_stub, fetch_chunks, make_chunk, rpc_error, store_chunks, store_frames
from tests.e2e.daemon_process import REPO_ROOT, start_daemon

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

KILL_ROUNDS = 20          # kill -9 rounds (issue 7); each round is about 1-1.5 s
WRITERS = 8               # concurrent Store streams per round
HELD_WRITERS = 4          # of them, writers whose stream is held open, mid-call, until the kill
CHUNKS_PER_STORE = 3      # chunks per Store call (one write transaction each)
INTERRUPTED_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Writer(threading.Thread):
    """Stores batches of fresh chunks (one Store call each) until the daemon dies; remembers each call and
    whether Store acknowledged it, and any failure of the thread itself (an assert here only warns under pytest).

    A held writer acknowledges one call, then sends the next one's first chunk and part of its second and
    holds that stream open until `release`: its open, unfinished call is certain when the kill lands.
    A free writer keeps storing, so its kill lands anywhere (mid-frame, mid-commit, between calls).
    """

    def __init__(self, address: str, label: str, held: bool, release: threading.Event) -> None:
        super().__init__(daemon=True)
        self.address, self.label, self.held, self.release = address, label, held, release
        self.calls: list[tuple[list, bool]] = []  # (chunks of one Store call, acknowledged)
        self.errors: list[grpc.StatusCode] = []
        self.failures: list[str] = []
        # A Store stream is open with part of its call sent (held: at the hold point of its second call).
        self.stream_open = threading.Event()

    def run(self) -> None:
        try:
            self._store_until_the_daemon_dies()
        except BaseException as error:  # collected and asserted by the test
            self.failures.append(f"{self.label}: {error!r}")
        finally:
            self.stream_open.set()  # never leave the test waiting on a writer that ended

    def _frames(self, batch: list, hold: bool):
        frames = store_frames(batch)
        for index, frame in enumerate(frames):
            yield frame
            if index == 0 and not self.held:
                self.stream_open.set()
            # Hold after the first whole chunk and the header plus one data frame of the second one.
            if hold and index == 1 + len(store_frames(batch[:1])):
                self.stream_open.set()
                if not self.release.wait(60):
                    raise AssertionError("the held stream was never released")

    def _store_until_the_daemon_dies(self) -> None:
        rng = random.Random(self.label)
        with cache_stub(self.address) as stub:
            for batch_index in range(10_000):
                # Sizes up to 2.5 MiB: a chunk spans several 1 MiB frames, so the kill often lands mid-chunk.
                batch = [make_chunk(f"{self.label} {batch_index} {i}", rng.randrange(1_100_000, 2_600_000)
                                    if self.held else rng.randrange(1_000, 2_600_000))
                         for i in range(CHUNKS_PER_STORE)]
                self.calls.append((batch, False))
                try:
                    reply = stub.Store(self._frames(batch, hold=self.held and batch_index == 1), timeout=30)
                except grpc.RpcError as error:
                    self.errors.append(error.code())
                    return
                if reply.stored + reply.already_present != len(batch):
                    raise AssertionError(f"Store acknowledged {reply} for {len(batch)} chunks")
                self.calls[-1] = (batch, True)


def verify(address: str, calls: list[tuple[list, bool, bool]]) -> int:
    """Every acknowledged chunk is found and bit-exact. Of an unacknowledged call nothing is left, or (its commit
    done, the kill before the reply) all of it; a held call, killed mid-stream, left nothing. Returns the
    number of unacknowledged calls found whole."""
    whole = 0
    with cache_stub(address) as stub:
        for batch, acknowledged, held in calls:
            fetched = fetch_chunks(stub, [chunk.key for chunk in batch], timeout=30)  # checks size + CRC
            found = [got.found for got in fetched]
            assert all(got.blob == chunk.blob for chunk, got in zip(batch, fetched) if got.found), "a blob changed"
            if acknowledged:
                assert all(found), f"acknowledged chunks lost after kill -9: {batch[0].key.hex()[:16]}, {found}"
            elif held:
                assert not any(found), f"a Store interrupted mid-stream left chunks of its call: {found}"
            else:
                assert found in ([False] * len(batch), [True] * len(batch)), f"part of one Store call kept: {found}"
                whole += all(found)
        stats = stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10)
        assert stats.corrupted == 0, "the daemon found corrupted blobs"
        assert stats.bytes <= stats.max_bytes
    return whole


def test_kill_9_during_concurrent_store_bursts_loses_nothing_acknowledged(tmp_path: Path) -> None:
    data_dir = tmp_path / "lmdb"
    calls: list[tuple[list, bool, bool]] = []  # (chunks, acknowledged, held open at the kill)
    for round_index in range(KILL_ROUNDS):
        daemon = start_daemon(data_dir, pick_free_port(), "--max-bytes", "4G")
        release = threading.Event()
        try:
            verify(daemon.address, calls)
            writers = [Writer(daemon.address, f"round {round_index} writer {w}", w < HELD_WRITERS, release)
                       for w in range(WRITERS)]
            for writer in writers:
                writer.start()
            # Kill once every writer has a stream open with part of a call sent (the held ones stay so).
            for writer in writers:
                assert writer.stream_open.wait(60), f"{writer.label} never opened a Store stream"
        finally:
            daemon.kill()
            release.set()
        for writer in writers:
            writer.join(timeout=60)
            assert not writer.is_alive()
            assert writer.failures == [], writer.failures
            assert set(writer.errors) <= INTERRUPTED_CODES, writer.errors
            calls.extend((batch, acknowledged, writer.held and index == 1) for index, (batch, acknowledged)
                         in enumerate(writer.calls))
        held_interrupted = [writer for writer in writers[:HELD_WRITERS] if writer.errors and not writer.calls[1][1]]
        assert len(held_interrupted) == HELD_WRITERS, "every held stream must have been cut by the kill"
    daemon = start_daemon(data_dir, pick_free_port(), "--max-bytes", "4G")
    try:
        whole = verify(daemon.address, calls)
    finally:
        daemon.terminate()
    acknowledged = sum(len(batch) for batch, done, _ in calls if done)
    interrupted = [batch for batch, done, _ in calls if not done]
    assert acknowledged, "no Store was acknowledged: the bursts were too short to test anything"
    print(f"\n{KILL_ROUNDS} kill -9 rounds survived: {acknowledged} acknowledged chunks all present and "
          f"checksum-valid; of {len(interrupted)} interrupted Store calls {len(interrupted) - whole} left nothing "
          f"and {whole} were committed whole before the reply was lost, none partly; "
          f"{KILL_ROUNDS * HELD_WRITERS} of them cut mid-stream; 0 lost")


def _refuse_writes(folder: Path) -> bool:
    """chmod 0555; as root (which ignores modes) the immutable attribute instead. False if neither holds."""
    folder.chmod(0o555)
    if _is_read_only(folder):
        return True
    result = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    return result.returncode == 0 and _is_read_only(folder)


def _is_read_only(folder: Path) -> bool:
    probe = folder / ".probe"
    try:
        probe.touch()
    except OSError:
        return True
    probe.unlink()
    return False


def _start_daemon_on(data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cache_daemon", "--data-dir", str(data_dir),
                           "--listen", f"127.0.0.1:{pick_free_port()}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("KVBOOST_")})


def _assert_documented_refusal(result: subprocess.CompletedProcess, data_dir: Path) -> None:
    """docs/operations.md: the daemon exits 1 at start with "cannot open DIR: ..."."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"cannot open {data_dir}" in output, output
    assert "Traceback" not in output, f"a clear message, not a traceback:\n{output}"


@pytest.mark.parametrize("layout", ["read_only_dir", "file_in_its_place", "dir_under_a_file"])
def test_an_unwritable_data_dir_fails_at_start_with_the_documented_message(tmp_path: Path, layout: str) -> None:
    if layout == "read_only_dir":
        data_dir = tmp_path / "read-only"
        data_dir.mkdir()
        if not _refuse_writes(data_dir):
            # Root without chattr: the two layouts below refuse writes for root too and still run.
            pytest.skip("cannot make a directory read-only here (root without chattr); other layouts cover it")
    elif layout == "file_in_its_place":
        data_dir = tmp_path / "not-a-dir"
        data_dir.write_text("a regular file where the data dir should be")
    else:
        (tmp_path / "a-file").write_text("")
        data_dir = tmp_path / "a-file" / "lmdb"  # no directory can be made under a regular file
    try:
        result = _start_daemon_on(data_dir)
    finally:
        if layout == "read_only_dir":
            subprocess.run(["chattr", "-i", str(data_dir)], capture_output=True)
            data_dir.chmod(0o755)
    _assert_documented_refusal(result, data_dir)


def test_full_budget_and_tiny_map_give_resource_exhausted_and_keep_serving(tmp_path: Path) -> None:
    data_dir = tmp_path / "lmdb"
    budget = 1 << 20
    daemon = start_daemon(data_dir, pick_free_port(), "--max-bytes", str(budget), "--map-size", "256K")
    try:
        with cache_stub(daemon.address) as stub:
            # A chunk larger than the whole budget: refused, nothing stored.
            error = rpc_error(store_chunks, stub, [make_chunk("too big", budget + 1)], timeout=10)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            # Pinned chunks filling the budget: the next chunk cannot evict them.
            pinned = [make_chunk(f"pinned {i}", 300_000, pinned=True) for i in range(3)]
            assert store_chunks(stub, pinned, timeout=10).stored == 3
            error = rpc_error(store_chunks, stub, [make_chunk("no room", 300_000)], timeout=10)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            # Unpinned, they make room: many chunks through a tiny initial map (it grows), budget held.
            stub.Unpin(cache_pb2.PinRequest(keys=[chunk.key for chunk in pinned]), timeout=10)
            for i in range(20):
                store_chunks(stub, [make_chunk(f"churn {i}", 200_000)], timeout=10)
                stats = stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10)
                assert stats.bytes <= budget, f"budget exceeded: {stats.bytes} > {budget}"
            assert stats.evictions > 0
            latest = make_chunk("churn 19", 200_000)
            [fetched] = fetch_chunks(stub, [latest.key], timeout=10)
            assert fetched.found and fetched.blob == latest.blob
        assert daemon.process.poll() is None, "the daemon died"
    finally:
        assert daemon.terminate() == 0


SERVICE_KILL_ROUNDS = 3
SERVICE_CHUNK_SIZE = 16


def service_prompt(round_index: int) -> str:
    # Byte tokenizer: ~900 tokens, ~56 chunks of 16 to write back per request.
    return f"Round {round_index}: " + "the harbour ferry leaves at six and returns at nine; bicycles cost extra. " * 12


def test_kill_9_of_the_service_mid_write_back_leaves_only_whole_chunks(tmp_path: Path) -> None:
    from kvboost.v1 import inference_pb2 as pb
    from tests.e2e.service_process import generate, start_service
    from tests.e2e.stack_process import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny-model")
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    extra = ("--chunk-size", str(SERVICE_CHUNK_SIZE))
    try:
        for round_index in range(SERVICE_KILL_ROUNDS):
            service = start_service(str(model_dir), daemon.address, pick_free_port(),
                                    tmp_path / f"service-{round_index}.log", *extra)
            try:
                with service.stub() as stub:
                    stream = stub.Generate(pb.GenerateRequest(prompt=service_prompt(round_index), max_new_tokens=64,
                                                              mode=pb.PREFIX_CACHE), timeout=60)
                    next(iter(stream))  # the first token: the prefill is done, its write-back under way
                    service.process.kill()  # kill -9 while chunks stream to the daemon
                    service.process.wait(timeout=30)
            finally:
                if service.process.poll() is None:
                    service.process.kill()
        assert daemon.process.poll() is None, "the daemon died with its client"
        with cache_stub(daemon.address) as cache:
            stats = cache.Stats(cache_pb2.CacheStatsRequest(), timeout=10)
        assert stats.corrupted == 0
        # A fresh service reuses whatever was stored: exact prefix reuse must give the baseline's tokens,
        # so every chunk it fetched was whole.
        service = start_service(str(model_dir), daemon.address, pick_free_port(), tmp_path / "service-after.log",
                                *extra)
        try:
            with service.stub() as stub:
                for round_index in range(SERVICE_KILL_ROUNDS):
                    prompt = service_prompt(round_index)
                    _, baseline = generate(stub, prompt, max_new_tokens=8, mode=pb.BASELINE)
                    _, reused = generate(stub, prompt, max_new_tokens=8, mode=pb.PREFIX_CACHE)
                    assert not reused.degraded
                    assert list(reused.output_token_ids) == list(baseline.output_token_ids)
                    print(f"\nservice kill round {round_index}: {reused.cached_tokens} of {reused.prompt_tokens} "
                          f"prompt tokens reused after the kill, output identical to baseline")
        finally:
            service.terminate()
        with cache_stub(daemon.address) as cache:
            assert cache.Stats(cache_pb2.CacheStatsRequest(), timeout=10).corrupted == 0
    finally:
        daemon.terminate()
