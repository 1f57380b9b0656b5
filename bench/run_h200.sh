#!/usr/bin/env bash
# Build, test, memcheck and benchmark the CUDA layer on the H200 in one call; prints a short table
# last and leaves logs in $OUT (build.log with the ptxas -v report, tests.log, sanitizer.log,
# kvpack.jsonl, torch.jsonl, summary.txt).
#
#   bench/run_h200.sh quick   # tests, memcheck, N = 8192 / 32768 INT4, one d = 64 shape
#   bench/run_h200.sh full    # + N = 152263, in place, INT8 / BF16 at 32768
#   bench/run_h200.sh bench   # the full benchmark without tests
#   bench/run_h200.sh attn    # tests, SASS of the wgmma kernel, attention tilings side by side at
#                             # N = 32768 (INT4 / INT8 / BF16, d = 64 and 128) and N = 152263 INT4,
#                             # memcheck; TORCH=1 adds PyTorch at N = 32768
set -uo pipefail
MODE=${1:-quick}
OUT=${OUT:-/tmp/kvpack-out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GTEST=${KVPACK_GTEST_SOURCE_DIR:-$(realpath "$ROOT/../../.carry/googletest" 2>/dev/null)}
BUILD=${BUILD:-/tmp/kvpack-build}
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv; nvcc --version | tail -2; } \
  | tee "$OUT/summary.txt"

cmake -S "$ROOT" -B "$BUILD" -G Ninja -DKVPACK_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
  -DKVPACK_GTEST_SOURCE_DIR="$GTEST" >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
# Only what this script runs: the CPU tests are CI's, and other layers may not build with the server off.
ninja -C "$BUILD" -j16 kvpack_cuda cuda_layer_test bench_layer >>"$OUT/build.log" 2>&1 \
  || { grep -B2 -A8 -m5 error "$OUT/build.log"; exit 1; }
grep -A2 "AttentionKernel\|AttentionWgmmaKernel\|RowEpilogueKernel" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c | tee -a "$OUT/summary.txt"

if [[ "$MODE" == attn ]]; then
  cuobjdump --dump-sass "$BUILD/kernels/cuda/CMakeFiles/kvpack_cuda.dir/attention_wgmma.cu.o" >"$OUT/wgmma.sass" 2>&1
  echo "wgmma SASS: $(grep -c HGMMA "$OUT/wgmma.sass") HGMMA, $(grep -c 'LDL\|STL' "$OUT/wgmma.sass") LDL/STL, $(grep -c 'BAR\.' "$OUT/wgmma.sass") BAR" | tee -a "$OUT/summary.txt"
fi
if [[ "$MODE" != bench ]]; then
  (cd "$BUILD" && ctest -L gpu --output-on-failure -j1 --timeout 150) >"$OUT/tests.log" 2>&1
  echo "ctest exit $?" | tee -a "$OUT/summary.txt"
  grep -q "Timeout" "$OUT/tests.log" && { echo "a GPU test timed out (hang?): stopping"; exit 1; }
  grep -E "tests passed|tests failed|\[.*\] (codes|rel L2)|FAILED|Failed|Expected|Which is" "$OUT/tests.log" | head -40 | tee -a "$OUT/summary.txt"
  [[ "$MODE" == attn ]] || compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/kernels/cuda_layer_test" \
    --gtest_filter='*Int4OneSequence*:*Bf16Causal*:*Mixed*' >"$OUT/sanitizer.log" 2>&1
  [[ "$MODE" == attn ]] || echo "compute-sanitizer memcheck exit $? ($(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' "$OUT/sanitizer.log") error lines): $(grep 'ERROR SUMMARY' "$OUT/sanitizer.log")" | tee -a "$OUT/summary.txt"
fi

B="$BUILD/bench/bench_layer"
rm -f "$OUT/kvpack.jsonl"
run() {  # n hidden heads dim format in_place [extra]
  "$B" --n=$1 --hidden=$2 --heads=$3 --dim=$4 --format=$5 --in_place=$6 --rows_out=/tmp/rows_$1_$4_$5_$6.bin ${7:-} \
    2>>"$OUT/bench.err" | tee -a "$OUT/kvpack.jsonl"
}
if [[ "$MODE" == attn ]]; then
  runt() {  # n heads dim format tiling [extra]: one row file per tiling for torch_baseline's error check
    timeout 90 "$B" --n=$1 --hidden=7168 --heads=$2 --dim=$3 --format=$4 --in_place=0 --tiling=$5 \
      --rows_out=/tmp/rows_$1_$3_$4_0_$5.bin ${6:-} 2>>"$OUT/bench.err" | tee -a "$OUT/kvpack.jsonl"
  }
  runt 32768 56 128 int4 wgmma "--reps=2"
  runt 32768 56 128 int4 wgmma "--gemm=0 --reps=2"  # the spread of two runs
  runt 32768 56 128 int8 wgmma "--gemm=0 --reps=2"
  runt 32768 56 128 bf16 wgmma "--gemm=0 --reps=2"
  runt 32768 112 64 int4 wgmma "--gemm=0 --reps=2"
  runt 152263 56 128 int4 wgmma "--reps=2"
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/kernels/cuda_layer_test" \
    --gtest_filter='*Int4OneSequence*:*MixedFormatsWide*' >"$OUT/sanitizer.log" 2>&1
  echo "compute-sanitizer memcheck exit $? ($(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' "$OUT/sanitizer.log") error lines): $(grep 'ERROR SUMMARY' "$OUT/sanitizer.log")" | tee -a "$OUT/summary.txt"
  if [[ -n "${TORCH:-}" ]]; then
    grep '"n": 32768' "$OUT/kvpack.jsonl" | grep '"dim": 128' >"$OUT/kvpack32k.jsonl"
    python3 "$ROOT/bench/torch_baseline.py" --kvpack "$OUT/kvpack32k.jsonl" --rows_dir /tmp --out "$OUT/torch.jsonl" \
      2>"$OUT/torch.err" | tee -a "$OUT/summary.txt"
    tail -3 "$OUT/torch.err"
  fi
  tail -3 "$OUT/bench.err" 2>/dev/null
  python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    print(f\"N={r['n']} {r['heads']}x{r['dim']} {r['format']:5} {r['tiling']:8} layer {r['layer_ms']:8.1f} ms  attn {r['attention_ms']:8.1f} ms  {r['attention_tflops']:6.1f} TFLOP/s\")
" "$OUT/kvpack.jsonl"
  exit 0
fi
run 32768 7168 56 128 int4 0
run 32768 7168 56 128 int4 0 "--tiling=wide --gemm=0 --reps=2"
mv /tmp/rows_32768_128_int4_0.bin /tmp/rows_wide.bin 2>/dev/null
run 32768 7168 56 128 int4 0 "--reps=2 --gemm=0"   # tall again: its rows for the error check, and the spread
run 8192 7168 56 128 int4 0
run 32768 7168 112 64 int4 0
if [[ "$MODE" != quick ]]; then
  run 152263 7168 56 128 int4 0 "--reps=2"
  run 152263 7168 56 128 int4 1 "--reps=2 --gemm=0"
  run 32768 7168 56 128 int4 1
  run 32768 7168 56 128 int8 0 --gemm=0
  run 32768 7168 56 128 bf16 0 --gemm=0
fi
python3 "$ROOT/bench/torch_baseline.py" --kvpack "$OUT/kvpack.jsonl" --rows_dir /tmp --out "$OUT/torch.jsonl" \
  2>"$OUT/torch.err" | tee -a "$OUT/summary.txt"
tail -5 "$OUT/torch.err" "$OUT/bench.err" 2>/dev/null
