#!/usr/bin/env bash
# The GPU checks of this repository as one short run on a GPU machine without network (for example the device
# tool's): installs what bench/pack_gpu_wheels.sh packed into .whl, then runs the parts named in PARTS, in the order
# given, each under its own timeout and all inside BUDGET_S seconds (a part gets at most what is left of it; one
# with under 20 s left is skipped and says so). Logs and JSON go to $OUT (or /tmp/kvboost-gpu).
#   ttft        bench_gpu.py --service-defaults, no decode: TTFT by tier at 256..32k against BASELINE, each length's
#               request split into stages (tokenize, keys, Lookup, placement, the question's own prefill, the first
#               sample; CUDA events + host clocks), one length through the gRPC stream (the hop)          240 s
#   overhead    bench_overhead.py in process on CUDA: the host's work per cached request (L0 and the daemon) 60 s
#   exactness   bench_exactness.py: bf16 cached vs uncached, bitwise, over lengths, tiers and prefill pieces  120 s
#   pytest      pytest -m gpu (tests/gpu, the K/V kernels, the graph step)                                  120 s
#   decode      bench_gpu.py at 512 tokens: decode one stream and 16 rows, the peer (transformers' CB)       120 s
#   invariant   bench_exactness.py --invariant-prefill: bitwise and TTFT (its cost) at 100..32k                150 s
#   invariant4  the same in prefill forwards of 4 chunks (--invariant-piece-chunks 4)                       150 s
#   sweep       bench_exactness.py --sweep: 64 prompts x {uncached, daemon, L0, host tier} x {alone, batched
#               with 7 unrelated requests}, the invariant path (prefill and decode step), bitwise              180 s
#   invcost     bench_gpu.py --invariant-prefill at 512/2k/32k with decode: TTFT, 16-row decode against the
#               variant path's figures of the ttft and decode parts (the default's cost, issue 55 item 3)  240 s
#   compile     bench_compile_step.py: the compiled layer loop under the graphs against the graphs alone   150 s
#   bench       bench_gpu.py --service-defaults --peer-cb: the whole former run (TTFT, stages, decode)      300 s
# Default PARTS: "ttft overhead exactness pytest" (540 s: with the install and the machine's start, inside a 15-minute
# loan and a 10-minute command). Each timeout: <PART>_TIMEOUT (seconds), e.g. TTFT_TIMEOUT=300.
#   PARTS="ttft decode" bench/gpu_check.sh [bench_gpu.py flags for ttft/decode/bench...]
#   DRY_RUN=1 bench/gpu_check.sh        # no GPU needed: the plan (each part, its timeout, its command) and the total
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvboost-gpu}
parts=${PARTS:-ttft overhead exactness pytest}
budget=${BUDGET_S:-540}
declare -A timeouts=([ttft]=240 [overhead]=60 [exactness]=120 [pytest]=120 [decode]=120 [invariant]=150 [compile]=150
                     [bench]=300 [invariant4]=150 [sweep]=180 [invcost]=240)
command_of() {  # the part's command line (its output goes to $out/<part>.log)
  case $1 in
    ttft) echo "python3 bench/bench_gpu.py --service-defaults --decode-tokens 0 --stage-runs 3 --grpc-length 2048 --json $out/ttft.json $EXTRA" ;;
    overhead) echo "python3 bench/bench_overhead.py --parts in-process --device cuda --lengths 2048 32768 --cold-lengths 2048 --rounds 5 --model-dir .whl/negligible-model" ;;
    exactness) echo "python3 bench/bench_exactness.py --json $out/exactness.json" ;;
    pytest) echo "python3 -m pytest -q -m gpu tests/gpu tests/inference_service/kv tests/inference_service/model/test_graph_step.py -p no:cacheprovider" ;;
    decode) echo "python3 bench/bench_gpu.py --lengths 512 --runs 1 --stage-runs 0 --grpc-length 0 --peer-cb --json $out/decode.json $EXTRA" ;;
    invariant) echo "python3 bench/bench_exactness.py --invariant-prefill --json $out/exactness_invariant.json" ;;
    invariant4) echo "python3 bench/bench_exactness.py --invariant-prefill --invariant-piece-chunks 4 --json $out/exactness_invariant4.json" ;;
    sweep) echo "python3 bench/bench_exactness.py --sweep 64 --json $out/sweep.json" ;;
    invcost) echo "python3 bench/bench_gpu.py --invariant-prefill --lengths 512 2048 32768 --runs 3 --stage-runs 0 --grpc-length 0 --json $out/invcost.json $EXTRA" ;;
    compile) echo "python3 bench/bench_compile_step.py --context 512 --rows 1 16 --compile-limit-s ${COMPILE_LIMIT:-60} --budget-s ${COMPILE_BUDGET:-60} --json $out/compile.json" ;;
    bench) echo "python3 bench/bench_gpu.py --service-defaults --peer-cb --json $out/bench_gpu.json $EXTRA" ;;
  esac
}
timeout_of() {
  local name="${1^^}_TIMEOUT"
  echo "${!name:-${timeouts[$1]}}"
}
EXTRA="$*"
total=0
for part in $parts; do
  [[ -n "${timeouts[$part]:-}" ]] || { echo "unknown part '$part' (known: ${!timeouts[*]})" >&2; exit 2; }
  total=$((total + $(timeout_of "$part")))
done
if [[ -n "${DRY_RUN:-}" ]]; then
  for part in $parts; do
    printf '%-10s %4ss  %s\n' "$part" "$(timeout_of "$part")" "$(command_of "$part")"
  done
  echo "total of the parts' timeouts: ${total} s; budget ${budget} s$([[ $total -gt $budget ]] && echo ': the last parts get what is left, or are skipped')"
  exit 0
fi
mkdir -p "$out"
started=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing .whl/*.whl failed: run bench/pack_gpu_wheels.sh where pip can reach PyPI" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD:$PWD/proto" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'cpus', __import__('os').cpu_count())"
echo "== install $((SECONDS - started)) s; parts: $parts (timeouts ${total} s, budget ${budget} s)"
for part in $parts; do
  left=$((budget - (SECONDS - started)))
  limit=$(timeout_of "$part")
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    echo "== $part skipped: ${left} s of the budget left"
    continue
  fi
  echo "== $part $(date +%T) (timeout ${limit} s)"
  part_started=$SECONDS
  timeout "$limit" $(command_of "$part") 2>&1 | grep -v '^Writing' | tee "$out/$part.log" | tail -60
  echo "== $part ended: exit ${PIPESTATUS[0]} after $((SECONDS - part_started)) s"
done
echo "== done $(date +%T): $((SECONDS - started)) s"
