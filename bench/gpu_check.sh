#!/usr/bin/env bash
# The GPU checks of this repository as one short run on a GPU machine without network (for example the device
# tool's): installs what bench/pack_gpu_wheels.sh packed into .whl, then runs the parts named in PARTS (default: all,
# in this order), each under its own timeout; logs and JSON go to $OUT (or /tmp/kvboost-gpu).
#   bench       bench_gpu.py --service-defaults: TTFT by tier at 512..32k, decode one stream and 16 rows, the peer
#   exactness   bench_exactness.py: bf16 cached vs uncached, bitwise, over lengths, tiers and prefill pieces
#   invariant   the same with --invariant-prefill (every prefill forward one whole chunk at aligned positions)
#   pytest      pytest -m gpu (tests/gpu, the K/V kernels, the graph step)
#   overhead    bench_overhead.py in process on CUDA: the host's work per cached request (L0 and the daemon)
#   compile     bench_compile_step.py: the compiled layer loop under the graphs against the graphs alone
#   PARTS="bench exactness" bench/gpu_check.sh [bench_gpu.py flags...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvboost-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing .whl/*.whl failed: run bench/pack_gpu_wheels.sh where pip can reach PyPI" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD:$PWD/proto" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'cpus', __import__('os').cpu_count())"
part() { [[ " ${PARTS:-bench exactness invariant pytest overhead compile} " == *" $1 "* ]]; }
stamp() { echo "== $1 $(date +%T)"; }
if part bench; then
  stamp bench
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/bench_gpu.py --service-defaults --peer-cb --json "$out/bench_gpu.json" \
    "$@" 2>&1 | tee "$out/bench_gpu.log"
fi
if part exactness && [ -f bench/bench_exactness.py ]; then
  stamp exactness
  timeout "${EXACTNESS_TIMEOUT:-150}" python3 bench/bench_exactness.py --json "$out/bench_exactness.json" 2>&1 \
    | tee "$out/bench_exactness.log"
fi
if part invariant; then
  stamp invariant
  timeout "${INVARIANT_TIMEOUT:-150}" python3 bench/bench_exactness.py --invariant-prefill \
    --json "$out/bench_exactness_invariant.json" 2>&1 | tee "$out/bench_exactness_invariant.log"
fi
if part pytest; then
  stamp pytest
  timeout "${PYTEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu tests/gpu tests/inference_service/kv \
    tests/inference_service/model/test_graph_step.py -p no:cacheprovider 2>&1 | tee "$out/pytest.log" | tail -25
fi
if part overhead; then
  stamp overhead
  timeout "${OVERHEAD_TIMEOUT:-60}" python3 bench/bench_overhead.py --parts in-process --device cuda \
    --lengths 2048 32768 --cold-lengths 2048 --rounds 5 --model-dir .whl/negligible-model 2>&1 | grep -v Writing | tee "$out/bench_overhead.log"
fi
if part compile && [ -f bench/bench_compile_step.py ]; then
  stamp compile
  timeout "${COMPILE_TIMEOUT:-150}" python3 bench/bench_compile_step.py --context 512 --rows 1 16 \
    --compile-limit-s "${COMPILE_LIMIT:-60}" --budget-s "${COMPILE_BUDGET:-60}" --json "$out/bench_compile.json" 2>&1 \
    | tee "$out/bench_compile.log"
fi
stamp done
