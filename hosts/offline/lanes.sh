#!/usr/bin/env bash
# The GPU host kept busy on every GPU, in the background so the work runs on between device calls
# while the machine stays warm (each call may last 10 minutes; the machine is held for 30):
#
#   bash hosts/offline/lanes.sh start      # install vLLM (bundle in /tmp/vb), build, start the lanes
#   bash hosts/offline/lanes.sh wait 560   # wait up to 560 s, print progress, pack results to $OUT
#   bash hosts/offline/lanes.sh wait 500 --pack-jit   # ... and DeepGEMM's JIT cache (jit_cache.sh), for the next machine
#   bash hosts/offline/lanes.sh run 2 "--tests exact-tiny"   # one more run on GPU 2, in the background
#   bash hosts/offline/lanes.sh run 0,1 "--tests exact-two"  # ... or on GPUs 0 and 1 (wait waits for it)
#   bash hosts/offline/lanes.sh after 0 1 "--step"           # on GPU 1 once extra run 0 has ended
#
# First all GPUs together (ALL_ARGS; default with 2 or more GPUs: trainer TP=2 into vLLM at rollout
# TP 2 and 1, tests/gpu/test_vllm_engine.py -k two_gpus, and the 8B sync at those layouts). Then one
# lane per GPU side by side (LANE0_ARGS, LANE1_ARGS, ... up to the host's GPU count; once one is
# given, a lane without arguments stays idle). Without any, two lanes (on a one-GPU host, both on
# GPU 0, one after the other):
#   GPU 0: the vLLM decode benchmark, BF16 / FP8 / FP8+FP8-KV one after another on this one GPU
#          (the FP8-over-BF16 ratios compare runs of the same GPU), with kernel profiles;
#   GPU 1: the one-GPU vLLM tests (engine, RL loop), then the sync and the RL-step benchmarks.
# Last, the table (benchmarks/bench_vllm.py table) with the headline figures.
# The arguments are vllm.sh's; " ;; " between two sets runs vllm.sh once per set, in that order, so
# a lane's own order is kept. ALL_ARGS=' ' skips the all-GPU phase.
# The lanes run from this checkout: a folder carried only by an earlier call is gone from it at the
# next call, so what a run needs beyond the tree belongs under /tmp.
# Transformer Engine: give one lane a `--with-te ...` run and carry the five .te_pK folders
# of hosts/offline/te_bundle.sh along the `wait` calls (the command is in te_bundle.sh's header).
# The lanes share the host: each is pinned to its share of the CPU cores (taskset), since a
# host-bound benchmark in one lane slows down while another compiles.
set -uo pipefail
lanes=${JETRL_LANES:-/tmp/lanes}  # the lanes' plan and logs (a test points it elsewhere)
case "${1:-}" in
  start)
    mkdir -p $lanes
    # install and build once, in the foreground (the lanes would otherwise race for them)
    JETRL_VLLM_OUT=/tmp/vllm_gpu_out/setup bash hosts/offline/vllm.sh || exit 1
    gpus=$(nvidia-smi -L | wc -l)
    [ "$gpus" -ge 1 ] || { echo "lanes.sh: nvidia-smi lists no GPU here"; exit 1; }
    default_lane=("--decode bf16,fp8,fp8kv --profile" '--tests "engine rl" --sync in_place,update_weights,reload --step')
    if [ "$gpus" -ge 2 ]; then
      all=${ALL_ARGS:-'--tests engine-two --sync in_place --sync-tp "2:2 2:1"'}
    else  # one GPU: nothing runs on all GPUs together; the two default lanes, one after the other
      all=${ALL_ARGS:-' '}
      default_lane=("${default_lane[0]} ;; ${default_lane[1]}")
    fi
    given=$(compgen -v | grep -E '^LANE[0-9]+_ARGS$')
    [ -n "$given" ] && default_lane=()  # lanes named: the others stay idle
    for v in $given; do
      n=${v#LANE}; n=${n%_ARGS}
      [ "$n" -lt "$gpus" ] || { echo "$v given, but this host has $gpus GPUs (lanes 0..$(( gpus - 1 )))"; exit 1; }
    done
    share=$(( $(nproc) / gpus ))
    lane() {  # GPU, arguments with " ;; " between runs: one vllm.sh line per run
      local cpus=""
      command -v taskset >/dev/null && [ "$share" -ge 1 ] && cpus="taskset -c $(( $1 * share ))-$(( $1 * share + share - 1 ))"
      echo "${2// ;; /$'\n'}" | while IFS= read -r run; do
        echo "CUDA_VISIBLE_DEVICES=$1 JETRL_VLLM_OUT=/tmp/vllm_gpu_out/gpu$1 $cpus bash hosts/offline/vllm.sh $run" \
          ">>$lanes/gpu$1.log 2>&1 || rc=1"
      done
    }
    {
      echo "cd \"$PWD\""
      echo "export PATH=\"$PATH\" PYTHONPATH=\"${PYTHONPATH:-}\" OUT="
      echo "JETRL_VLLM_OUT=/tmp/vllm_gpu_out/all bash hosts/offline/vllm.sh $all >$lanes/all.log 2>&1"
      for g in $(seq 0 $(( gpus - 1 ))); do
        v=LANE${g}_ARGS
        args=${!v:-${default_lane[$g]:-}}
        [ -n "${args// /}" ] || continue
        echo "( rc=0"
        lane "$g" "$args"
        echo "  echo \"lane rc=\$rc\" >>$lanes/gpu$g.log ) &"
      done
      echo "wait"
      echo "JETRL_VLLM_OUT=/tmp/vllm_gpu_out/table bash hosts/offline/vllm.sh --table >$lanes/table.log 2>&1"
      echo "touch $lanes/done"
    } >$lanes/plan.sh
    setsid nohup bash $lanes/plan.sh >$lanes/plan.log 2>&1 </dev/null &
    echo "lanes started on $gpus GPUs (pid $!)"
    ;;
  run)  # one more run on GPUs no lane uses (or whose lane is done), in the background: lanes.sh run GPUS "ARGS"
    [ -f $lanes/plan.sh ] || { echo "start the lanes first"; exit 1; }
    # the run's number, claimed atomically (mkdir): runs queued by `after` may start at the same moment
    n=0; while ! mkdir "$lanes/extra$n.claimed" 2>/dev/null; do n=$((n + 1)); done
    : >"$lanes/extra$n.log"  # `wait` sees the run from here on
    # shellcheck disable=SC2016  # expanded by the started shell
    setsid nohup bash -c "cd '$PWD' && CUDA_VISIBLE_DEVICES=$2 JETRL_VLLM_OUT=/tmp/vllm_gpu_out/extra$n \
      bash hosts/offline/vllm.sh $3 >$lanes/extra$n.log 2>&1; echo \"lane rc=\$?\" >>$lanes/extra$n.log" \
      >/dev/null 2>&1 </dev/null &
    echo "extra run $n on GPU $2: $3"
    ;;
  after)  # lanes.sh after N GPUS "ARGS": one more run on GPUS once extra run N has ended (waits in the background)
    [ -f $lanes/plan.sh ] || { echo "start the lanes first"; exit 1; }
    pending=$lanes/pending.$$.$RANDOM
    echo "after extra $2: GPU $3: $4" >"$pending"
    setsid nohup bash -c "cd '$PWD' && while ! grep -qs '^lane rc=' $lanes/extra$2.log; do sleep 5; done; \
      bash hosts/offline/lanes.sh run $3 '$4' && rm -f $pending" >/dev/null 2>&1 </dev/null &
    echo "queued after extra run $2 on GPU $3: $4"
    ;;
  wait)
    # no plan: this machine never started the lanes (the one that did went back 30 s after its last call)
    [ -f $lanes/plan.sh ] || { echo "no lanes on this machine ($lanes/plan.sh is missing): the machine that ran" \
      "'start' was given back; start again after the bundle's carrying calls"; exit 1; }
    end=$(( $(date +%s) + ${2:-560} ))
    running() {  # the planned lanes, or an extra run, not finished
      [ -f $lanes/done ] || return 0
      ls $lanes/pending.* >/dev/null 2>&1 && return 0
      for f in $lanes/extra*.log; do [ -f "$f" ] && ! grep -q "^lane rc=" "$f" && return 0; done
      return 1
    }
    while running && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    for f in $lanes/all.log $lanes/gpu*.log $lanes/extra*.log $lanes/table.log; do
      [ -f "$f" ] && { echo "== $(basename "$f" .log)"; grep -vE "^\s*$" "$f" | tail -25; }
    done
    ls /tmp/bench_vllm 2>/dev/null | tr '\n' ' '; echo
    running && echo "still running" || echo "ALL DONE"
    [ -n "${OUT:-}" ] && tar czf "$OUT/vllm_gpu.tgz" -C /tmp vllm_gpu_out bench_vllm exact_ablation \
      -C "$(dirname $lanes)" "$(basename $lanes)" 2>/dev/null
    [ "${3:-}" = --pack-jit ] && [ -n "${OUT:-}" ] && bash hosts/offline/jit_cache.sh pack "$OUT"
    true
    ;;
  *) echo "usage: lanes.sh start | wait SECONDS [--pack-jit] | run GPUS ARGS | after N GPUS ARGS"; exit 2 ;;
esac
