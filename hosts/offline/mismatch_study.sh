#!/usr/bin/env bash
# The mismatch and speed study as one call on a GPU host (one GPU, H100 or H200):
# build, then benchmarks/mismatch_study.py, then the tables last. The runs' metrics, logs and
# study.json come back as $OUT/study.tgz; plots are drawn from them anywhere matplotlib is:
#   device tool:  carry [".whl"], command: bash hosts/offline/mismatch_study.sh [--steps 40] [--parallel 8]
#   then here:    tar xzf study.tgz && python3 -m benchmarks.mismatch_plots study --out docs/figures
# Arguments go to mismatch_study.py (e.g. --seed 2 --no-speed for a second seed). A device call is
# limited to 10 minutes: the study gets what is left of STUDY_CALL_S (default 570 s) after the
# build as its --budget, and STUDY_TIMEOUT (s, default 240) bounds each run, so that the call
# always ends with the tables and the metrics of whatever ran.
set -uo pipefail
t_call=$(date +%s)
out=${OUT:-study_out}
# shellcheck source=hosts/offline/setup.sh
. hosts/offline/setup.sh
dir=/tmp/study
rm -rf "$dir"
t0=$(date +%s)
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 2000 >"$out/gpu_use.csv" &
smi=$!
# The study stops its runs in time to print and pack what it has inside the call's limit.
budget=$(( ${STUDY_CALL_S:-570} - ($(date +%s) - t_call) ))
python3 -m benchmarks.mismatch_study --out "$dir" --timeout "${STUDY_TIMEOUT:-240}" --budget "$budget" "$@" \
  >"$out/study.log" 2>&1
rc=$?
kill $smi 2>/dev/null
find "$dir" -name "checkpoints" -prune -o \( -name "*.jsonl" -o -name "*.log" -o -name "*.json" \) \
  -print | tar czf "$out/study.tgz" --transform "s|^${dir#/}|study|" -T - 2>/dev/null
grep "^\[study\]" "$out/study.log"
echo "study rc=$rc ($(( $(date +%s) - t0 )) s); GPU memory used, max $(sort -t, -k1 -n "$out/gpu_use.csv" | tail -1 | cut -d, -f1) MiB"
sed -n '/^| run/,$p' "$out/study.log"
exit $rc
