#!/usr/bin/env bash
# The daemon on the H200, from a bundle built elsewhere (shared/tools/bundle-binaries): the CUDA
# kernel and daemon tests, then one layer through kvpackd with CUDA IPC input and output next to the same layer
# called directly (bench_layer), at N = 32768 and the H3 shape. Prints a table last; logs in $OUT.
#   bench/run_daemon_h200.sh BUNDLE_DIR
set -uo pipefail
B=$(cd "${1:?bundle dir}" && pwd)
OUT=${OUT:-/tmp/kvpack-out}
mkdir -p "$OUT"
export KVPACKD="$B/bin/kvpackd"
export LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/daemon_summary.txt"

if [ -x "$B/bin/cuda_layer_test" ]; then
  "$B/bin/cuda_layer_test" >"$OUT/cuda_layer_test.log" 2>&1
  echo "cuda_layer_test exit $? :: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/cuda_layer_test.log" | tr '\n' ' ')" \
    | tee -a "$OUT/daemon_summary.txt"
fi
"$B/bin/cuda_daemon_test" >"$OUT/cuda_daemon_test.log" 2>&1
echo "cuda_daemon_test exit $? :: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/cuda_daemon_test.log" | tr '\n' ' ')" \
  | tee -a "$OUT/daemon_summary.txt"

"$KVPACKD" --backend=cuda --listen=127.0.0.1:50551 --metrics_address=127.0.0.1:9464 --vram_budget=48Gi \
  >"$OUT/kvpackd.log" 2>&1 &
pid=$!
for _ in $(seq 1 200); do grep -q "listening on" "$OUT/kvpackd.log" && break; sleep 0.05; done
head -3 "$OUT/kvpackd.log" | tee -a "$OUT/daemon_summary.txt"

rm -f "$OUT/daemon.jsonl"
for args in "--n=32768 --in_place=0" "--n=152263 --in_place=0" "--n=152263 --in_place=1"; do
  "$B/bin/daemon_ipc_bench" --server=127.0.0.1:50551 --hidden=7168 --heads=56 --dim=128 --format=int4 --reps=2 $args \
    2>>"$OUT/daemon_bench.err" | tee -a "$OUT/daemon.jsonl"
done
curl -s http://127.0.0.1:9464/metrics | grep -E '^kvpack_(pool|gpu|requests_total)' >"$OUT/metrics.txt"
kill -TERM $pid; wait $pid
echo "kvpackd exit $?" | tee -a "$OUT/daemon_summary.txt"

for args in "--n=32768 --in_place=0" "--n=152263 --in_place=0" "--n=152263 --in_place=1"; do
  n=$(echo "$args" | sed 's/--n=\([0-9]*\).*/\1/'); ip=${args: -1}
  "$B/bin/bench_layer" --hidden=7168 --heads=56 --dim=128 --format=int4 --reps=2 --gemm=0 $args \
    --rows_out=/tmp/rows_${n}_128_int4_${ip}.bin 2>>"$OUT/direct.err" | tee -a "$OUT/direct.jsonl"
done
# TORCH=1: PyTorch (x @ Wqkv.T + SDPA, cuDNN and FlashAttention) on the same seeded inputs, same run.
if [ "${TORCH:-0}" = 1 ]; then
  grep '"in_place": 0' "$OUT/direct.jsonl" >"$OUT/direct_out.jsonl"
  python3 "$(dirname "$0")/torch_baseline.py" --kvpack "$OUT/direct_out.jsonl" --rows_dir /tmp --out "$OUT/torch.jsonl" \
    2>"$OUT/torch.err" | tee -a "$OUT/daemon_summary.txt"
  tail -3 "$OUT/torch.err"
fi
tail -3 "$OUT/daemon_bench.err" "$OUT/direct.err" 2>/dev/null
cat "$OUT/metrics.txt" | head -20
