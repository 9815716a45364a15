#!/usr/bin/env bash
# Packs, as CPython 3.12 x86-64 wheels, what a GPU machine without network lacks to run this repository's GPU
# tests and bench/bench_gpu.py (its image brings Python 3.12, torch, transformers, numpy, tokenizers, pytest,
# hypothesis...; not lmdb, isal, grpcio 1.85 and the protobuf runtime our generated code needs). Then, there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site WHEELS/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/proto
#   python3 -m pytest -m gpu tests/gpu tests/inference_service/kv && python3 bench/bench_gpu.py
# Also saves bench_overhead's negligible model in DIR/negligible-model (it needs SmolLM2's tokenizer, from `make model`).
# Usage: bench/pack_gpu_wheels.sh [DIR]   (default .whl, which .gitignore ignores); stays under 64 MiB.
set -euo pipefail
dir=${1:-.whl}
pin() { sed -n "s/^ *\"\($1==[^\"; ]*\)\".*/\1/p" pyproject.toml | head -1; }
wanted=(
  "$(pin grpcio)" "$(pin grpcio-health-checking)" "$(pin grpcio-reflection)" "$(pin protobuf)"
  "$(pin lmdb)" "$(pin isal)" "$(pin redis)" "$(pin transformers)"
  "$(pin pyzmq)" "$(pin msgpack)"  # --kv-events-endpoint (the kv-events extra)
)
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d "$dir" "${wanted[@]}"
# bench_overhead's negligible model (random weights, SmolLM2's tokenizer and template): weights cannot be fetched there
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$python" -c "import sys; from pathlib import Path; sys.argv = ['bench_overhead']; sys.path.insert(0, '.'); \
from bench.bench_overhead import negligible_model; negligible_model(Path('$dir/negligible-model'))"
total=$(du -cb "$dir"/*.whl "$dir"/negligible-model/* | tail -1 | cut -f1)
ls -1 "$dir"
echo "$(( total / 1048576 )) MiB in $dir"
if (( total > 60 * 1048576 )); then echo "over 60 MiB: a device call carries at most 64 MiB" >&2; exit 1; fi
