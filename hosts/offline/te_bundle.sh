#!/usr/bin/env bash
# Transformer Engine 2.20.2 for the GPU host, which has no package registry and takes at
# most 64 MiB a device call. Run here (the CPU machine, which reaches PyPI), once per checkout:
#
#   bash hosts/offline/te_bundle.sh
#
# It downloads the pinned files (sha256-checked; kept in ~/.cache/jetrl-te-bundle or $TE_BUNDLE_DIR),
# splits the 276 MB binary wheel transformer-engine-cu13 into 28 MiB parts (its kernels are
# compressed already: xz would save 5 %), and stages five git-ignored folders .te_p1 .. .te_p5 of at
# most 56 MiB (the working tree, 4 MiB, travels with each). Then five device calls back to back
# (the machine goes back 30 s after a call ends), each copying its folder to /tmp, which stays:
#
#   calls 1-4: carry [".te_pK"],          command: mkdir -p /tmp/teb && cp -r .te_pK /tmp/teb/
#   call 5:    carry [".te_p5", ".whl"],  command: cp -r .te_p5 /tmp/teb/ && bash hosts/offline/te_install.sh && ...
#
# On a multi-GPU host next to the vLLM lanes (hosts/offline/lanes.sh), the five parts ride along the
# `wait` calls instead (carry [".te_pK"], command: mkdir -p /tmp/teb && cp -r .te_pK /tmp/teb/.te_pK.tmp
# && mv /tmp/teb/.te_pK.tmp /tmp/teb/.te_pK && bash hosts/offline/lanes.sh wait 540), and one
# lane's `vllm.sh --with-te ...` waits for them, installs TE and runs the TE tests and benchmark.
#
# te_install.sh (on the host) checks every part, installs the wheels into /tmp/tesite and builds
# transformer-engine-torch (plain C++, from its sdist) against the host's torch 2.11 + CUDA 13; then
# `export PYTHONPATH=/tmp/tesite:$PYTHONPATH`. The host already has einops, onnx, onnxscript,
# nvidia-cudnn-cu13, pybind11 and ninja (KINDS.md); the rest it needs travels here.
set -euo pipefail
PINS=$(cat <<'EOF'
30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e  transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094  transformer_engine-2.20.2-py3-none-any.whl
8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239  nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
8a4dc2814c5a4cd19ae304170b9bfa514538ef3c3eb243a45a82404ec3cb279d  nvdlfw_inspect-0.2.2-py3-none-any.whl
3f7b347782ab7e4cf4c798496ae3a82787d9f21ec12676a9c564355eeef8daa8  pydantic-2.14.3-py3-none-any.whl
c81d98e27d9d9261909dcccab1ba5d6ea1c98b0bb9470e368604614fd1d36ddd  pydantic_core-2.50.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0  annotated_types-0.8.0-py3-none-any.whl
bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39  typing_inspection-0.4.5-py3-none-any.whl
4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e  transformer_engine_torch-2.20.2.tar.gz
EOF
)
SDIST_URL=https://files.pythonhosted.org/packages/3d/fb/c9ce298a38c22ed1059923a01cac7e1f4e4f7281d39a8679c8118febe079/transformer_engine_torch-2.20.2.tar.gz
BIG=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
PART_MIB=28

cache=${TE_BUNDLE_DIR:-$HOME/.cache/jetrl-te-bundle}
dl=$cache/download
mkdir -p "$dl"
root=$(git rev-parse --show-toplevel)

# ---- 1. the pinned files (pip's hash-checking mode for the wheels; the sdist by its URL) ---------
if ! (cd "$dl" && sha256sum -c --quiet <<<"$PINS") 2>/dev/null; then
  grep '\.whl$' <<<"$PINS" | while read -r sha file; do
    name=${file%%-*}; rest=${file#*-}; echo "${name}==${rest%%-*} --hash=sha256:$sha"
  done >"$cache/requirements.txt"
  echo "[te_bundle] downloading $(wc -l <"$cache/requirements.txt") wheels and the sdist into $dl ..."
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any --disable-pip-version-check --progress-bar off \
    --require-hashes -r "$cache/requirements.txt" -d "$dl"
  curl -sSfL -o "$dl/transformer_engine_torch-2.20.2.tar.gz" "$SDIST_URL"
  (cd "$dl" && sha256sum -c --quiet <<<"$PINS") || {
    echo "[te_bundle] downloaded files do not match the pinned sha256 list" >&2; exit 1; }
fi
echo "[te_bundle] $(wc -l <<<"$PINS") pinned files, sha256 OK"

# ---- 2. parts of the big wheel, and the manifest te_install.sh checks ---------------------------
rm -rf "$cache/parts" && mkdir -p "$cache/parts"
split -b "${PART_MIB}M" -d -a 2 "$dl/$BIG" "$cache/parts/$BIG.part"
python3 - "$cache" "$BIG" <<'PYEOF'
import hashlib, json, os, sys
cache, big = sys.argv[1:]
sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()  # noqa: E731
parts = sorted(os.listdir(os.path.join(cache, "parts")))
manifest = {"wheel": big, "sha256": sha(os.path.join(cache, "download", big)),
            "parts": [{"file": p, "sha256": sha(os.path.join(cache, "parts", p))} for p in parts],
            "files": sorted(f for f in os.listdir(os.path.join(cache, "download")) if f != big)}
json.dump(manifest, open(os.path.join(cache, "MANIFEST.json"), "w"), indent=1)
print(f"[te_bundle] {len(parts)} parts of {big}")
PYEOF

# ---- 3. stage .te_p1 .. : two parts a folder; the last also holds the other files + manifest -----
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.te_p*/' "$exclude" 2>/dev/null || echo '/.te_p*/' >>"$exclude"
rm -rf .te_p*
parts=("$cache"/parts/*)
n=$(( (${#parts[@]} + 1) / 2 ))
for i in $(seq 1 "$n"); do
  mkdir -p ".te_p$i"
  cp "${parts[@]:$(( 2 * (i - 1) )):2}" ".te_p$i/"
done
for f in $(python3 -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))['files']))" "$cache/MANIFEST.json"); do
  cp "$dl/$f" ".te_p$n/"
done
cp "$cache/MANIFEST.json" ".te_p$n/"
du -sh .te_p*
echo "[te_bundle] staged $n folders: $n device calls back to back (see the top of this script)"
