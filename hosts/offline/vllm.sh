#!/usr/bin/env bash
# vLLM on the GPU host, one script: install vLLM from the offline bundle (staged into /tmp/vb by
# the three carrying calls of ../shared/device/vllm/README.md), build the extension, then run what
# is asked for and print the table last. Logs and results accumulate in /tmp/vllm_gpu_out and
# /tmp/bench_vllm while the machine stays warm; both go back packed as $OUT/vllm_gpu.tgz (the
# device tool returns few files).
#
#   bash hosts/offline/vllm.sh [--tests "engine engine-two rl"] [--decode bf16,fp8,fp8kv] [--cases 64x512,...]
#                               [--profile] [--sync in_place,update_weights,reload] [--step] [--table]
#                               [--fp8-gemm auto|cutlass|deep_gemm] [--sync-tp "2:2 2:1"]
# --sync-tp: train:rollout TP layouts for --sync (default 1:1; more than one GPU runs under torchrun).
# --step-modes fp8,bf16,mixed,fp8-vq: the RL-step modes (implies --step); --profile also profiles
# one more step of each (run.profile_steps). --step-args "ARGS": more bench_vllm.py step arguments,
# e.g. "--step-layers 16 --step-response-len 2048 --step-offload --step-mb-tokens 8192" (16384 runs out of
# memory on an H200 at 16 layers beside vLLM at 0.3 of the GPU).
# --decode-args "ARGS": more bench_vllm.py decode arguments, e.g. "--repeats 5 --profile-batch 128".
# --tests names: engine (one-GPU vLLM tests), engine-mismatch (only the logprob-mismatch and FP8-KV
# ones), engine-rest (the others), engine-deep-gemm (vLLM's DeepGEMM block-FP8 GEMM: byte identity,
# and the mismatch against CUTLASS's, so engine_fp8's launch too; the three before leave these out
# and keep their length), engine-two (two GPUs), rl (the RL loop on vLLM; rl-exact: its
# exact-mode runs only; rl-exact-kv: those with an FP8 KV cache), actor-close (the actor's close
# frees its memory), actor-offload (that and the actor's offload, whole and of a given need), exact (the exact rollout's one-GPU tests; exact-tiny / exact-8b: at the tiny
# model's or Qwen3-8B's widths; exact-two: at equal TP 2, two GPUs; exact-four: at equal TP 4 and its negative
# control, four GPUs; exact-grad: the exact update's gradient against the default's; exact-kv: with an FP8 KV cache;
# exact-guard: the start-up self-check and the per-step guard against a fault put into the engine, and
# DP 2 and PP 2 on two GPUs; exact-guard-one: its one-GPU tests; exact-guard-control: of those the one
# without a fault, every step exact; exact-guard-four: TP 2 x DP 2 on four),
# te-attention (the native layers' Transformer Engine attention, actor.attention_impl=te; needs
# --with-te), or a test file.
# --ablation "ARGS": benchmarks/exact_ablation.py all ARGS (e.g. "--models tiny,8b6 --runs exact:fp8"),
# results in /tmp/exact_ablation, its table last.
# --actor "ARGS": the actor-step benchmark (ARGS are bench_actor_step.py's), torchrun on one
# GPU; repeatable. --linear: the FP8 linear benchmark, its headline key into /tmp/bench_vllm/headline_linear.json.
# --kernels: the exact engine's fused norm / SiLU·mul kernels against vLLM's (benchmarks/bench_exact_kernels.py).
# --tp-reduce: the exact rollout's ordered TP reduction against NCCL's and vLLM's custom all-reduce in
# one-stage chunks (timed and bit-checked), torchrun over every visible GPU,
# its headline key into /tmp/bench_vllm/headline_tp_reduce.json.
# DeepGEMM's JIT cache: carried parts in /tmp/dg_jit are unpacked before the first run (hosts/offline/jit_cache.sh).
# --with-te: Transformer Engine for this run only (waits up to 20 min for the five .te_pK folders the
# carrying calls copy to /tmp/teb, runs te_install.sh once, puts /tmp/tesite first on PYTHONPATH with
# JETRL_REQUIRE_TE=1 and the recipe's NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1). Only for the TE runs:
# with TE importable megatron switches its optimizer and norms to TE's, which would change the rest.
#   carrying call K (1-5): mkdir -p /tmp/teb && cp -r .te_pK /tmp/teb/.te_pK.tmp && mv /tmp/teb/.te_pK.tmp /tmp/teb/.te_pK
set -uo pipefail
tests="" decode="" cases="64x512,256x512,64x4096,256x4096" profile="" sync="" step=0 table=0 gemm=auto
sync_tp="1:1" step_modes="fp8,bf16" actor=() linear=0 kernels=0 tp_reduce=0 with_te=0 step_args="" ablation="" decode_args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests="$2"; shift ;;
    --decode) decode="$2"; shift ;;
    --cases) cases="$2"; shift ;;
    --profile) profile="--profile" ;;
    --sync) sync="$2"; shift ;;
    --step) step=1 ;;
    --table) table=1 ;;
    --fp8-gemm) gemm="$2"; shift ;;
    --sync-tp) sync_tp="$2"; shift ;;
    --step-modes) step_modes="$2"; step=1; shift ;;
    --actor) actor+=("$2"); shift ;;
    --linear) linear=1 ;;
    --kernels) kernels=1 ;;
    --tp-reduce) tp_reduce=1 ;;
    --with-te) with_te=1 ;;
    --step-args) step_args="$2"; step=1; shift ;;
    --ablation) ablation="$2"; shift ;;
    --decode-args) decode_args="$2"; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
