#!/usr/bin/env bash
# The test command: set up, build, run every test (GPU tests skip without a device).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/setup.sh"
"$here/scripts/build.sh"
build=${KVPACK_BUILD_DIR:-$here/build}
ctest --test-dir "$build" --output-on-failure -j "$(nproc)"
# `pip install client/python` from a fresh clone, in a fresh venv (~15 s with pip's cache).
"$here/scripts/check_python_install.sh"
