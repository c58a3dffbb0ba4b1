#!/usr/bin/env bash
# A 2-GPU host kept busy on both GPUs, in the background so the work runs on between device calls
# while the machine stays warm (each call may last 10 minutes; the machine is held for 30):
#
#   bash benchmarks/vllm_two_gpus.sh start      # install vLLM (bundle in /tmp/vb), build, start the lanes
#   bash benchmarks/vllm_two_gpus.sh wait 560   # wait up to 560 s, print progress, pack results to $OUT
#
# First both GPUs: trainer TP=2 into vLLM at rollout TP 2 and 1 (tests/gpu/test_vllm_engine.py -k
# two_gpus) and the 8B sync at those layouts. Then two lanes side by side:
#   GPU 0: the vLLM decode benchmark, BF16 / FP8 / FP8+FP8-KV one after another on this one GPU
#          (the FP8-over-BF16 ratios compare runs of the same GPU), with kernel profiles;
#   GPU 1: the one-GPU vLLM tests (engine, RL loop), then the sync and the RL-step benchmarks.
# Last, the table (benchmarks/bench_vllm.py table) with the headline figures.
# Transformer Engine (issue 17): give one lane a `--with-te ...` run and carry the five .te_pK folders
# of benchmarks/te_bundle.sh along the `wait` calls (the command is in te_bundle.sh's header).
# The lanes share the host: each is pinned to half of the CPU cores (taskset), since a host-bound
# benchmark in one lane slows down while the other compiles. Override the phases with BOTH_ARGS / LANE0_ARGS / LANE1_ARGS (vllm_gpu.sh arguments; " ;; " between
# two sets runs vllm_gpu.sh once per set, in that order, so a lane's own order is kept).
set -uo pipefail
lanes=/tmp/lanes
case "${1:-}" in
  start)
    mkdir -p $lanes
    # install and build once, in the foreground (both lanes would otherwise race for them)
    JETRL_VLLM_OUT=/tmp/vllm_gpu_out/setup bash benchmarks/vllm_gpu.sh || exit 1
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "vllm_two_gpus.sh needs 2 GPUs; use vllm_gpu.sh"; exit 1; }
    both=${BOTH_ARGS:-'--tests engine-two --sync in_place --sync-tp "2:2 2:1"'}
    lane0=${LANE0_ARGS:-"--decode bf16,fp8,fp8kv --profile"}
    lane1=${LANE1_ARGS:-'--tests "engine rl" --sync in_place,update_weights,reload --step'}
    # Each lane gets its own half of the CPU cores: a host-bound phase (vLLM's scheduler, the RL
    # step's generate) timed on one GPU while the other lane compiles vLLM on every core measured
    # 1.4x slower (2026-11-25: the step's fp8 row, re-labelled in docs/benchmarks.md).
    half=$(( $(nproc) / 2 ))
    lane() {  # GPU, arguments with " ;; " between runs: one vllm_gpu.sh line per run
      local cpus=""
      command -v taskset >/dev/null && cpus="taskset -c $(( $1 * half ))-$(( $1 * half + half - 1 ))"
      echo "${2// ;; /$'\n'}" | while IFS= read -r run; do
        echo "CUDA_VISIBLE_DEVICES=$1 JETRL_VLLM_OUT=/tmp/vllm_gpu_out/gpu$1 $cpus bash benchmarks/vllm_gpu.sh $run" \
          ">>$lanes/gpu$1.log 2>&1 || rc=1"
      done
    }
    cat >$lanes/plan.sh <<EOF
cd "$PWD"
export PATH="$PATH" PYTHONPATH="${PYTHONPATH:-}" OUT=
JETRL_VLLM_OUT=/tmp/vllm_gpu_out/both bash benchmarks/vllm_gpu.sh $both >$lanes/both.log 2>&1
( rc=0
$(lane 0 "$lane0")
  echo "lane rc=\$rc" >>$lanes/gpu0.log ) &
( rc=0
$(lane 1 "$lane1")
  echo "lane rc=\$rc" >>$lanes/gpu1.log ) &
wait
JETRL_VLLM_OUT=/tmp/vllm_gpu_out/table bash benchmarks/vllm_gpu.sh --table >$lanes/table.log 2>&1
touch $lanes/done
EOF
    setsid nohup bash $lanes/plan.sh >$lanes/plan.log 2>&1 </dev/null &
    echo "lanes started (pid $!)"
    ;;
  wait)
    end=$(( $(date +%s) + ${2:-560} ))
    while [ ! -f $lanes/done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    for f in both gpu0 gpu1 table; do
      [ -f $lanes/$f.log ] && { echo "== $f"; grep -vE "^\s*$" $lanes/$f.log | tail -25; }
    done
    ls /tmp/bench_vllm 2>/dev/null | tr '\n' ' '; echo
    [ -f $lanes/done ] && echo "ALL DONE" || echo "still running"
    [ -n "${OUT:-}" ] && tar czf "$OUT/vllm_gpu.tgz" -C /tmp vllm_gpu_out bench_vllm lanes 2>/dev/null
    true
    ;;
  *) echo "usage: vllm_two_gpus.sh start | wait SECONDS"; exit 2 ;;
esac
