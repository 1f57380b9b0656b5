#!/usr/bin/env bash
# Everything kvpack runs on the H200, in one call per session where possible (device time is short).
# At most 8 files come back from $OUT: logs are tarred into logs.tgz; summary.txt ends with the tables.
#
#   OUT=$OUT [options] bash bench/h200.sh kernels            # build the kernels there, GPU tests, timings
#   OUT=$OUT [options] bash bench/h200.sh daemon BUNDLE      # the daemon suite from a bundle built here
#   OUT=$OUT [options] bash bench/h200.sh kernels daemon BUNDLE
#   OUT=$OUT [options] bash bench/h200.sh peers              # the peers beside torch SDPA (no build)
#
# kernels: CMake + nvcc on the H200 (no server: it has no gRPC), with GoogleTest from .carry/googletest
#   (KVPACK_GTEST_SOURCE_DIR); ptxas registers/spills and the sm90 kernel's SASS counts; the gpu-labelled
#   ctest (cuda_layer_test prints per case a digest of the packed block and the output); bench_layer at
#   N = 32768 (56×128 INT4 / INT8 / BF16, 112×64 INT4) with --digest, a table last.
#     BASE=tree        a baseline tree (e.g. .wt/base from `git archive`): built and run the same way in
#                      the same run; its digests are compared with this tree's (DIGESTS: same / DIFFER)
#     EXPERIMENTS="nodecode noexp nopingpong"  this tree built with -DKVPACK_SM90_EXPERIMENT=… (timing only)
#     MMA="int8"       bench_layer again with --mma=int8 (the INT8 MMA path, mma_path.h) over INT4/INT8 pages
#     TORCH=1          PyTorch (x·Wᵀ + SDPA cuDNN / FlashAttention) on the same inputs, errors vs FP32
#     H3=1             the MiniMax H3 layer (N = 152,263) too
#     SANITIZE=1       compute-sanitizer memcheck over small layer cases
#     PROFILE=1        Nsight Compute of one INT4 attention launch (+ bench/sass_profile.py)
#     EPI_PROFILE=1    Nsight Compute of one K/V row-epilogue launch
#     TQ_SWEEP="4096" / TP_SWEEP="2048 8192"   the INT4 layer at other query / projection chunks
#     PEERS=1          then the peers mode (below) in the same call
# daemon: from `shared/tools/bundle-binaries BUNDLE kvpackd daemon_ipc_bench bench_layer cuda_daemon_test
#   cuda_layer_test cuda_row_encoder_test cuda_head_choice_test cuda_interleave_test`: the CUDA kernel and daemon tests, one layer through kvpackd with
#   CUDA IPC next to the same layer called directly (N = 32768 and H3, in place too), the chunk-interleaving
#   test (QUICK=1: N = 32768 only), and (WHEELS=.whl: grpcio/protobuf wheels; stubs generated beforehand into
#   client/python/kvpack/v1) the Python tests of kvpack.torch: CUDA IPC by segment, stream order,
#   torch.compile, ComfyUI's model when KVPACK_COMFYUI_DIR names a checkout (FIGURE lines in the summary);
#   then bench/frontend_overhead.py: where a call's time goes, and the GPU timeline of DiT blocks around
#   the calls at TIMELINE_N tokens (default "4096 32760 75600"; FIGURE timeline lines), with
#   TIMELINE_BASE=bin/kvpackd-OLD (a second kvpackd put in the bundle) timed first, in the same call.
#     OOM12=1          then the request's 12 GiB out-of-memory case (bench/oom12.py; needs WHEELS): an
#                      11.94 GiB cap, PyTorch's OOM, kvpackd per precision mode, errors vs float64
# oom12 BUNDLE: that case alone (WHEELS=... as above). OOM12_N="8192 152263": a cheap flow check (cap kept,
#   held scaled), then the full N (the default). OOM12_ARGS passes more flags (--cap_gib, --held_gib,
#   --held_on_top, --modes, --no_torch, --no_reference: the fit-table spot checks, README.md).
# peers: bench/peers.py, issues 12 and 13's peers on torch_baseline's inputs (56×128, hidden 7168):
#   comfy-kitchen 0.2.40 int8_attention, sol_attn and sol_attn_chunked (top-k 0.2), SageAttention 1.0.6
#   sageattn, torch SDPA cuDNN / FlashAttention; attention ms, TFLOP/s, peak GiB, error vs FP32. The
#   packages come from scripts/peer_wheels.sh: the site dir PEERS_SITE (default .carry/peers/site) or,
#   where it is absent, its tarball PEERS_TGZ (default .carry/peers/peers.tgz, 35 MiB: carry that one,
#   the site dir and it together pass the 64 MiB a call carries) unpacked into /tmp.
#   PEERS_N="32768 152263" (the default); PEERS_ARGS passes more flags (--methods, --reps, --topk_ratio,
#   --chunk). $OUT/peers.jsonl, the table in the summary.
#     SOL_ACCURACY=KVPACK_EVAL   then issue 13's accuracy check on locality data (d = 128, 4224 tokens): the
#                      kvpack-eval binary given writes each data kind (locality, qknorm, iid) with --dump and
#                      reports kvpack's sparse path per top-k and tail (CPU); bench/sol_accuracy.py runs
#                      sol_attn on the same files. $OUT/sol_accuracy.jsonl, both tables in the summary.
set -uo pipefail
OUT=${OUT:-/tmp/kvpack-h200}
mkdir -p "$OUT" /tmp/h200-logs
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOGS=/tmp/h200-logs
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1
say() { echo "$*" | tee -a "$SUMMARY"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
  nvcc --version | tail -1; } | tee "$SUMMARY"
