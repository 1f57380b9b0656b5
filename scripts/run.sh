#!/usr/bin/env bash
# The main job: set up (idempotent), build, start kvpackd (GPU when one answers, else the CPU
# backend) with a sample layer request from the `kvpack` CLI, then show the packed format's accuracy
# with kvpack-eval on generated structured K/V.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/setup.sh"
"$here/scripts/build.sh"
build=${KVPACK_BUILD_DIR:-$here/build}
"$here/scripts/run_daemon_demo.sh" "$build"
echo "== kvpack-eval: INT4 pages vs FP64 attention on structured K/V (N=4133, 4 heads × 128, 20x outliers)"
"$build/tools/kvpack_eval/kvpack-eval" --synthetic 4133:4:128:20 --format int4
