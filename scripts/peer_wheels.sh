#!/usr/bin/env bash
# The peers bench/peers.py measures, comfy-kitchen 0.2.40 and SageAttention 1.0.6, as a directory that
# goes on PYTHONPATH on the H200 (it has no package index and no network): OUT_DIR/site holds both wheels
# unpacked, OUT_DIR/peers.tgz the same directory packed for the device's carry (64 MiB a call in all).
#
#   bash scripts/peer_wheels.sh OUT_DIR       # e.g. .carry/peers; wheels cached in $PEER_WHEEL_CACHE
#
# comfy-kitchen's wheel carries a ROCm/HIP extension (backends/hip/_C*.so, 158 MB) beside the CUDA one
# (41 MB): it is dropped. comfy_kitchen imports backends/hip only under a ROCm build of torch
# (torch.version.hip), and that module reports a missing _C itself, so the package's Python stays whole.
set -euo pipefail
OUT=${1:?usage: scripts/peer_wheels.sh OUT_DIR}
CACHE=${PEER_WHEEL_CACHE:-$HOME/.cache/kvpack/peer-wheels}
# The device's interpreter and platform, not this machine's.
PYTHON_VERSION=3.12
PLATFORM=manylinux_2_28_x86_64
WHEELS=("comfy_kitchen 0.2.40" "sageattention 1.0.6")

mkdir -p "$CACHE" "$OUT"
files=()
for spec in "${WHEELS[@]}"; do
  read -r name version <<<"$spec"
  whl=$(ls "$CACHE/$name-$version-"*.whl 2>/dev/null | head -1 || true)
  if [[ -z "$whl" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
      --platform "$PLATFORM" -d "$CACHE" "$name==$version"
    whl=$(ls "$CACHE/$name-$version-"*.whl | head -1)
  fi
  files+=("$whl")
done

rm -rf "$OUT/site" "$OUT/peers.tgz"
mkdir -p "$OUT/site"
for whl in "${files[@]}"; do unzip -q -o "$whl" -d "$OUT/site"; done
rm -f "$OUT/site"/comfy_kitchen/backends/hip/_C*.so
ls "$OUT/site"/comfy_kitchen/backends/cuda/_C*.so >/dev/null  # the CUDA extension peers.py calls
[[ -f "$OUT/site/sageattention/core.py" ]]

tar czf "$OUT/peers.tgz" -C "$OUT" site
echo "$OUT/site: $(du -sm "$OUT/site" | cut -f1) MB; $OUT/peers.tgz: $(stat -c %s "$OUT/peers.tgz" | awk '{printf "%.1f MiB", $1 / 1048576}')"
