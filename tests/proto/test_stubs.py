"""The committed generated stubs match what `make proto` produces from the .proto files now."""
from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PROTOS = ["kvboost/v1/cache.proto", "kvboost/v1/inference.proto"]
GENERATED = [f"kvboost/v1/{name}{suffix}" for name in ("cache", "inference") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    (tmp_path / "kvboost" / "v1").mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *PROTOS],
        check=True, cwd=PROTO_DIR,
    )
    stale = [name for name in GENERATED if not filecmp.cmp(tmp_path / name, PROTO_DIR / name, shallow=False)]
    assert not stale, f"stubs differ from their .proto files, run `make proto`: {stale}"


def test_every_rpc_of_the_design_is_in_the_contract() -> None:
    from kvboost.v1 import cache_pb2, inference_pb2

    cache_rpcs = set(cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods_by_name)
    inference_rpcs = set(inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].methods_by_name)
    assert cache_rpcs == {"Lookup", "Fetch", "Store", "Stats", "Delete", "Pin", "Unpin", "Describe", "WatchEvents"}
    assert inference_rpcs == {"Generate", "GenerateBatch", "GenerateMany", "Warm", "Unpin", "VerifyCorrectness", "Stats",
                              "ModelInfo", "Tokenize", "Detokenize"}


def test_generate_request_names_clients_rely_on() -> None:
    from kvboost.v1 import inference_pb2

    fields = set(inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert {"prompt", "messages", "segments", "max_new_tokens", "mode", "temperature", "top_p", "top_k",
            "seed", "stop", "recompute_strategy"} <= fields
    assert {"text", "content_addressed"} <= set(inference_pb2.WarmRequest.DESCRIPTOR.fields_by_name)
    result_fields = set(inference_pb2.GenerationResult.DESCRIPTOR.fields_by_name)
    assert {"output_text", "generated_tokens", "ttft_ms", "total_ms", "tokens_per_sec", "kv_reuse_ratio",
            "prompt_tokens", "cached_tokens", "recomputed_tokens", "mode"} <= result_fields
