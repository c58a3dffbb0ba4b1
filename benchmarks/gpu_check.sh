#!/usr/bin/env bash
# One call on the GPU host: install the carried wheels, build the CUDA extension, run every GPU
# test and every benchmark, and print the summary tables last.
#   device tool:  carry [".whl"], command: bash benchmarks/gpu_check.sh
# Logs and JSON go to $OUT (or ./gpu_check_out when $OUT is unset).
#   bash benchmarks/gpu_check.sh [--tests-only] [extra_script.py ...]
set -uo pipefail
tests_only=0
if [ "${1:-}" = "--tests-only" ]; then tests_only=1; shift; fi
out=${OUT:-gpu_check_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"

start=$(date +%s)
MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1
build_rc=$?
echo "build rc=$build_rc ($(( $(date +%s) - start ))s)"
[ $build_rc -eq 0 ] || { tail -40 "$out/build.log"; exit 1; }

for extra in "$@"; do python3 -X faulthandler "$extra" 2>&1 | tee -a "$out/extra.log"; done

gpu_rc=0
for f in tests/gpu/test_*.py; do
  python3 -X faulthandler -m pytest -v --tb=short -m gpu "$f" -p no:cacheprovider >"$out/$(basename "$f" .py).log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || gpu_rc=$rc
  echo "$f rc=$rc: $(tail -1 "$out/$(basename "$f" .py).log")"
  grep -E "^(FAILED|ERROR)|Fatal Python error" "$out/$(basename "$f" .py).log" | head -20
done
python3 -m pytest -q tests/unit tests/dist -p no:cacheprovider 2>&1 | tee "$out/unit_tests.log" | tail -3
unit_rc=${PIPESTATUS[0]}

bench_rc=0
if [ $tests_only -eq 0 ]; then
  python3 benchmarks/bench_fp8_linear.py --json "$out/bench_fp8_linear.json" 2>&1 | tee "$out/bench.log"
  bench_rc=${PIPESTATUS[0]}
  # Qwen3-8B-shaped layers that fit one GPU with fp32 Adam state: 12 on an H200 (peak ~90 GB), 6 on an H100
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  layers=${ACTOR_BENCH_LAYERS:-$([ "$mem_mib" -ge 120000 ] && echo 12 || echo 6)}
  CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc-per-node=1 benchmarks/bench_actor_step.py --layers "$layers" \
    --json "$out/bench_actor_tp1.json" >"$out/bench_actor_tp1.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || bench_rc=$rc
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_actor_step.py --layers "$layers" --tp 2 \
      --json "$out/bench_actor_tp2.json" >"$out/bench_actor_tp2.log" 2>&1
    rc=$?; [ $rc -eq 0 ] || bench_rc=$rc
  fi
fi
echo
for f in "$out"/bench_actor_tp*.log; do [ -f "$f" ] && grep -v -i warn "$f" | tail -8; done
echo "gpu tests rc=$gpu_rc  unit tests rc=$unit_rc  benchmark rc=$bench_rc"
[ $gpu_rc -eq 0 ] && [ $unit_rc -eq 0 ] && [ $bench_rc -eq 0 ]
