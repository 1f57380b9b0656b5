#!/usr/bin/env bash
# Attention-kernel work on the H200 in one call: builds this tree (and BASE=<tree>, a baseline to
# compare against in the same run), runs the GPU tests, times the wgmma attention at N = 32768
# (56 × 128: INT4, INT8, BF16; 112 × 64: INT4) for both trees, and (PROFILE=1, when Nsight Compute
# is there) profiles one INT4 attention launch and summarises its SASS: warp instructions per page by
# role and the top stall sites. At most 8 files land in $OUT; the table comes last.
#   OUT=... BASE=.wt/base PROFILE=1 bash bench/attn_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/kvpack-attn}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GTEST=${KVPACK_GTEST_SOURCE_DIR:-$(realpath "$ROOT/.carry/googletest" 2>/dev/null)}
LOG="$OUT/log.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$OUT/summary.txt"
build() {  # tree build_dir targets...
  local tree=$1 dir=$2; shift 2
  cmake -S "$tree" -B "$dir" -G Ninja -DKVPACK_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
    -DKVPACK_GTEST_SOURCE_DIR="$GTEST" >"$dir.log" 2>&1 && ninja -C "$dir" -j8 "$@" >>"$dir.log" 2>&1
}
build "$ROOT" /tmp/kb-new kvpack_cuda cuda_layer_test bench_layer & NEW=$!
[[ -n "${BASE:-}" ]] && { build "$ROOT/$BASE" /tmp/kb-base bench_layer & BASEPID=$!; }
wait $NEW || { grep -B2 -A8 -m5 error /tmp/kb-new.log; exit 1; }
[[ -n "${BASE:-}" ]] && { wait $BASEPID || { grep -B2 -A8 -m5 error /tmp/kb-base.log; exit 1; }; }
grep -A2 "AttentionWgmmaKernel" /tmp/kb-new.log | grep -E "registers|spill" | sort | uniq -c | tee -a "$OUT/summary.txt"
(cd /tmp/kb-new && ctest -L gpu --output-on-failure -j1 --timeout 150) >"$OUT/tests.log" 2>&1
echo "ctest exit $?" | tee -a "$OUT/summary.txt"
grep -E "tests passed|tests failed|FAILED|Expected|Which is" "$OUT/tests.log" | head -20 | tee -a "$OUT/summary.txt"

rm -f "$OUT/times.jsonl"
bench() {  # tree-label build n heads dim format [extra bench_layer flags]
  timeout 90 "$2/bench/bench_layer" --n=$3 --hidden=7168 --heads=$4 --dim=$5 --format=$6 --tiling=wgmma --gemm=0 \
    --reps=2 ${7:-} 2>>"$LOG" | sed "s/^{/{\"tree\": \"$1\", /" >>"$OUT/times.jsonl"
}
for shape in "56 128 int4" "56 128 int8" "56 128 bf16" "112 64 int4"; do
  bench new /tmp/kb-new 32768 $shape
  [[ -n "${BASE:-}" ]] && bench base /tmp/kb-base 32768 $shape
done
# H3=1: the MiniMax H3 layer; TORCH=1: PyTorch (cuDNN, FlashAttention) on the same inputs, with the
# output error of both against an FP32 reference (bench_layer --rows_out; torch_baseline.py).
if [[ -n "${TORCH:-}" ]]; then
  bench new /tmp/kb-new 32768 56 128 int4 "--gemm=1 --rows_out=/tmp/rows_32768_128_int4_0.bin"
  [[ -n "${H3:-}" ]] && bench new /tmp/kb-new 152263 56 128 int4 "--gemm=1 --rows_out=/tmp/rows_152263_128_int4_0.bin"
  grep '"unchunked_gemm_ms": [1-9]' "$OUT/times.jsonl" >/tmp/torch_shapes.jsonl
  timeout 240 python3 "$ROOT/bench/torch_baseline.py" --kvpack /tmp/torch_shapes.jsonl --rows_dir /tmp \
    --out "$OUT/torch.jsonl" 2>>"$LOG" | tee -a "$OUT/summary.txt"
elif [[ -n "${H3:-}" ]]; then
  bench new /tmp/kb-new 152263 56 128 int4
fi

NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ -n "${PROFILE:-}" && -n "$NCU" ]]; then
  timeout 200 "$NCU" --kernel-name regex:AttentionWgmma --launch-count 1 --import-source no \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
    --section SchedulerStats -o /tmp/prof /tmp/kb-new/bench/bench_layer --n=16384 --hidden=7168 --heads=56 --dim=128 \
    --format=int4 --tiling=wgmma --gemm=0 --reps=1 >>"$LOG" 2>&1
  "$NCU" --import /tmp/prof.ncu-rep --print-details all >"$OUT/details.txt" 2>&1
  "$NCU" --import /tmp/prof.ncu-rep --page source --csv --print-source sass >/tmp/sass.csv 2>>"$LOG"
  python3 "$ROOT/bench/sass_profile.py" /tmp/sass.csv --ctas $((32 * 56)) --pages 256 | tee -a "$OUT/summary.txt"
  gzip -c /tmp/sass.csv >"$OUT/sass.csv.gz"
fi
python3 - "$OUT/times.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'tree':5} {'N':>7} {'shape':>7} {'fmt':5} {'layer ms':>9} {'attn ms':>9} {'TFLOP/s':>8} {'proj/GEMM':>9}")
for r in rows:
    ratio = r['projection_ms'] / r['unchunked_gemm_ms'] if r['unchunked_gemm_ms'] else float('nan')
    print(f"{r['tree']:5} {r['n']:7d} {str(r['heads'])+'x'+str(r['dim']):>7} {r['format']:5} {r['layer_ms']:9.1f} "
          f"{r['attention_ms']:9.2f} {r['attention_tflops']:8.1f} {ratio:9.2f}")
PY