out=${JETRL_VLLM_OUT:-/tmp/vllm_gpu_out}  # one per lane when two run side by side (lanes.sh)
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
# shellcheck source=hosts/offline/setup.sh
. hosts/offline/setup.sh
# vLLM: the one this Python imports (pip install 'megatron-jetrl[vllm]'); only where there is none, the
# offline bundle carried into /tmp/vb (../shared/device/vllm/README.md), installed once into /tmp/vsite
if ! python3 -c "import vllm" 2>/dev/null; then
  if [ -d /tmp/vb/.vllm_p1 ] && [ ! -f /tmp/vsite/.installed ]; then
    BUNDLE_ROOT=/tmp/vb bash /tmp/vb/.vllm_p1/install.sh >"$out/vllm_install.log" 2>&1 \
      || { tail -30 "$out/vllm_install.log"; exit 1; }
    touch /tmp/vsite/.installed
  fi
  [ -d /tmp/vsite/vllm ] || { echo "no vLLM here: pip install 'megatron-jetrl[vllm]', or carry the offline bundle" \
    "into /tmp/vb (hosts/offline/README.md)"; exit 1; }
  export PYTHONPATH=/tmp/vsite:${PYTHONPATH:-$PWD} VLLM_USE_FLASHINFER_SAMPLER=0  # the bundle has no flashinfer
fi
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 JETRL_REQUIRE_VLLM=1
python3 -c "import vllm; print('vllm', vllm.__version__)" | tee -a "$out/device.txt" || exit 1
# DeepGEMM kernels an earlier machine compiled, carried into /tmp/dg_jit (jit_cache.sh unpacks them once)
if [ -f /tmp/dg_jit/dg_jit.manifest ]; then
  bash hosts/offline/jit_cache.sh unpack /tmp/dg_jit | tee -a "$out/device.txt"
  [ -f /tmp/dg_jit/.unpacked ] && export JETRL_DG_JIT_SEEDED=1  # a decode result records it
fi
if [ $with_te -eq 1 ] && python3 -c "import transformer_engine" 2>/dev/null; then
  export JETRL_REQUIRE_TE=1 NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1  # the Transformer Engine this Python imports