finish() { tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
trap finish EXIT

# ── kernels ─────────────────────────────────────────────────────────────────────────────────────────
build_tree() {  # tree build_dir [cmake args...]: kernels, the CUDA layer tests, bench_layer
  local tree=$1 dir=$2; shift 2
  local gtest=${KVPACK_GTEST_SOURCE_DIR:-$(realpath "$ROOT/.carry/googletest" 2>/dev/null)}
  cmake -S "$tree" -B "$dir" -G Ninja -DKVPACK_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
    -DKVPACK_GTEST_SOURCE_DIR="$gtest" "$@" >"$dir.log" 2>&1 || return 1
  local extra=""  # the per-head choice's GPU test, in trees that have it
  ninja -C "$dir" -t targets all 2>/dev/null | grep -q '^cuda_head_choice_test:' && extra=cuda_head_choice_test
  ninja -C "$dir" -j16 kvpack_cuda cuda_layer_test $extra bench_layer >>"$dir.log" 2>&1
}
bench() {  # label build_dir n heads dim format [bench_layer flags]
  # --choose_per_head=0 (trees before it ignore the flag), so that the new tree's digests and times
  # compare with a base tree's; the "choose" row below times the per-head choice (its stats_ms).
  timeout 120 "$2/bench/bench_layer" --n=$3 --hidden=7168 --heads=$4 --dim=$5 --format=$6 --tiling=wgmma --gemm=0 \
    --reps=2 --digest=1 --choose_per_head=0 ${7:-} 2>>"$LOGS/bench.err" | sed "s/^{/{\"tree\": \"$1\", /" >>"$OUT/times.jsonl"
}
sass_counts() {  # object: instruction counts of the sm90 kernel
  cuobjdump --dump-sass "$1" >"$1.sass" 2>/dev/null
  echo "$(grep -c HGMMA "$1.sass") HGMMA, $(grep -cE 'LDL|STL' "$1.sass") LDL/STL, $(grep -c 'BAR\.' "$1.sass") BAR, $(grep -cE '^ +/\*[0-9a-f]+\*/' "$1.sass") instructions"
}
run_kernels() {
  build_tree "$ROOT" /tmp/kb-new & local new=$!
  local base_pid="" exp_pids=()
  [[ -n "${BASE:-}" ]] && { build_tree "$ROOT/$BASE" /tmp/kb-base & base_pid=$!; }
  for e in ${EXPERIMENTS:-}; do build_tree "$ROOT" "/tmp/kb-$e" -DKVPACK_SM90_EXPERIMENT="$e" & exp_pids+=($!); done
  wait $new || { grep -B2 -A8 -m5 error /tmp/kb-new.log | tee -a "$SUMMARY"; return 1; }
  [[ -n "$base_pid" ]] && { wait "$base_pid" || { grep -B2 -A8 -m5 error /tmp/kb-base.log | tee -a "$SUMMARY"; return 1; }; }
  cp /tmp/kb-*.log "$LOGS/" 2>/dev/null
  for t in new ${BASE:+base}; do
    say "[$t] ptxas: $(grep -A2 -E 'Attention(Sm90|Wgmma)Kernel' /tmp/kb-$t.log | grep -oE '[0-9]+ bytes spill stores|Used [0-9]+ registers' | sort | uniq -c | tr '\n' ' ')"
    local obj; obj=$(ls /tmp/kb-$t/kernels/cuda/CMakeFiles/kvpack_cuda{_sm90,}.dir/attention_{sm90,wgmma}.cu.o 2>/dev/null | head -1)
    [[ -n "$obj" ]] && say "[$t] sm90 SASS: $(sass_counts "$obj")"
  done
  for t in new ${BASE:+base}; do
    (cd /tmp/kb-$t && ctest -L gpu --output-on-failure -j1 --timeout 300) >"$LOGS/tests-$t.log" 2>&1
    say "[$t] ctest -L gpu exit $?: $(grep -E 'tests passed|tests failed' "$LOGS/tests-$t.log")"
    grep -h "digest block" /tmp/kb-$t/Testing/Temporary/LastTest.log "$LOGS/tests-$t.log" 2>/dev/null | sort -u >"$LOGS/digests-$t.txt"
  done
  grep -E "FAILED|Expected|Which is" "$LOGS/tests-new.log" | head -20 | tee -a "$SUMMARY"
  if [[ -n "${BASE:-}" ]]; then
    # Every base line must be in the new tree's digests; lines only in the new tree are its new cases.
    local missing added
    missing=$(comm -23 "$LOGS/digests-base.txt" "$LOGS/digests-new.txt" | wc -l)
    added=$(comm -13 "$LOGS/digests-base.txt" "$LOGS/digests-new.txt" | wc -l)
    if [[ -s "$LOGS/digests-new.txt" && $missing -eq 0 ]]; then
      say "DIGESTS (gpu tests, $(wc -l <"$LOGS/digests-base.txt") base cases × kernels): same; $added lines of cases new in this tree"
    else
      say "DIGESTS (cuda_layer_test): DIFFER"; diff "$LOGS/digests-base.txt" "$LOGS/digests-new.txt" | head -20 | tee -a "$SUMMARY"
    fi
  fi
  rm -f "$OUT/times.jsonl"
  for shape in "56 128 int4" "56 128 int8" "56 128 bf16" "112 64 int4"; do
    bench new /tmp/kb-new 32768 $shape
    [[ -n "${BASE:-}" ]] && bench base /tmp/kb-base 32768 $shape
  done
  [[ -n "${BASE:-}" ]] && bench new2 /tmp/kb-new 32768 56 128 int4  # the spread of one tree between calls
  bench choose /tmp/kb-new 32768 56 128 int4 "--choose_per_head=1"  # the per-head choice's cost (stats_ms)
  for m in ${MMA:-}; do
    for shape in "56 128 int4" "56 128 int8" "112 64 int4"; do bench "mma-$m" /tmp/kb-new 32768 $shape "--mma=$m"; done
    [[ -n "${H3:-}" ]] && bench "mma-$m" /tmp/kb-new 152263 56 128 int4 "--mma=$m"
  done
  for pid in "${exp_pids[@]}"; do wait "$pid" || say "an experiment build failed"; done
  for e in ${EXPERIMENTS:-}; do for f in int4 bf16; do bench "$e" "/tmp/kb-$e" 32768 56 128 $f; done; done
  for tq in ${TQ_SWEEP:-}; do bench "tq$tq" /tmp/kb-new 32768 56 128 int4 "--tq=$tq"; done
  for tp in ${TP_SWEEP:-}; do bench "tp$tp" /tmp/kb-new 32768 56 128 int4 "--gemm=1 --tp=$tp"; done
  if [[ -n "${TORCH:-}" ]]; then
    bench new /tmp/kb-new 32768 56 128 int4 "--gemm=1 --rows_out=/tmp/rows_32768_128_int4_0.bin"
    [[ -n "${H3:-}" ]] && bench new /tmp/kb-new 152263 56 128 int4 "--gemm=1 --rows_out=/tmp/rows_152263_128_int4_0.bin"
    grep '"unchunked_gemm_ms": [1-9]' "$OUT/times.jsonl" >/tmp/torch_shapes.jsonl
    timeout 300 python3 "$ROOT/bench/torch_baseline.py" --kvpack /tmp/torch_shapes.jsonl --rows_dir /tmp \
      --out "$OUT/torch.jsonl" 2>>"$LOGS/torch.err" | tee -a "$SUMMARY"
  elif [[ -n "${H3:-}" ]]; then
    bench new /tmp/kb-new 152263 56 128 int4 --gemm=1
  fi
  if [[ -n "${SANITIZE:-}" ]]; then
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 /tmp/kb-new/tests/kernels/cuda_layer_test \
      --gtest_filter='*Int4OneSequence*:*MixedFormatsSequences*:*Bf16Causal*:*MixedFormatsWide*:*Int8Mma*:*PerHeadChoice*' >"$LOGS/sanitizer.log" 2>&1
    say "compute-sanitizer memcheck exit $?: $(grep 'ERROR SUMMARY' "$LOGS/sanitizer.log" | tail -1)"
  fi
  local ncu; ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [[ -n "${PROFILE:-}" && -n "$ncu" ]]; then
    timeout 200 "$ncu" --kernel-name regex:AttentionSm90 --launch-count 1 --import-source no \
      --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
      --section SchedulerStats -o /tmp/prof /tmp/kb-new/bench/bench_layer --n=16384 --hidden=7168 --heads=56 --dim=128 \
      --format=int4 --tiling=wgmma --gemm=0 --reps=1 >>"$LOGS/ncu.log" 2>&1
    "$ncu" --import /tmp/prof.ncu-rep --print-details all >"$OUT/details.txt" 2>&1
    "$ncu" --import /tmp/prof.ncu-rep --page source --csv --print-source sass >/tmp/sass.csv 2>>"$LOGS/ncu.log"
    python3 "$ROOT/bench/sass_profile.py" /tmp/sass.csv --ctas $((32 * 56)) --pages 256 | tee -a "$SUMMARY"
    gzip -c /tmp/sass.csv >"$OUT/sass.csv.gz"
  fi
  if [[ -n "${EPI_PROFILE:-}" && -n "$ncu" ]]; then
    timeout 120 "$ncu" --kernel-name regex:RowEpilogueKernel --launch-skip 1 --launch-count 1 --import-source no \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section InstructionStats --section SourceCounters --section SchedulerStats \
      -o /tmp/epi /tmp/kb-new/bench/bench_layer --n=8192 --hidden=7168 --heads=56 --dim=128 --format=int4 \
      --tiling=wgmma --gemm=0 --reps=1 --choose_per_head=0 >>"$LOGS/ncu.log" 2>&1  # skip 1: the K/V epilogue
    "$ncu" --import /tmp/epi.ncu-rep --print-details all >"$OUT/epi_details.txt" 2>&1
  fi
  python3 - "$OUT/times.jsonl" <<'PY' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'tree':8} {'N':>7} {'shape':>7} {'fmt':5} {'layer ms':>9} {'attn ms':>9} {'TFLOP/s':>8} {'kv epi':>7} {'q epi':>6}  digests (kv, out)")
for r in rows:
    print(f"{r['tree']:8} {r['n']:7d} {str(r['heads'])+'x'+str(r['dim']):>7} {r['format']:5} {r['layer_ms']:9.1f} "
          f"{r['attention_ms']:9.2f} {r['attention_tflops']:8.1f} {r['kv_epilogue_ms']:7.2f} {r['q_epilogue_ms']:6.2f}  "
          f"{r.get('kv_digest', '-')} {r.get('out_digest', '-')}")
keys = {}
for r in rows:
    keys.setdefault((r['n'], r['heads'], r['dim'], r['format'], r['tq'], r['tp']), {})[r['tree']] = r
same = [k for k, t in keys.items() if 'new' in t and 'base' in t]
if same:
    equal = sum(t['new'].get('out_digest') == t['base'].get('out_digest') and
                t['new'].get('kv_digest') == t['base'].get('kv_digest') for k, t in keys.items() if k in same)
    print(f"bench_layer digests, new vs base: {equal} of {len(same)} shapes identical")
PY
}

