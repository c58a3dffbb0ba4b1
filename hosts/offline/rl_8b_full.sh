#!/usr/bin/env bash
# The Qwen3-8B job at full size with vLLM rollout on every GPU of a 4- or 8-GPU host, in one call.
# Qwen3-8B at real shapes (36 layers, vocab 151936, random weights; benchmarks/configs/qwen3_8b_dims.yaml
# with all its layers), `jetrl train` under torchrun: FP8 (unified; exact where the layout allows it, as
# precision.exact=auto decides: trainer TP = rollout TP) and BF16 (the default rollout, with its
# recompute) for $STEPS steps each, $ROUNDS times;
# then a SIGUSR1 -> checkpoint -> resume of the FP8 job on its own directory; `jetrl check`'s memory
# plan for the same layout beside the measured peak per GPU; the table last.
#
#   device: kind nvidia-h100-x4 (or -x8 / h200), after the vLLM bundle's three carrying calls, the
#   third carrying [".vllm_p3", ".whl"]:  bash hosts/offline/rl_8b_full.sh start
#   then, back to back until it says ALL DONE:   bash hosts/offline/rl_8b_full.sh wait 560
#   (the whole run takes longer than one call; it runs on in the background while the machine is held)
#   TP (trainer, default 4), RTP (vLLM, default TP: the exact rollout's layout), STEPS (default 5) override the layout. ROUNDS
#   (default 2): how many times both modes run, fp8 then bf16, then bf16 then fp8, ... (at this layout
#   two runs of one mode differed by about 20 % in step time, more than the modes differ; the headline
#   pools the rounds). LIMIT: seconds each training run may take (default 540; a fresh host's first FP8
#   engine start JIT-compiles DeepGEMM's kernels, 5.4 min at vLLM TP 2, so a first run there wants
#   ~900; a later one starts from the on-disk cache in ~35 s). PREEMPT=0
#   skips the checkpoint/resume part; ARGS adds overrides to every run (e.g. STEPS=6
#   ARGS="run.profile_steps=[6]": one more step, profiled by kernel class into the run directory and
#   left out of the timed steps). Responses have fixed lengths (ignore_eos), so both modes do the
#   same work; the timed steps (3..STEPS: step 1 captures graphs and compiles, step 2's offload pins
#   the optimizer state's host memory, once) give the headline figures rl_step_8b_full_* in
#   $out/headline.json (merge them with python -m benchmarks.headline merge).
# Logs, metrics, the runs' configs and step profiles go back as $OUT/vllm_8b_multi.tgz. Without an argument it runs
# in the foreground.
set -uo pipefail
out=${JETRL_8B_OUT:-/tmp/vllm_8b_out}  # where the run keeps its logs (a test points it elsewhere)
[[ "${ROUNDS:-2}" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS=${ROUNDS}: give a whole number >= 1 (how many times" \
  "both modes run)"; exit 1; }
case "${1:-}" in
  start)
    mkdir -p "$out"
    OUT= setsid nohup bash "$0" >"$out/main.log" 2>&1 </dev/null &
    echo "started in the background (log $out/main.log)"
    exit 0 ;;
  wait)
    # no log: this machine never started the run (the one that did went back 30 s after its last call)
    [ -f "$out/main.log" ] || { echo "no run on this machine ($out/main.log is missing): the machine that ran" \
      "'start' was given back; start again after the bundle's carrying calls"; exit 1; }
    end=$(( $(date +%s) + ${2:-560} ))
    while ! grep -q "^vllm_8b_multi rc=" "$out/main.log" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    tail -40 "$out/main.log"
    grep -q "^vllm_8b_multi rc=" "$out/main.log" && echo "ALL DONE" || echo "still running"
    [ -n "${OUT:-}" ] && tar czf "$OUT/vllm_8b_multi.tgz" -C "$(dirname "$out")" "$(basename "$out")"
    exit 0 ;;
esac
JETRL_VLLM_OUT=$out/setup bash hosts/offline/vllm.sh || exit 1  # installs vLLM, builds the extension
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
export PYTHONPATH=/tmp/vsite:${PYTHONPATH:-$PWD} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
  HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
tp=${TP:-4} rtp=${RTP:-$tp} steps=${STEPS:-5} preempt=${PREEMPT:-1} limit=${LIMIT:-540} rounds=${ROUNDS:-2}
extra=(${ARGS:-})
command="TP=$tp RTP=$rtp STEPS=$steps ROUNDS=$rounds LIMIT=$limit PREEMPT=$preempt ARGS='${ARGS:-}' bash hosts/offline/rl_8b_full.sh"
[ "$gpus" -ge 4 ] || { echo "vllm_8b_multi.sh is for 4 or 8 GPUs; this host has $gpus"; exit 1; }
cfg=benchmarks/configs/qwen3_8b_dims.yaml
layout=(model.config.num_hidden_layers=36 rollout.engine=vllm actor.parallel.tp="$tp"
        actor.parallel.sequence_parallel=true rollout.vllm.tensor_parallel_size="$rtp"
        rollout.offload_actor=true rollout.vllm.gpu_memory_utilization=0.7 rollout.sampling.ignore_eos=true
        log.console=false run.save_every=0 "${extra[@]}")
