#!/usr/bin/env bash
# One call on the GPU host: install the carried wheels, build the CUDA extension, run every GPU
# test and every benchmark, and print the summary tables last.
#   device tool:  carry [".whl"], command: bash hosts/offline/check.sh
# Logs and JSON go to $OUT (or ./gpu_check_out when $OUT is unset).
#   bash hosts/offline/check.sh [--tests-only | --bench-only] [--tests "tests/gpu/test_a.py ..."]
#                                [--benches "fp8_linear actor sync decode"] [--no-unit]
# A device call is limited to 10 minutes: on a fresh 2-GPU host run --tests-only and --bench-only
# as two calls (the build is reused while the machine stays warm).
set -uo pipefail
run_tests=1 run_bench=1 run_unit=1 tests="tests/gpu/test_*.py" benches="fp8_linear actor sync decode"
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) run_bench=0 ;;
    --bench-only) run_tests=0 ;;
    --tests) tests="$2"; shift ;;
    --benches) benches="$2"; shift ;;
    --no-unit) run_unit=0 ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
out=${OUT:-gpu_check_out}
# shellcheck source=hosts/offline/setup.sh
. hosts/offline/setup.sh

gpu_rc=0 unit_rc=0 bench_rc=0
if [ $run_tests -eq 1 ]; then
  for f in $tests; do
    t0=$(date +%s)
    python3 -X faulthandler -m pytest -v -s --tb=short -m gpu "$f" -p no:cacheprovider >"$out/$(basename "$f" .py).log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || gpu_rc=$rc
    echo "$f rc=$rc ($(( $(date +%s) - t0 ))s): $(tail -1 "$out/$(basename "$f" .py).log")"
    grep -E "^(FAILED|ERROR)|Fatal Python error" "$out/$(basename "$f" .py).log" | head -20
  done
  if [ $run_unit -eq 1 ]; then
    python3 -m pytest -q -x tests/unit tests/dist -p no:cacheprovider 2>&1 | tee "$out/unit_tests.log" | tail -3
    unit_rc=${PIPESTATUS[0]}
  fi
fi

bench() {  # name, command...
  local name=$1; shift
  local t0; t0=$(date +%s)
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || bench_rc=$rc
  echo "bench $name rc=$rc ($(( $(date +%s) - t0 ))s)"
}
if [ $run_bench -eq 1 ]; then
  wants() { [[ " $benches " == *" $1 "* ]]; }
  wants fp8_linear && bench bench_fp8_linear python3 -m benchmarks.bench_fp8_linear --json "$out/bench_fp8_linear.json"
  # Qwen3-8B-shaped layers that fit one GPU with fp32 Adam state: 12 on an H200 (peak ~90 GB), 6 on an H100
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  layers=${ACTOR_BENCH_LAYERS:-$([ "$mem_mib" -ge 120000 ] && echo 12 || echo 6)}
  wants actor && bench bench_actor_tp1 env CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc-per-node=1 \
    -m benchmarks.bench_actor_step --layers "$layers" --json "$out/bench_actor_tp1.json"
  wants sync && bench bench_sync_1gpu env CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc-per-node=1 \
    -m benchmarks.bench_weight_sync --json "$out/bench_sync_1gpu.json"
  wants decode && bench bench_rollout_decode env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_rollout_decode \
    --json "$out/bench_rollout_decode.json"
  if [ "$gpus" -ge 2 ]; then
    wants actor && bench bench_actor_tp2 torchrun --standalone --nproc-per-node=2 -m benchmarks.bench_actor_step \
      --layers "$layers" --tp 2 --json "$out/bench_actor_tp2.json"
    wants sync && bench bench_sync_2gpu torchrun --standalone --nproc-per-node=2 -m benchmarks.bench_weight_sync \
      --tp 2 --rollout-tp 1 2 --json "$out/bench_sync_2gpu.json"
  fi
  echo
  [ -f "$out/bench_fp8_linear.log" ] && grep -v -i warn "$out/bench_fp8_linear.log" | tail -12
  for f in "$out"/bench_actor_tp*.log "$out"/bench_sync_*.log "$out"/bench_rollout_decode.log; do
    [ -f "$f" ] && { echo "== $(basename "$f")"; grep -v -i -E "warn|^W[0-9]|\*\*\*|^\[rank" "$f" | tail -12; }
  done
fi
if ls "$out"/rl/*.metrics.jsonl >/dev/null 2>&1; then  # RL runs of tests/gpu/test_rl_loop.py
  echo "== RL runs"
  python3 -m benchmarks.rl_summary "$out"/rl/*.metrics.jsonl --json "$out/rl_summary.json"
fi
echo "gpu tests rc=$gpu_rc  unit tests rc=$unit_rc  benchmark rc=$bench_rc"
[ $gpu_rc -eq 0 ] && [ $unit_rc -eq 0 ] && [ $bench_rc -eq 0 ]
