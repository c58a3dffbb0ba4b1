#!/usr/bin/env bash
# On the GPU host: Transformer Engine 2.20.2 from the folders hosts/offline/te_bundle.sh staged (copied
# to /tmp/teb by the carrying calls) into /tmp/tesite. Checks every file against the manifest
# first and names a missing or damaged one; builds transformer-engine-torch (33 C++ files, no CUDA
# kernels) against the host's torch 2.11 + CUDA 13 headers with its 16 cores; skips everything when
# /tmp/tesite already holds it. Then: export PYTHONPATH=/tmp/tesite:$PYTHONPATH
#
#   bash hosts/offline/te_install.sh [/tmp/teb]
set -euo pipefail
src=${1:-/tmp/teb}
site=/tmp/tesite
log=/tmp/te_install.log
if [ -f "$site/.installed" ]; then
  echo "te_install: Transformer Engine already in $site"
  exit 0
fi
manifest=$(ls "$src"/.te_p*/MANIFEST.json 2>/dev/null | head -1)
[ -n "$manifest" ] || { echo "te_install: no MANIFEST.json under $src/.te_p*: carry the .te_p folders first"; exit 1; }
work=/tmp/te_build
rm -rf "$work" && mkdir -p "$work"
python3 - "$src" "$manifest" "$work" <<'PYEOF'
import glob, hashlib, json, os, shutil, sys
src, manifest, work = sys.argv[1:]
m = json.load(open(manifest))
found = {os.path.basename(p): p for p in glob.glob(os.path.join(src, ".te_p*", "*"))}
missing = [p["file"] for p in m["parts"] if p["file"] not in found] + [f for f in m["files"] if f not in found]
if missing:
    sys.exit(f"te_install: missing {', '.join(missing)} (carry every .te_p folder, back to back)")
whole = hashlib.sha256()
with open(os.path.join(work, m["wheel"]), "wb") as out:
    for p in m["parts"]:
        data = open(found[p["file"]], "rb").read()
        if hashlib.sha256(data).hexdigest() != p["sha256"]:
            sys.exit(f"te_install: {p['file']} is damaged (sha256 differs from the manifest); stage it again")
        whole.update(data)
        out.write(data)
if whole.hexdigest() != m["sha256"]:
    sys.exit(f"te_install: {m['wheel']} reassembled with another sha256 than the manifest's")
for f in m["files"]:
    shutil.copy(found[f], work)
print(f"te_install: {len(m['parts'])} parts and {len(m['files'])} files OK")
PYEOF
start=$(date +%s)
rm -rf "$site"  # what an earlier, failed try left
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$work"/*.whl >"$log" 2>&1 \
  || { tail -20 "$log"; exit 1; }
tar xzf "$work"/transformer_engine_torch-2.20.2.tar.gz -C "$work"
# CUDA headers from the toolkit (nvcc's): the torch venv's nvidia/cu13 wheel lacks crt/host_config.h,
# so NVTE_BUILD_USE_NVIDIA_WHEELS=1 fails. cudnn.h, which the toolkit lacks, from the
# nvidia-cudnn wheel through CPLUS_INCLUDE_PATH (searched after -I, so the toolkit's headers win);
# cudnn_frontend.h from the wheel just installed (found through $site).
cudnn_inc=$(python3 -c "import glob, nvidia
h = [f for p in nvidia.__path__ for f in sorted(glob.glob(p + '/*/include/cudnn.h'))]
print(h[0].rsplit('/', 1)[0] if h else '')")
[ -n "$cudnn_inc" ] || { echo "te_install: no cudnn.h in the torch venv's nvidia-* wheels"; exit 1; }
( cd "$work/transformer_engine_torch-2.20.2" \
  && PYTHONPATH="$site" CPLUS_INCLUDE_PATH="$cudnn_inc" NVTE_NO_LOCAL_VERSION=1 NVTE_PYTORCH_FORCE_BUILD=TRUE \
     NVTE_BUILD_USE_NVIDIA_WHEELS=0 NVTE_CUDA_ARCHS=90 \
     MAX_JOBS=16 python3 -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$work/dist" . ) >>"$log" 2>&1 \
  || { echo "te_install: building transformer-engine-torch failed (log $log):"; tail -40 "$log"; exit 1; }
# The built wheel puts its library into transformer_engine/wheel_lib/, a folder of the package
# installed above: pip --target does not merge into an existing package folder (it warns and
# skips it), so install it apart and copy it in.
python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/torch_ext" "$work"/dist/*.whl >>"$log" 2>&1 \
  || { tail -20 "$log"; exit 1; }
cp -a "$work/torch_ext/." "$site/"
ls "$site"/transformer_engine/wheel_lib/transformer_engine_torch*.so >/dev/null 2>&1 \
  || { echo "te_install: the built wheel held no transformer_engine_torch library (log $log)"; exit 1; }
PYTHONPATH="$site:${PYTHONPATH:-}" python3 -c "
import torch, transformer_engine, transformer_engine.pytorch as te
ok, why = te.is_fp8_block_scaling_available(return_reason=True)
print('te_install: transformer_engine', transformer_engine.__version__, 'torch', torch.__version__,
      '| FP8 block scaling:', ok, why or '')" 2>&1 | grep -v Warning | tail -3
touch "$site/.installed"
echo "te_install: done in $(( $(date +%s) - start )) s; export PYTHONPATH=$site:\$PYTHONPATH"
