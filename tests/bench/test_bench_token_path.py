"""bench/bench_token_path.py's pure parts: which component a py-spy sample belongs to, reading py-spy's raw output,
and CPU time by thread name between two /proc snapshots."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import bench_token_path as token_path  # noqa: E402

SITE = "/srv/.venv/lib/python3.11/site-packages"
REPO = "/srv/kvboost"


def stack(*frames: str) -> str:
    """py-spy's collapsed form (--full-filenames): outermost frame first."""
    return ";".join(frames)


def test_library_frames_count_for_the_project_code_that_called_them():
    loop = f"_loop ({REPO}/inference_service/engine/core.py:170)"
    assert token_path.component_of(stack(loop, f"decode ({REPO}/inference_service/kv_memory/slot_buffers.py:90)",
                                         f"linear ({SITE}/torch/nn/functional.py:10)")) == "model step"
    assert token_path.component_of(stack(loop, f"push ({REPO}/inference_service/model/detokenizer.py:40)",
                                         f"decode ({SITE}/transformers/tokenization_utils_base.py:3900)",
                                         f"decode ({SITE}/tokenizers/__init__.py:1)")) == "detokenize"
    assert token_path.component_of(stack(loop, f"take ({REPO}/inference_service/engine_parts/generation.py:80)",
                                         f"argmax ({SITE}/torch/_tensor.py:5)")) == "sampling + stop checks"
    assert token_path.component_of(stack(loop, f"plan ({REPO}/inference_service/engine/scheduler.py:80)")) == \
        "step loop bookkeeping"


def test_runtime_libraries_are_their_own_components():
    serve = "run_forever (/usr/lib/python3.11/asyncio/base_events.py:600)"
    handler = f"Generate ({REPO}/inference_service/serving/servicer.py:120)"
    assert token_path.component_of(stack(serve, handler, f"write ({SITE}/grpc/aio/_call.py:400)")) == "gRPC runtime"
    assert token_path.component_of(stack(serve, handler, f"SerializeToString ({SITE}/google/protobuf/message.py:1)")) \
        == "protobuf messages"
    assert token_path.component_of(stack(serve, handler)) == "service streaming hand-off"
    assert token_path.component_of(stack(serve, f"event ({REPO}/http_gateway/sse.py:17)",
                                         "dumps (/usr/lib/python3.11/json/__init__.py:231)")) == "JSON/SSE encoding"
    assert token_path.component_of(stack(serve, f"send ({SITE}/uvicorn/protocols/http/h11_impl.py:500)")) == \
        "HTTP server (uvicorn/starlette)"
    assert token_path.component_of(stack(serve, "select (/usr/lib/python3.11/selectors.py:468)")) == "event loop"
    assert token_path.component_of(stack("wait (/usr/lib/python3.11/threading.py:320)")) == "thread hand-offs"
    assert token_path.component_of(stack("main (/tmp/elsewhere.py:1)")) == "other Python"


def test_raw_output_is_summed_by_component(tmp_path):
    raw = tmp_path / "raw.txt"
    model = f"decode ({REPO}/inference_service/model/lean_step.py:220)"
    raw.write_text(f"thread (0x1): {model} 7\nthread (0x2): wait (/usr/lib/python3.11/threading.py:320) 3\n"
                   f"thread (0x1): {model} 2\n\n")
    assert token_path.parse_raw(raw) == {"model step": 9, "thread hand-offs": 3}


def test_cpu_between_snapshots_is_split_by_thread_name_and_ended_threads_are_the_rest():
    before = (10.0, {1: ("python", 6.0), 2: ("grpc_global_tim", 1.0), 3: ("python", 2.0)})
    after = (15.0, {1: ("python", 8.0), 2: ("grpc_global_tim", 1.5), 4: ("python", 0.5)})  # 3 ended, 4 was born
    spent = token_path.cpu_by_thread_name(before, after)
    assert spent["python"] == 2.5 and spent["grpc_global_tim"] == 0.5
    assert abs(spent["(ended threads)"] - 2.0) < 1e-9
    names = token_path.thread_cpu_s(os.getpid())
    assert os.getpid() in names and names[os.getpid()][1] > 0