# ── daemon ──────────────────────────────────────────────────────────────────────────────────────────
run_daemon() {
  local B; B=$(cd "${1:?daemon mode needs a bundle dir}" && pwd)
  export KVPACKD="$B/bin/kvpackd"
  export LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for t in cuda_layer_test cuda_row_encoder_test cuda_attention_window_test cuda_head_choice_test cuda_daemon_test cuda_interleave_test cuda_fault_test; do
    [[ -x "$B/bin/$t" ]] || continue
    timeout 300 "$B/bin/$t" >"$LOGS/$t.log" 2>&1
    say "$t exit $?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$LOGS/$t.log" | tr '\n' ' ')"
  done
  "$KVPACKD" --backend=cuda --listen=127.0.0.1:50551 --metrics_address=127.0.0.1:9464 --vram_budget=48Gi \
    >"$LOGS/kvpackd.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 200); do grep -q "listening on" "$LOGS/kvpackd.log" && break; sleep 0.05; done
  head -3 "$LOGS/kvpackd.log" | tee -a "$SUMMARY"
  local cases=("--n=32768 --in_place=0" "--n=152263 --in_place=0" "--n=152263 --in_place=1")
  [[ -n "${QUICK:-}" ]] && cases=("--n=32768 --in_place=0")  # QUICK=1: no H3-sized layers
  for args in "${cases[@]}"; do
    "$B/bin/daemon_ipc_bench" --server=127.0.0.1:50551 --hidden=7168 --heads=56 --dim=128 --format=int4 --reps=2 $args \
      2>>"$LOGS/daemon_bench.err" | tee -a "$OUT/daemon.jsonl"
  done
  curl -s http://127.0.0.1:9464/metrics | grep -E '^kvpack_(pool|gpu|requests_total)' >"$LOGS/metrics.txt"
  kill -TERM $pid; wait $pid
  say "kvpackd exit $? after SIGTERM"
  local direct="$B/bin/bench_layer"  # or the kernels mode's build of it, in the same call
  [[ -x "$direct" ]] || direct=/tmp/kb-new/bench/bench_layer
  for args in "${cases[@]}"; do
    "$direct" --hidden=7168 --heads=56 --dim=128 --format=int4 --reps=2 --gemm=0 $args \
      2>>"$LOGS/direct.err" | tee -a "$OUT/direct.jsonl"
  done
  if [[ -n "${WHEELS:-}" ]]; then
    install_wheels
    # -s: the issue-17 tests print their figures (registrations per call, time outside the daemon,
    # compiled vs eager) as FIGURE lines. KVPACK_COMFYUI_DIR (a ComfyUI checkout) adds the real model.
    local t=$ROOT/client/python/tests
    PYTHONPATH=/tmp/site:$ROOT/client/python timeout "${PYTEST_TIMEOUT:-540}" python3 -m pytest -q -s -rs -p no:cacheprovider \
      "$t/test_torch_projected.py" "$t/test_projected.py" "$t/test_torch_cuda_gpu.py" "$t/test_torch_ops.py" \
      "$t/test_cuda_segments.py" "$t/test_torch_sparse.py" "$t/test_comfy_model.py" >>"$LOGS/pytest.log" 2>&1
    say "pytest (kvpack.torch: CUDA IPC, segments, compile, sparse, ComfyUI) exit $?: $(tail -1 "$LOGS/pytest.log")"
    grep -h '^FIGURE' "$LOGS/pytest.log" | tee -a "$SUMMARY"
    # The same issue-17 figures over a unix socket, the transport docs/deploy.md recommends on the
    # caller's host (kvpack.testing.LocalDaemon with KVPACK_TEST_UNIX_SOCKET=1), labelled uds.
    KVPACK_TEST_UNIX_SOCKET=1 PYTHONPATH=/tmp/site:$ROOT/client/python timeout 300 python3 -m pytest -q -s -rs \
      -p no:cacheprovider "$t/test_torch_cuda_gpu.py" -k "steady_state or unary_call or lane" >"$LOGS/pytest_uds.log" 2>&1
    say "pytest over a unix socket exit $?"
    grep -h '^FIGURE' "$LOGS/pytest_uds.log" | sed 's/^FIGURE /FIGURE uds /' | tee -a "$SUMMARY"
    # Where a region-only call's time goes outside the attention, streamed vs unary (issue 17);
    # shared-memory regions, so the daemon stages them: compare the two methods, not the totals.
    # The idle-floor lines split "outside the daemon" into the wake-up after the attention's idle
    # time and the call's own share; --cpu_latency_us=0 repeats the unary call with the cores kept
    # out of sleep states (PM QoS, root only; it says so when it cannot).
    PYTHONPATH=/tmp/site:$ROOT/client/python timeout 300 python3 "$ROOT/bench/frontend_overhead.py" \
      --backend=cuda --tokens=4096 --heads=12 --head_dim=128 --cpu_latency_us=0 --gap_ms=5,18,50 \
      2>>"$LOGS/frontend_overhead.err" | tee -a "$SUMMARY"
    KVPACK_TEST_UNIX_SOCKET=1 PYTHONPATH=/tmp/site:$ROOT/client/python timeout 300 python3 \
      "$ROOT/bench/frontend_overhead.py" --backend=cuda --tokens=4096 --heads=12 --head_dim=128 \
      2>>"$LOGS/frontend_overhead.err" | sed 's/^/uds /' | tee -a "$SUMMARY"
    # The GPU timeline around the calls (issue 17): DiT blocks with the attention through kvpackd,
    # per block against the caller's kernels alone plus the daemon's own time (FIGURE timeline).
    # TIMELINE_BASE=bin/kvpackd-OLD (a second kvpackd in the bundle): the same lines from it first,
    # labelled, so that both daemons are timed on the same machine in the same call.
    local kvpackd label
    for n in ${TIMELINE_N:-4096 32760 75600}; do
      for kvpackd in ${TIMELINE_BASE:+"$B/$TIMELINE_BASE"} "$B/bin/kvpackd"; do
        label=$(basename "$kvpackd")
        KVPACKD=$kvpackd PYTHONPATH=/tmp/site:$ROOT/client/python timeout 300 python3 "$ROOT/bench/frontend_overhead.py" \
          --timeline --label="$label" --backend=cuda --tokens="$n" --heads=12 --head_dim=128 \
          2>>"$LOGS/frontend_overhead.err" | tee -a "$SUMMARY"
      done
    done
  fi
  [[ -n "${OOM12:-}" ]] && run_oom12 "$B"
  return 0
}

