#!/usr/bin/env bash
# The Qwen3-8B job at full size with vLLM rollout on every GPU of a 4- or 8-GPU host, in one call.
# It runs python -m benchmarks.bench_rl_full (the suite, whose docstring says what it does) after the
# offline host's install, in the background across device calls.
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
[ "$gpus" -ge 4 ] || { echo "rl_8b_full.sh is for 4 or 8 GPUs; this host has $gpus"; exit 1; }
# the runs, the preemption, the tables and the headline: benchmarks/bench_rl_full.py (what a GPU machine
# with pip runs directly); this script adds the offline host's install and its background run
noresume=(); [ "$preempt" = 1 ] || noresume=(--no-preempt)
rm -rf "$out/work"
python3 -m benchmarks.bench_rl_full --nproc "$gpus" --tp "$tp" --rollout-tp "$rtp" --steps "$steps" \
  --rounds "$rounds" --limit "$limit" "${noresume[@]}" --args "${ARGS:-}" --work "$out/work" \
  --headline "$out/headline.json"
rc_all=$?
[ -n "${OUT:-}" ] && tar czf "$OUT/vllm_8b_multi.tgz" -C "$(dirname "$out")" "$(basename "$out")"
echo "vllm_8b_multi rc=$rc_all"
exit $rc_all
