#!/usr/bin/env bash
# The GPU checks of this repository as one short run on a GPU machine without network (for example the device
# tool's): installs the wheels bench/pack_gpu_wheels.sh packed into .whl, runs `pytest -m gpu`, then
# bench/bench_gpu.py; logs and JSON go to $OUT (or /tmp/kvboost-gpu). Runs in about 6 minutes on an H200.
#   bench/gpu_check.sh [bench_gpu.py flags...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvboost-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing .whl/*.whl failed: run bench/pack_gpu_wheels.sh where pip can reach PyPI" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD:$PWD/proto" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'cpus', __import__('os').cpu_count())"
timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/gpu tests/inference_service/kv \
  tests/inference_service/model/test_graph_step.py -p no:cacheprovider \
  2>&1 | tee "$out/pytest.log" | tail -25
timeout "${BENCH_TIMEOUT:-330}" python3 bench/bench_gpu.py --service-defaults --json "$out/bench_gpu.json" "$@" 2>&1 | tee "$out/bench_gpu.log"
# The host's work per cached request on the device (issue: the host path): in process, L0 and the daemon.
timeout "${OVERHEAD_TIMEOUT:-150}" python3 bench/bench_overhead.py --parts in-process --device cuda \
  --lengths 2048 32768 --cold-lengths 2048 --rounds 5 --json "$out/bench_overhead.json" 2>&1 \
  | grep -v Writing | tee "$out/bench_overhead.log"