elif [ $with_te -eq 1 ]; then  # none: build it from the parts te_bundle.sh made, carried into /tmp/teb
  for _ in $(seq 120); do
    [ "$(ls -d /tmp/teb/.te_p[1-5] 2>/dev/null | wc -l)" -eq 5 ] && break
    sleep 10
  done
  t0=$(date +%s)
  bash hosts/offline/te_install.sh /tmp/teb >"$out/te_install.log" 2>&1 || { tail -40 "$out/te_install.log"; exit 1; }
  echo "te_install: rc=0 in $(( $(date +%s) - t0 )) s: $(tail -2 "$out/te_install.log" | head -1)"
  export PYTHONPATH=/tmp/tesite:$PYTHONPATH JETRL_REQUIRE_TE=1 NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1
fi

rc=0
for t in $tests; do
  case "$t" in
    engine) f=tests/gpu/test_vllm_engine.py; k="not two_gpus and not deep_gemm" ;;
    engine-mismatch) f=tests/gpu/test_vllm_engine.py; k="(logprobs_match or kv_cache_takes) and not deep_gemm" ;;
    engine-rest) f=tests/gpu/test_vllm_engine.py; k="not two_gpus and not logprobs_match and not kv_cache_takes and not deep_gemm" ;;
    engine-deep-gemm) f=tests/gpu/test_vllm_engine.py; k="deep_gemm" ;;
    engine-two) f=tests/gpu/test_vllm_engine.py; k="two_gpus" ;;
    rl) f=tests/gpu/test_rl_loop.py; k="vllm" ;;
    rl-exact) f=tests/gpu/test_rl_loop.py; k="fp8-exact or fp8kv-exact or vllm-exact" ;;
    rl-exact-kv) f=tests/gpu/test_rl_loop.py; k="fp8kv-exact or vllm-exact-kv" ;;
    actor-close) f=tests/gpu/test_actor.py; k="close_frees" ;;
    actor-offload) f=tests/gpu/test_actor.py; k="offload or close_frees" ;;
    exact) f=tests/gpu/test_exact.py; k="not equal_tp_2 and not tp_4 and not gradient" ;;
    exact-tiny) f=tests/gpu/test_exact.py; k="not 8b_widths and not equal_tp_2 and not tp_4 and not gradient" ;;
    exact-grad) f=tests/gpu/test_exact.py; k="gradient" ;;
    exact-four) f=tests/gpu/test_exact.py; k="tp_4" ;;
    exact-8b) f=tests/gpu/test_exact.py; k="8b_widths" ;;
    exact-two) f=tests/gpu/test_exact.py; k="equal_tp_2" ;;
    exact-kv) f=tests/gpu/test_exact.py; k="fp8_kv_cache" ;;
    exact-guard) f=tests/gpu/test_exact_guard.py; k="not tp_2_with_two" ;;
    exact-guard-one) f=tests/gpu/test_exact_guard.py; k="not several and not tp_2_with_two and not pipeline" ;;
    exact-guard-control) f=tests/gpu/test_exact_guard.py; k="without_a_fault" ;;
    exact-guard-four) f=tests/gpu/test_exact_guard.py; k="tp_2_with_two" ;;
    te-attention) f=tests/gpu/test_te_backend.py; k="packed_attention" ;;
    *) f=$t; k="" ;;
  esac
  t0=$(date +%s) name=$(basename "$t" .py); [ "$t" = "${t#engine-}" ] || name=$t
  python3 -X faulthandler -m pytest -v -s --tb=short -m gpu "$f" ${k:+-k "$k"} -p no:cacheprovider \
    >"$out/test_$name.log" 2>&1
  r=$?; [ $r -eq 0 ] || rc=$r
  echo "$f${k:+ -k $k} rc=$r ($(( $(date +%s) - t0 ))s): $(tail -1 "$out/test_$name.log")"
  grep -E "^(FAILED|ERROR)|Fatal Python error|^E  " "$out/test_$name.log" | head -30
