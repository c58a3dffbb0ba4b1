#!/usr/bin/env bash
# DeepGEMM's JIT-compiled kernels from one machine to the next. The GPU host is a fresh machine every
# session, and an engine's first start at new model widths compiles DeepGEMM's kernels for about 220 s
# (H200: docs/benchmarks/2026-11-29-exact-kv-guard-starts.md), several times a session. The kernels a
# session compiled can come back with its results and seed the next machine's caches:
#
#   bash hosts/offline/jit_cache.sh pack DIR     # the caches into DIR/dg_jit.tar.xz.NN (15 MiB parts) + DIR/dg_jit.manifest
#   bash hosts/offline/jit_cache.sh unpack DIR   # DIR's parts into this machine's caches, if made with this software
#
# `lanes.sh wait SECONDS --pack-jit` packs into $OUT; keep the returned files in .dg_jit/ (git-ignored)
# and, next session, copy them to /tmp/dg_jit in a carrying call (carry .dg_jit); vllm.sh unpacks them
# once before its first run. The manifest names the GPU, driver, torch, vLLM and nvcc that compiled them:
# on any other software the parts are left unused (one line says why). A seeded machine is marked
# (JETRL_DG_JIT_SEEDED=1, /tmp/dg_jit/.unpacked): a decode result records it (its first engine start
# is then not cold); decode --cold-start's starts use empty caches of their own either way.
set -uo pipefail
MAX_PARTS=4   # 60 MiB: the files a call brings back (16 MiB each) and what one carrying call takes (64 MiB)

caches() {  # DeepGEMM's cache directories that exist here: vLLM points it under its cache root, else ~/.deep_gemm
  local d
  for d in "${DG_JIT_CACHE_DIR:-}" "${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/deep_gemm" "$HOME/.deep_gemm"; do
    [ -n "$d" ] && [ -d "$d" ] && realpath "$d"
  done | sort -u
}

software() {  # what compiled the kernels: the parts are used only where this is the same
  local path=${PYTHONPATH:-}  # where vllm.sh finds the offline bundle's packages (read, not imported)
  [ -d /tmp/site ] && path=/tmp/site:$path
  [ -d /tmp/vsite ] && path=/tmp/vsite:$path
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
  PYTHONPATH=$path python3 -c "
import importlib.metadata as m
for name in ('torch', 'vllm'):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, 'none')"
  (nvcc --version 2>/dev/null || "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>/dev/null) | tail -1
}

case "${1:-}" in
  pack)
    dir=${2:?"usage: jit_cache.sh pack DIR"}
    mapfile -t found < <(caches)
    [ ${#found[@]} -gt 0 ] || { echo "jit_cache: no DeepGEMM cache on this machine: nothing packed"; exit 0; }
    tmp=$(mktemp -d)
    rels=()
    for d in "${found[@]}"; do rels+=("${d#/}"); done
    tar -C / -cf - "${rels[@]}" | xz -T0 -6 >"$tmp/all.tar.xz" || { rm -rf "$tmp"; echo "jit_cache: tar failed"; exit 1; }
    mib=$(( $(stat -c %s "$tmp/all.tar.xz") / 1048576 + 1 ))
    if [ "$mib" -gt $(( MAX_PARTS * 15 )) ]; then
      rm -rf "$tmp"
      echo "jit_cache: ${found[*]} pack to $mib MiB, over the $(( MAX_PARTS * 15 )) MiB that come back: not packed"
      exit 0
    fi
    split -b 15M -d -a 2 "$tmp/all.tar.xz" "$tmp/dg_jit.tar.xz."
    { software; echo "dirs ${found[*]}"; (cd "$tmp" && sha256sum dg_jit.tar.xz.*); } >"$tmp/dg_jit.manifest"
    mkdir -p "$dir" && mv "$tmp"/dg_jit.tar.xz.* "$tmp/dg_jit.manifest" "$dir/"
    rm -rf "$tmp"
    echo "jit_cache: $(find "${found[@]}" -type f | wc -l) files of ${found[*]} packed into $dir ($mib MiB," \
      "$(ls "$dir"/dg_jit.tar.xz.* | wc -l) parts)"
    ;;
  unpack)
    dir=${2:?"usage: jit_cache.sh unpack DIR"}
    [ -f "$dir/dg_jit.manifest" ] || { echo "jit_cache: no dg_jit.manifest in $dir: nothing unpacked"; exit 0; }
    [ -f "$dir/.unpacked" ] && { echo "jit_cache: $dir already unpacked on this machine"; exit 0; }
    made=$(grep -v -E "^(dirs |[0-9a-f]{64} )" "$dir/dg_jit.manifest")
    here=$(software)
    if [ "$made" != "$here" ]; then
      echo "jit_cache: the parts in $dir were compiled with other software, left unused:" \
        "$(diff <(echo "$made") <(echo "$here") | grep '^[<>]' | tr '\n' ' ')"
      exit 0
    fi
    (cd "$dir" && grep -E "^[0-9a-f]{64} " dg_jit.manifest | sha256sum --quiet -c -) \
      || { echo "jit_cache: a part in $dir does not match its checksum: nothing unpacked"; exit 1; }
    cat "$dir"/dg_jit.tar.xz.* | xz -d | tar -C / -xf - || { echo "jit_cache: unpacking failed"; exit 1; }
    grep '^dirs ' "$dir/dg_jit.manifest" >"$dir/.unpacked"
    echo "jit_cache: DeepGEMM kernels unpacked into $(cut -c6- "$dir/.unpacked")"
    ;;
  *) echo "usage: jit_cache.sh pack DIR | unpack DIR"; exit 2 ;;
esac
