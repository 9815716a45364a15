"""Plain transformers `model.generate` on the real SmolLM2 in a process of its own, for the identity tests.

A test submits a prompt's reference before the engine answers that prompt, so the reference (in this process)
and the engine (in the test's) run side by side on two cores instead of one after the other. The reference
stays what it was in the test process: the same converted SmolLM2 loaded by `tests.factories.load_smollm2`,
fp32, transformers' default attention, one prompt per `generate` call, greedy, under the MKL dispatch the test
process runs (checked at start). Both sides run one torch thread (the tests use `one_torch_thread`): the
rounding of a matrix product may depend on how it is split across threads, and a token decided by a near tie
must be compared like with like.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREADS = 1


class ReferenceProcess:
    """One child process answering `submit(token_ids, max_new_tokens)` in order; `close()` stops it. Starting it
    does not wait: the child loads SmolLM2 while the test sets up, and answers what was submitted meanwhile."""

    def __init__(self, expected_dispatch: str):
        self._expected = {"dispatch": expected_dispatch, "threads": THREADS}
        self._process = subprocess.Popen([sys.executable, "-m", "tests.reference_process"], cwd=ROOT,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._pending: deque[Future] = deque()
        self._failure: str | None = None
        self._lock = threading.Lock()  # the pending queue and the failure
        # Lines to write, in submission order (the order of the answers read). A writer thread writes them: a
        # pipe holds 64 KiB, so a test submitting many long prompts at once would otherwise block in submit()
        # until the child had answered most of them, instead of running its engine meanwhile.
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_requests, name="reference-writer", daemon=True)
        self._writer.start()
        self._reader = threading.Thread(target=self._read_answers, name="reference-reader", daemon=True)
        self._reader.start()

    def submit(self, token_ids: list[int], max_new_tokens: int) -> Future:
        """The greedy continuation (new token ids only), computed while the caller goes on."""
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(RuntimeError(self._failure))
                return future
            self._pending.append(future)
            self._lines.put(json.dumps({"ids": list(token_ids), "max_new_tokens": max_new_tokens}) + "\n")
        return future

    def close(self) -> None:
        self._lines.put(None)  # after every line submitted: the writer closes stdin, the child finishes and exits
        self._writer.join(timeout=30)
        if self._process.poll() is None:
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=30)
        self._reader.join(timeout=30)

    def _write_requests(self) -> None:
        while (line := self._lines.get()) is not None:
            try:
                self._process.stdin.write(line)
                self._process.stdin.flush()
            except OSError:  # the child is gone: the reader fails every pending request
                pass
        try:
            self._process.stdin.close()
        except OSError:
            pass

    def _read_answers(self) -> None:
        line = self._process.stdout.readline()
        ready = json.loads(line) if line else None
        if ready != self._expected:
            self._process.kill()
            self._fail(f"the reference process exited ({self._process.wait()}) before it was ready" if ready is None
                       else f"the reference process runs {ready}, the tests {self._expected}: its references would "
                            "not be like for like")
            return
        for line in self._process.stdout:
            with self._lock:
                future = self._pending.popleft()
            future.set_result(json.loads(line))
        self._fail(f"the reference process exited ({self._process.wait()}) with requests pending")

    def _fail(self, why: str) -> None:
        with self._lock:
            self._failure = why
            while self._pending:
                self._pending.popleft().set_exception(RuntimeError(why))


def serve() -> None:
    """The child: one JSON request a line on stdin, one JSON list of new token ids a line on stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the answers; anything else printed (Python or C) goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from inference_service import mkl_dispatch

    dispatch = mkl_dispatch.apply()  # before torch loads, as tests/conftest.py does
    import torch

    from tests.factories import load_smollm2

    torch.set_num_threads(THREADS)
    model, _, _ = load_smollm2()
    out.write(json.dumps({"dispatch": dispatch.applied, "threads": torch.get_num_threads()}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        input_ids = torch.tensor([request["ids"]])
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=request["max_new_tokens"])
        out.write(json.dumps(output[0, input_ids.shape[1]:].tolist()) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
