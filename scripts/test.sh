#!/usr/bin/env bash
# The test command: set up, build, run every test (GPU tests skip without a device); then the
# sanitizer builds (ASan+UBSan: every test; TSan: the core's tests) and each fuzz target for
# $KVPACK_FUZZ_SECONDS (60) seconds. KVPACK_CI_SANITIZE=0 skips the last two steps (a quick local run).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/setup.sh"
"$here/scripts/build.sh"
build=${KVPACK_BUILD_DIR:-$here/build}
ctest --test-dir "$build" --output-on-failure -j "$(nproc)"
# `pip install client/python` from a fresh clone, in a fresh venv (~15 s with pip's cache).
"$here/scripts/check_python_install.sh"
if [ "${KVPACK_CI_SANITIZE:-1}" != 0 ]; then
  "$here/scripts/sanitize.sh" asan tsan
  "$here/scripts/fuzz.sh" "${KVPACK_FUZZ_SECONDS:-60}"
fi