install_wheels() {  # grpcio/protobuf for the Python client, from $WHEELS, into /tmp/site (once)
  [[ -f /tmp/site/.installed ]] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$ROOT/$WHEELS"/*.whl \
    >>"$LOGS/pip.log" 2>&1 && touch /tmp/site/.installed
}

# ── the request's 12 GiB case ───────────────────────────────────────────────────────────────────────
run_oom12() {  # bundle dir
  local B; B=$(cd "${1:?oom12 needs a bundle dir}" && pwd)
  export KVPACKD="$B/bin/kvpackd"
  export LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [[ -n "${WHEELS:-}" ]] || { say "oom12: needs WHEELS (grpcio/protobuf wheels for the Python client)"; return 1; }
  install_wheels
  local n
  for n in ${OOM12_N:-152263}; do  # e.g. OOM12_N="8192 152263": the flow check, then the case
    # shellcheck disable=SC2086  # OOM12_ARGS is a list of flags
    PYTHONPATH=/tmp/site:$ROOT/client/python timeout "${OOM12_TIMEOUT:-540}" python3 "$ROOT/bench/oom12.py" \
      --n "$n" --kvpackd "$KVPACKD" --out "$OUT/oom12.jsonl" --log "$LOGS/oom12-kvpackd.log" ${OOM12_ARGS:-} \
      >"$LOGS/oom12-$n.log" 2>&1
    say "oom12 (N = $n) exit $?: $(tail -1 "$LOGS/oom12-$n.log")"
    grep -h '^FIGURE oom12' "$LOGS/oom12-$n.log" | tee -a "$SUMMARY"
  done
}

