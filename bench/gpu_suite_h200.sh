#!/usr/bin/env bash
# Everything GPU-side of the daemon in one call, from a bundle built elsewhere
# (shared/tools/bundle-binaries BUNDLE kvpackd daemon_ipc_bench bench_layer cuda_daemon_test cuda_layer_test
# cuda_interleave_test): run_daemon_h200.sh (kernel and daemon tests, the layer through kvpackd next to
# the direct call), the chunk-interleaving test, and the Python CUDA-IPC tests of kvpack.torch (segments,
# torch.compile, the ComfyUI model when KVPACK_COMFYUI_DIR names a checkout)
# (grpcio/protobuf/pytest carried as wheels in WHEELS, stubs generated beforehand into
# client/python/kvpack/v1). Logs in $OUT; a summary last.
#   OUT=... WHEELS=.whl bash bench/gpu_suite_h200.sh BUNDLE_DIR
set -uo pipefail
B=$(cd "${1:?bundle dir}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/kvpack-out}
mkdir -p "$OUT"
bash "$ROOT/bench/run_daemon_h200.sh" "$B" >"$OUT/daemon_run.txt" 2>&1
export KVPACKD="$B/bin/kvpackd"
export LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout 300 "$B/bin/cuda_interleave_test" >"$OUT/interleave.log" 2>&1
echo "cuda_interleave_test exit $? :: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) |latency|ms' "$OUT/interleave.log" | head -6 | tr '\n' ' ')" \
  | tee -a "$OUT/daemon_summary.txt"
if [[ -n "${WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$ROOT/$WHEELS"/*.whl \
    >"$OUT/pytest.log" 2>&1
  # -s: the issue-17 tests print their figures (registrations per call, time outside the daemon,
  # compiled vs eager) as FIGURE lines. KVPACK_COMFYUI_DIR (a ComfyUI checkout) adds the real
  # ComfyUI model test.
  T=$ROOT/client/python/tests
  PYTHONPATH=/tmp/site:$ROOT/client/python timeout 540 python3 -m pytest -q -s -rs -p no:cacheprovider \
    "$T/test_torch_projected.py" "$T/test_projected.py" "$T/test_torch_cuda_gpu.py" "$T/test_torch_ops.py" \
    "$T/test_cuda_segments.py" "$T/test_comfy_model.py" >>"$OUT/pytest.log" 2>&1
  echo "pytest (torch CUDA IPC, projected, segments, compile, ComfyUI) exit $? :: $(tail -1 "$OUT/pytest.log")" \
    | tee -a "$OUT/daemon_summary.txt"
  grep -h '^FIGURE' "$OUT/pytest.log" | tee -a "$OUT/daemon_summary.txt"
fi
cat "$OUT/daemon_summary.txt"
tail -25 "$OUT/daemon_run.txt"