runs=/tmp/vllm_8b_runs
rm -rf "$runs" && mkdir -p "$runs" "$out"
rc_all=0

python3 -m megatron_jetrl.cli check "$cfg" --world-size "$gpus" "${layout[@]}" run.steps="$steps" >"$out/plan.log" 2>&1
echo "plan ($gpus GPUs, TP=$tp, rollout TP=$rtp):"; grep -E "peak|trainer total|WARNING|config OK" "$out/plan.log"

train() {  # name, time limit (s), overrides...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -k 20 "$limit" torchrun --standalone --nproc-per-node="$gpus" -m megatron_jetrl.cli train "$cfg" \
    run.dir="$runs/$name" "${layout[@]}" "$@" >>"$out/$name.log" 2>&1
  local rc=$?
  echo "train $name rc=$rc ($(( $(date +%s) - t0 ))s)"
  return $rc
}

pairs=()  # the rounds' run directories, for the summary
for round in $(seq 1 "$rounds"); do
  order="fp8 bf16"; [ $((round % 2)) = 0 ] && order="bf16 fp8"  # ABBA: drift over the rounds cancels
  suffix=""; [ "$round" = 1 ] || suffix=".r$round"
  for mode in $order; do
    pairs+=("$runs/$mode$suffix")
    exact=(); [ "$mode" = bf16 ] && exact=(precision.exact=false)  # BF16 with its recompute, FP8 exact (auto)
    train "$mode$suffix" "$limit" precision.mode="$mode" "${exact[@]}" run.steps="$steps" run.save_at_end=false \
      || { rc_all=1; grep -E "Error|error:|Traceback" "$out/$mode$suffix.log" | grep -v -i warn | head -8; }
  done
done

if [ "$preempt" = 1 ]; then
  # SIGUSR1 -> checkpoint -> resume: the workers (not torchrun) get the signal once step 2 is logged;
  # they checkpoint after the step they are in and exit 75 (torchrun reports that as its own failure);
  # the same command then continues from that checkpoint to the last step
  ( train preempt 540 precision.mode=fp8 run.steps=4 ) &
  job=$!
  for _ in $(seq 1 480); do
    [ "$(grep -c '"step": 2,' "$runs/preempt/metrics.jsonl" 2>/dev/null)" -ge 1 ] && break
    kill -0 $job 2>/dev/null || break
    sleep 1
  done
  pgrep -f "megatron_jetrl.cli train .*$runs/preempt" | while read -r pid; do
    grep -qa "torch.distributed.run\|torchrun" "/proc/$pid/cmdline" || kill -USR1 "$pid"
  done
  wait $job
  saved=$(cat "$runs/preempt/checkpoints/latest" 2>/dev/null || echo none)
  stopped_at=$(grep -c '"reward/mean"' "$runs/preempt/metrics.jsonl" 2>/dev/null)
  train preempt 540 precision.mode=fp8 run.steps=4; second=$?
  done_steps=$(grep -c '"reward/mean"' "$runs/preempt/metrics.jsonl" 2>/dev/null)
  echo "preempt: stopped after $stopped_at steps with checkpoint $saved; the rerun (rc=$second) ended with" \
    "$done_steps logged steps"
  [ "$saved" != none ] && [ "$stopped_at" -lt 4 ] && [ $second -eq 0 ] && [ "$done_steps" -ge 4 ] || rc_all=1
fi

for f in "$runs"/*/metrics.jsonl; do
  d=$(dirname "$f"); n=$(basename "$d")
  cp "$f" "$out/$n.metrics.jsonl"; cp "$d/config.yaml" "$out/$n.config.yaml" 2>/dev/null
  for p in "$d"/profiles/step_*.json; do [ -f "$p" ] && cp "$p" "$out/$n.$(basename "$p")"; done  # run.profile_steps
done
echo
echo "== Qwen3-8B, $gpus x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), TP=$tp, rollout TP=$rtp"
python3 -m benchmarks.rl_summary "$out"/*.metrics.jsonl --json "$out/summary.json" 2>&1 | tail -12
python3 -m benchmarks.scale_summary "${pairs[@]}" --world-size "$gpus" --json "$out/scale.json" \
  --headline "$out/headline.json" --headline-key rl_step_8b_full --command "$command" 2>&1 || rc_all=1
[ -n "${OUT:-}" ] && tar czf "$OUT/vllm_8b_multi.tgz" -C "$(dirname "$out")" "$(basename "$out")"
echo "vllm_8b_multi rc=$rc_all"
exit $rc_all
