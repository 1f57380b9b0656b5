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
# VARIANTS="nodecode noexp": timing-only copies of this tree with one part of the attention removed
# (bench/attn_variant.py says which), timed at the INT4 shape below.
VARPIDS=()
for v in ${VARIANTS:-}; do
  rm -rf "/tmp/var-$v" && mkdir "/tmp/var-$v" && (cd "$ROOT" && tar cf - --exclude=./.wt --exclude=./.carry .) | tar xf - -C "/tmp/var-$v"
  python3 "$ROOT/bench/attn_variant.py" "$v" "/tmp/var-$v" "$ROOT/${BASE:-.}" || exit 1
  build "/tmp/var-$v" "/tmp/kb-$v" bench_layer & VARPIDS+=($!)
done
wait $NEW || { grep -B2 -A8 -m5 error /tmp/kb-new.log; exit 1; }
[[ -n "${BASE:-}" ]] && { wait $BASEPID || { grep -B2 -A8 -m5 error /tmp/kb-base.log; exit 1; }; }
grep -A2 "AttentionWgmmaKernel" /tmp/kb-new.log | grep -E "registers|spill" | sort | uniq -c | tee -a "$OUT/summary.txt"
(cd /tmp/kb-new && ctest -L gpu --output-on-failure -j1 --timeout 60) >"$OUT/tests.log" 2>&1
CTEST=$?
echo "ctest exit $CTEST" | tee -a "$OUT/summary.txt"
grep -E "tests passed|tests failed|FAILED|Expected|Which is" "$OUT/tests.log" | head -20 | tee -a "$OUT/summary.txt"
[[ $CTEST -ne 0 && -z "${FORCE:-}" ]] && { echo "GPU tests failed: no timings (FORCE=1 times anyway)"; exit 1; }
grep -E "codes identical" "$OUT/tests.log" | cut -c1-150 | head -14 | tee -a "$OUT/summary.txt"
rm -f "$OUT/times.jsonl"
bench() {  # tree-label build n heads dim format [extra bench_layer flags]
  timeout 90 "$2/bench/bench_layer" --n=$3 --hidden=7168 --heads=$4 --dim=$5 --format=$6 --tiling=wgmma --gemm=0 \
    --reps=2 ${7:-} 2>>"$LOG" | sed "s/^{/{\"tree\": \"$1\", /" >>"$OUT/times.jsonl"
}
for shape in "56 128 int4" "56 128 int8" "56 128 bf16" "112 64 int4"; do
  extra=""; [[ "$shape" == "56 128 int4" ]] && extra="--gemm=1"  # the projection's yardstick too
  bench new /tmp/kb-new 32768 $shape "$extra"
  [[ -n "${BASE:-}" ]] && bench base /tmp/kb-base 32768 $shape "$extra"
done
for pid in "${VARPIDS[@]}"; do wait "$pid" || echo "a variant failed to build" | tee -a "$OUT/summary.txt"; done
for v in ${VARIANTS:-}; do for f in int4 bf16; do bench "$v" "/tmp/kb-$v" 32768 56 128 $f; done; done
# TQ_SWEEP="4096": the INT4 layer at other query chunks (whole waves or not: AttentionWaveRows).
for tq in ${TQ_SWEEP:-}; do bench "tq$tq" /tmp/kb-new 32768 56 128 int4 "--tq=$tq"; done
# TP_SWEEP="2048 8192": the INT4 layer at other projection chunks (K/V GEMM output vs L2).
for tp in ${TP_SWEEP:-}; do bench "tp$tp" /tmp/kb-new 32768 56 128 int4 "--gemm=1 --tp=$tp"; done
# H3=1: the MiniMax H3 layer; TORCH=1: PyTorch (cuDNN, FlashAttention) on the same inputs, with the
# output error of both against an FP32 reference (bench_layer --rows_out; torch_baseline.py).
if [[ -n "${TORCH:-}" ]]; then
  bench new /tmp/kb-new 32768 56 128 int4 "--gemm=1 --rows_out=/tmp/rows_32768_128_int4_0.bin"
  [[ -n "${H3:-}" ]] && bench new /tmp/kb-new 152263 56 128 int4 "--gemm=1 --rows_out=/tmp/rows_152263_128_int4_0.bin"
  grep '"unchunked_gemm_ms": [1-9]' "$OUT/times.jsonl" >/tmp/torch_shapes.jsonl
  timeout 240 python3 "$ROOT/bench/torch_baseline.py" --kvpack /tmp/torch_shapes.jsonl --rows_dir /tmp \
    --out "$OUT/torch.jsonl" 2>>"$LOG" | tee -a "$OUT/summary.txt"
elif [[ -n "${H3:-}" ]]; then
  bench new /tmp/kb-new 152263 56 128 int4 --gemm=1
fi

# SANITIZE=1: compute-sanitizer memcheck over small layer cases (the wgmma kernel, mixed formats).
if [[ -n "${SANITIZE:-}" ]]; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 /tmp/kb-new/tests/kernels/cuda_layer_test \
    --gtest_filter='*Int4OneSequence*:*MixedFormatsSequences*:*Bf16Causal*' >/tmp/sanitizer.log 2>&1
  echo "compute-sanitizer memcheck exit $?: $(grep 'ERROR SUMMARY' /tmp/sanitizer.log | tail -1)" | tee -a "$OUT/summary.txt"
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
# EPI_PROFILE=1: one K/V row-epilogue launch (4096 tokens × 112 rows) under Nsight Compute.
if [[ -n "${EPI_PROFILE:-}" && -n "$NCU" ]]; then
  timeout 120 "$NCU" --kernel-name regex:RowEpilogueKernel --launch-skip 1 --launch-count 1 --import-source no \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section InstructionStats --section SourceCounters --section SchedulerStats \
    -o /tmp/epi /tmp/kb-new/bench/bench_layer --n=8192 --hidden=7168 --heads=56 --dim=128 --format=int4 \
    --tiling=wgmma --gemm=0 --reps=1 >>"$LOG" 2>&1
  "$NCU" --import /tmp/epi.ncu-rep --print-details all >"$OUT/epi_details.txt" 2>&1
  "$NCU" --import /tmp/epi.ncu-rep --page source --csv --print-source sass 2>>"$LOG" | gzip -c >"$OUT/epi_sass.csv.gz"
fi
python3 - "$OUT/times.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
# kv/GEMM: the K/V projection (stats, GEMMs, epilogue) over one unchunked x·W_kvᵀ; all/QKV: the whole
# projection (Q's GEMMs and epilogue too) over one unchunked x·W_qkvᵀ.
print(f"{'tree':6} {'N':>7} {'shape':>7} {'fmt':5} {'layer ms':>9} {'attn ms':>9} {'TFLOP/s':>8} {'kv/GEMM':>8} {'all/QKV':>8} {'kv epi':>7} {'q epi':>6}")
for r in rows:
    ratio = r['projection_ms'] / r['unchunked_gemm_ms'] if r['unchunked_gemm_ms'] else float('nan')
    qkv = r.get('qkv_gemm_ms', 0)
    ratio_all = r['projection_all_ms'] / qkv if qkv else float('nan')
    print(f"{r['tree']:6} {r['n']:7d} {str(r['heads'])+'x'+str(r['dim']):>7} {r['format']:5} {r['layer_ms']:9.1f} "
          f"{r['attention_ms']:9.2f} {r['attention_tflops']:8.1f} {ratio:8.3f} {ratio_all:8.3f} {r['kv_epilogue_ms']:7.2f} {r['q_epilogue_ms']:6.2f}")
PY
