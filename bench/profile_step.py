"""Where one decode step's time goes on this CPU, beside the physical limit.

The engine's own decode path (model/slot_buffers.SlotBuffers.decode, the K/V owner's fixed slots and the
engine's attention) on SmolLM2-135M-Instruct fp32: 1 row at a short and a long context, then 8 and 16 rows.
Per step: wall time (median), and torch.profiler's self CPU time by kind of op: matrix products (the weight
reads), attention, cache upkeep (copies and writes into the slots), everything else on tensors (norms, RoPE,
activations, sampling's argmax), and the rest of the wall time, which no op accounts for: Python, module calls
and dispatch. The machine's memory bandwidth is measured (a reduction over a 1 GiB tensor, median of 5) and the
floor per step written beside: (weight bytes + K/V bytes the step reads) / bandwidth.

    flock /tmp/kvboost-bench.lock python bench/profile_step.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::softmax", "aten::_softmax"),
    "cache": ("aten::copy_", "aten::index_copy", "aten::index_put", "aten::cat", "aten::narrow", "aten::slice",
              "aten::select", "aten::as_strided", "aten::view", "aten::expand", "aten::empty", "aten::zeros"),
}


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS.items():
        if any(name.startswith(prefix) for prefix in prefixes):
            return kind
    return "other ops"


def bandwidth_gbs(repeats: int = 5) -> float:
    import torch

    data = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    data.sum()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - started)
    return data.numel() * 4 / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x50,1x1600,8x737,16x737", help="ROWSxCONTEXT, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per case (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from inference_service.model.kv_buffers import kv_geometry
    from inference_service.model.slot_buffers import SlotBuffers
    from tests.factories import load_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_smollm2()[0]
    geometry = kv_geometry(model.config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * 4
    bandwidth = bandwidth_gbs()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, SmolLM2-135M-Instruct fp32, "
          f"{torch.get_num_threads()} threads; weights {weight_bytes / 1e6:.0f} MB, K/V {kv_bytes_per_token / 1e3:.1f} kB "
          f"per token; memory bandwidth {bandwidth:.1f} GB/s (sum over 1 GiB, median of 5)\n")
    header = (f"{'rows x ctx':>11} {'step ms':>8} {'floor ms':>8} {'matmul':>7} {'attn':>6} {'cache':>6} {'other':>6} "
              f"{'python':>7}   (ms per step)")
    print(header)
    print("-" * len(header))
    generator = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        rows, context = (int(part) for part in case.split("x"))
        slots = SlotBuffers(model.config, geometry, rows, context + 4 * args.repeats + 16, model.device, model.dtype)
        for slot in range(rows):
            slot_keys, slot_values = slots.views(slot)
            slot_keys[:, :, :context].normal_(generator=generator)
            slot_values[:, :, :context].normal_(generator=generator)
            slots.written(slot, context)
        position = [context]

        def step() -> None:
            logits = slots.decode(model, {slot: (17, position[0]) for slot in range(rows)})
            logits.argmax(dim=-1)
            position[0] += 1

        with torch.inference_mode():
            step()
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                step()
                times.append(time.perf_counter() - started)
            wall = statistics.median(times)
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                for _ in range(3):
                    step()
        by_kind: dict[str, float] = {}
        for event in profiler.key_averages():
            by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + event.self_cpu_time_total / 3 / 1e3
        op_ms = sum(by_kind.values())
        floor_ms = (weight_bytes + rows * context * kv_bytes_per_token) / (bandwidth * 1e9) * 1e3
        python_ms = max(0.0, wall * 1e3 - op_ms)
        print(f"{rows:>4} x {context:<5} {wall * 1e3:>8.1f} {floor_ms:>8.1f} {by_kind.get('matmul', 0):>7.1f} "
              f"{by_kind.get('attention', 0):>6.1f} {by_kind.get('cache', 0):>6.1f} {by_kind.get('other ops', 0):>6.1f} "
              f"{python_ms:>7.1f}")
    print("\npython: wall time no op accounts for (Python, module calls, dispatch); the profiler's own cost "
          "inflates the op columns a little.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
