# Sourced by the GPU-host scripts (check.sh, vllm.sh, ...) with $out set: installs the carried wheels
# (once per machine), records the device, refuses a torch that sees no GPU (every GPU test would skip
# and the run would look green), builds the CUDA extension; sets $gpus.
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 JETRL_GPU_OUT="$out" \
  JETRL_REQUIRE_GPU=1
if ls .whl/*.whl >/dev/null 2>&1; then
  stamp=/tmp/site/.wheels-$(ls .whl | md5sum | cut -c1-12)
  [ -f "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/*.whl && touch "$stamp"; } || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "torch $(python3 -c 'import torch; print(torch.__version__)') sees no CUDA GPU here: the GPU tests" \
       "would all skip; run this on a GPU machine with a CUDA build of torch"; exit 1; }
gpus=$(nvidia-smi -L | wc -l)

start=$(date +%s)
# the built extension stays in the tree while the machine is warm: rebuild only when its sources changed
src_sum=$(cat setup.py csrc/* | md5sum | cut -c1-16)
if [ -f "/tmp/jetrl_build.$src_sum" ] && ls megatron_jetrl/_C*.so >/dev/null 2>&1; then
  echo "build: extension unchanged, not rebuilt"
else
  MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1
  build_rc=$?
  echo "build rc=$build_rc ($(( $(date +%s) - start ))s)"
  [ $build_rc -eq 0 ] || { tail -40 "$out/build.log"; exit 1; }
  touch "/tmp/jetrl_build.$src_sum"
fi

