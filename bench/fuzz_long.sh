#!/usr/bin/env bash
# Longer fuzzing runs than CI's 60 s per target (scripts/fuzz.sh does the work): each target for
# $1 seconds (default 1800), one after another, growing the corpus kept in <build-asan>/fuzz/corpus/.
# Prints execs, execs/s and coverage per target; record them in bench/RESULTS.md ("Fuzzing").
# Needs the ASan+UBSan tree: scripts/sanitize.sh asan (or configure it by hand, see that script).
# Usage: bench/fuzz_long.sh [seconds-per-target] [target...]
# KVPACK_FUZZ_RUNS=10000000 stops a target at 10 M executions (issue 16's target) when it gets there first.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-1800}
shift || true
echo "fuzz_long: $(date -u +%FT%TZ), $(nproc) cores, ${seconds} s per target, commit $(git -C "$here" rev-parse --short HEAD)"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  build=${KVPACK_ASAN_BUILD_DIR:-$here/build-asan}
  for f in "$build"/fuzz/*_fuzz; do [ -x "$f" ] && targets+=("$(basename "$f")"); done
fi
failed=0
for t in "${targets[@]}"; do  # one at a time, so a finding in one target does not stop the others
  "$here/scripts/fuzz.sh" "$seconds" "$t" || failed=1
done
exit $failed