done
[ -d "$out/rl" ] && python3 -m benchmarks.rl_summary "$out"/rl/*.metrics.jsonl --json "$out/rl_summary.json"

if [ $linear -eq 1 ]; then
  t0=$(date +%s)
  mkdir -p /tmp/bench_vllm
  python3 -m benchmarks.bench_fp8_linear --json "$out/bench_fp8_linear.json" \
    --headline /tmp/bench_vllm/headline_linear.json >"$out/bench_fp8_linear.log" 2>&1
  r=$?; [ $r -eq 0 ] || rc=$r
  echo "linear: rc=$r in $(( $(date +%s) - t0 )) s"; grep -v -i warn "$out/bench_fp8_linear.log" | tail -30
fi
if [ $kernels -eq 1 ]; then
  t0=$(date +%s)
  python3 -m benchmarks.bench_exact_kernels --json "$out/exact_kernels.json" >"$out/exact_kernels.log" 2>&1
  r=$?; [ $r -eq 0 ] || rc=$r
  echo "exact kernels: rc=$r in $(( $(date +%s) - t0 )) s"; grep -v -i warn "$out/exact_kernels.log" | tail -30
fi
if [ $tp_reduce -eq 1 ]; then
  t0=$(date +%s)
  mkdir -p /tmp/bench_vllm
  torchrun --standalone --nproc-per-node="$(python3 -c "import torch; print(torch.cuda.device_count())")" -m benchmarks.bench_tp_reduce \
    --vllm-custom --json "$out/tp_reduce.json" --headline /tmp/bench_vllm/headline_tp_reduce.json >"$out/tp_reduce.log" 2>&1
  r=$?; [ $r -eq 0 ] || rc=$r
  echo "tp reduce: rc=$r in $(( $(date +%s) - t0 )) s"; grep -v -i -E "warn|^W[0-9]" "$out/tp_reduce.log" | tail -24
fi
for i in "${!actor[@]}"; do
  t0=$(date +%s)
  # shellcheck disable=SC2086  # the arguments are words
  torchrun --standalone --nproc-per-node=1 -m benchmarks.bench_actor_step ${actor[$i]} \
    --json "$out/actor_$i.json" >"$out/actor_$i.log" 2>&1
  r=$?; [ $r -eq 0 ] || rc=$r
  echo "actor ${actor[$i]}: rc=$r in $(( $(date +%s) - t0 )) s"
  grep -v -i -E "warn|^W[0-9]|\*\*\*|^\[rank|^\[bench" "$out/actor_$i.log" | tail -40
done

if [ -n "$ablation" ]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086  # ablation holds arguments
  python3 -m benchmarks.exact_ablation all $ablation --work /tmp/exact_ablation >"$out/exact_ablation.log" 2>&1
  r=$?; [ $r -eq 0 ] || rc=$r
  echo "exact ablation ($ablation): rc=$r in $(( $(date +%s) - t0 )) s"; tail -60 "$out/exact_ablation.log"
fi

bench=(python3 -m benchmarks.bench_vllm --fp8-gemm "$gemm")
# shellcheck disable=SC2086  # decode_args are words
[ -n "$decode" ] && { "${bench[@]}" decode --modes "$decode" --cases "$cases" $profile $decode_args || rc=1; }
for layout in $sync_tp; do
  [ -n "$sync" ] && { "${bench[@]}" sync --paths "$sync" --train-tp "${layout%:*}" --rollout-tp "${layout#*:}" || rc=1; }
done
# shellcheck disable=SC2086  # step_args are words
[ $step -eq 1 ] && { "${bench[@]}" step --step-modes "$step_modes" $profile $step_args || rc=1; }
if [ $table -eq 1 ]; then
  mkdir -p /tmp/bench_vllm && cp docs/results/headline.json /tmp/bench_vllm/headline.json 2>/dev/null
  "${bench[@]}" table --headline /tmp/bench_vllm/headline.json
fi
[ -n "${OUT:-}" ] && tar czf "$OUT/vllm_gpu.tgz" -C /tmp vllm_gpu_out bench_vllm exact_ablation 2>/dev/null
echo "vllm_gpu rc=$rc"
exit $rc
