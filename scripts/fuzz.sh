#!/usr/bin/env bash
# Runs every libFuzzer target of the ASan+UBSan tree (scripts/sanitize.sh asan builds it) for a
# bounded time each: first the inputs in fuzz/regressions/<target>/ once each (inputs that crashed
# once), then fuzzing from the seeds in fuzz/corpus/<target>/ plus what earlier runs found
# (kept in <build>/fuzz/corpus/<target>/, never written into the source tree).
# Usage: scripts/fuzz.sh [seconds-per-target (60)] [target...]
# KVPACK_FUZZ_RUNS=N stops each target after N executions, if that comes before the time.
# Prints one line per target: execs, execs/s, coverage (edges), features, corpus size.
# A crash, leak, timeout or OOM stops the script; the input is in <build>/fuzz/artifacts/.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${KVPACK_ASAN_BUILD_DIR:-$here/build-asan}
seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in "$build"/fuzz/*_fuzz; do [ -x "$f" ] && targets+=("$(basename "$f")"); done
fi
[ ${#targets[@]} -gt 0 ] || { echo "fuzz: no targets in $build/fuzz (run scripts/sanitize.sh asan)" >&2; exit 1; }
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$here/tests/sanitizers/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

for t in "${targets[@]}"; do
  bin=$build/fuzz/$t
  work=$build/fuzz/corpus/$t
  artifacts=$build/fuzz/artifacts
  mkdir -p "$work" "$artifacts" "$here/fuzz/corpus/$t"
  log=$build/fuzz/$t.log
  if compgen -G "$here/fuzz/regressions/$t/*" >/dev/null; then
    "$bin" -artifact_prefix="$artifacts/$t-" "$here"/fuzz/regressions/"$t"/* >"$log" 2>&1 ||
      { tail -50 "$log"; echo "fuzz: $t fails on a regression input" >&2; exit 1; }
  fi
  # -timeout: one exec past 60 s is a hang (layer_fuzz's calls take milliseconds; its own call
  # deadline is 30 s). -rss_limit_mb: ASan's shadow plus gRPC's threads stay well below 4 GiB.
  extra=()  # the dictionary, a run limit
  [ -f "$here/fuzz/$t.dict" ] && extra=(-dict="$here/fuzz/$t.dict")
  [ -n "${KVPACK_FUZZ_RUNS:-}" ] && extra+=(-runs="$KVPACK_FUZZ_RUNS")
  if ! "$bin" "$work" "$here/fuzz/corpus/$t" "${extra[@]}" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 \
       -print_final_stats=1 -artifact_prefix="$artifacts/$t-" >"$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz: $t FAILED; the input is in $artifacts" >&2
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9a-zA-Z]*\).*/\1/p' <<<"$last")
  # Edges instrumented in the binary (kvpack and the inlined parts of its dependencies' headers).
  edges=$(sed -n 's/^INFO: Loaded 1 modules *(\([0-9]*\) inline 8-bit counters.*/\1/p' "$log" | head -1)
  printf 'fuzz: %-11s %5s s  execs %9s  execs/s %6s  cov %5s of %6s edges  ft %6s  corpus %s\n' \
         "$t" "$seconds" "$execs" "$rate" "$cov" "$edges" "$ft" "$corp"
done