# ── peers ───────────────────────────────────────────────────────────────────────────────────────────
run_peers() {
  local site=${PEERS_SITE:-.carry/peers/site} tgz=${PEERS_TGZ:-.carry/peers/peers.tgz}
  [[ $site = /* ]] || site=$ROOT/$site
  [[ $tgz = /* ]] || tgz=$ROOT/$tgz
  if [[ ! -d "$site/comfy_kitchen" && -f "$tgz" ]]; then
    mkdir -p /tmp/peers && tar xzf "$tgz" -C /tmp/peers && site=/tmp/peers/site
  fi
  [[ -d "$site/comfy_kitchen" && -d "$site/sageattention" ]] ||
    { say "peers: no site dir (PEERS_SITE) or tarball (PEERS_TGZ); make them with scripts/peer_wheels.sh"; return 1; }
  # shellcheck disable=SC2086  # PEERS_N and PEERS_ARGS are lists
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout "${PEERS_TIMEOUT:-540}" python3 "$ROOT/bench/peers.py" \
    --n ${PEERS_N:-32768 152263} --out "$OUT/peers.jsonl" ${PEERS_ARGS:-} 2>"$LOGS/peers.err" | tee -a "$SUMMARY"
  say "peers exit ${PIPESTATUS[0]}"
  [[ -n "${SOL_ACCURACY:-}" ]] && sol_accuracy "$site"
}
sol_accuracy() {  # site dir
  local eval=$SOL_ACCURACY dirs=() kind r tail
  [[ $eval = /* ]] || eval=$ROOT/$eval
  say "kvpack sparse (kvpack-eval --locality 4:32:32:128:2:128 --seed 1, INT4, CPU): data top-k tail routed rel_l2 cosine"
  for kind in locality qknorm iid; do
    mkdir -p "/tmp/loc_$kind"
    for r in 0.1 0.2 0.3; do
      for tail in on off; do
        "$eval" --locality 4:32:32:128:2:128 --data "$kind" --seed 1 --sparse "topk=$r" \
          $([[ $tail = off ]] && echo --no-tail) $([[ ! -f /tmp/loc_$kind/v.npy ]] && echo --dump /tmp/loc_$kind) \
          2>>"$LOGS/sol_accuracy.err" |
          python3 -c "import json,sys; j=json.load(sys.stdin); print('$kind', $r, '$tail', round(j['routed_fraction'], 4), round(j['rel_l2'], 4), round(j['cosine'], 5))" |
          tee -a "$SUMMARY"
      done
    done
    dirs+=("/tmp/loc_$kind:$kind")
  done
  PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" timeout 300 python3 "$ROOT/bench/sol_accuracy.py" --data "${dirs[@]}" \
    --out "$OUT/sol_accuracy.jsonl" 2>>"$LOGS/sol_accuracy.err" | tee -a "$SUMMARY"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    kernels) run_kernels; [[ -n "${PEERS:-}" ]] && run_peers; shift ;;
    daemon) run_daemon "${2:?daemon BUNDLE}"; shift 2 ;;
    oom12) run_oom12 "${2:?oom12 BUNDLE}"; shift 2 ;;
    peers) run_peers; shift ;;
    *) echo "h200.sh: unknown mode $1 (kernels | daemon BUNDLE | oom12 BUNDLE | peers)"; exit 2 ;;
  esac
done
