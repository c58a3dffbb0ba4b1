#!/usr/bin/env bash
# The scale run, one call on a 4-GPU host (H200): Qwen3-32B layer dimensions with
# $LAYERS of its 64 layers (random weights), unified FP8, three RL steps through `jetrl train`
# under torchrun, at TP=4 and at TP=2 x PP=2; the full 64-layer model's memory plan; the full
# recompute check on one GPU; then the summary table (benchmarks/scale_summary.py) last.
#   device tool:  kind nvidia-h200-x4, carry [".whl"], command: bash hosts/offline/scale_32b_layers.sh
# Logs, metrics and the JSON summary go to $OUT (or ./scale_out) as scale_logs.tgz + scale.json.
set -uo pipefail
out=${OUT:-scale_out}
# shellcheck source=hosts/offline/setup.sh
. hosts/offline/setup.sh
t_start=$(date +%s)
layers=${LAYERS:-32}
cfg=benchmarks/configs/qwen3_32b_dims.yaml
runs=/tmp/scale_runs
logs=/tmp/scale_logs
rm -rf "$runs" "$logs" && mkdir -p "$runs" "$logs"
rc_all=0

train() {  # name, time limit (s), overrides...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -k 20 "$limit" torchrun --standalone --nproc-per-node="$gpus" -m megatron_jetrl.cli train "$cfg" \
    run.dir="$runs/$name" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  pkill -9 -f "megatron_jetrl.cli train" && sleep 3  # workers a killed torchrun left behind hold GPU memory
  echo "train $name rc=$rc ($(( $(date +%s) - t0 ))s)"
  [ $rc -eq 0 ] || { rc_all=$rc; grep -E "Error|error:|Traceback" "$logs/$name.log" | grep -v -i warn | head -8; }
  return $rc
}

runs_wanted=${RUNS:-tp4 tp2pp2}
[[ " $runs_wanted " == *" tp4 "* ]] && train tp4 190 model.config.num_hidden_layers="$layers" actor.parallel.tp=4
[[ " $runs_wanted " == *" tp2pp2 "* ]] && train tp2pp2 190 model.config.num_hidden_layers="$layers" \
  actor.parallel.tp=2 actor.parallel.pp=2
if [ "${EXTRAS:-1}" = 1 ]; then

# full activation recompute against none, one GPU (the recompute scenario of tests/gpu/test_actor.py)
timeout 90 torchrun --standalone --nproc-per-node=1 tests/gpu/actor_worker.py --root /tmp/recompute \
  --scenarios recompute >"$logs/recompute.log" 2>&1
echo "recompute scenario rc=$?"

# what the whole Qwen3-32B would need on these 4 GPUs (the memory plan; no GPU work)
for offload in false true; do
  python3 -m megatron_jetrl.cli check "$cfg" --world-size 4 --gpu-memory H200 model.config.num_hidden_layers=64 \
    actor.parallel.tp=4 rollout.offload_actor=$offload >"$logs/check64_offload_$offload.log" 2>&1
done
fi

cp /tmp/recompute/results.json "$logs/recompute_results.json" 2>/dev/null
for f in "$runs"/*/metrics.jsonl; do cp "$f" "$logs/$(basename "$(dirname "$f")").metrics.jsonl"; done
tar czf "$out/scale_logs.tgz" -C /tmp scale_logs
echo
echo "== 64-layer Qwen3-32B on 4 x H200, TP=4 (memory plan)"
grep -E "trainer total|peak|WARNING|config OK" /dev/null "$logs"/check64_offload_*.log 2>/dev/null | sed 's|.*/scale_logs/||'
echo
echo "== recompute (1 GPU)"
python3 -c "import json; print(json.dumps(json.load(open('/tmp/recompute/results.json')), indent=1))" 2>&1 | head -40
echo
echo "== scale runs ($((($(date +%s) - t_start))) s)"
python3 -m benchmarks.scale_summary "$runs"/* --world-size "$gpus" --json "$out/scale.json"
exit $rc_all
