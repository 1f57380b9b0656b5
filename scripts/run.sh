#!/usr/bin/env bash
# The main job: set up, build, and run kvpack on generated data.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/setup.sh"
"$here/scripts/build.sh"
build=${KVPACK_BUILD_DIR:-$here/build}
echo "kvpack: no main job wired yet"
