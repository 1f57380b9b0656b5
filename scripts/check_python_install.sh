#!/usr/bin/env bash
# Proves that `pip install client/python` works from a fresh clone: copies the clean tree (tracked
# and unignored files only, so no generated kvpack/v1 stubs), installs the client into a fresh venv
# and imports kvpack.v1. Part of scripts/test.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
# (A tracked file deleted in the working tree is skipped; the checks below catch a broken copy.)
git -C "$here" ls-files -z --cached --others --exclude-standard |
  (cd "$here" && xargs -0 cp --parents --no-dereference -t "$tmp/src" 2>/dev/null || true)
for f in client/python/setup.py client/python/pyproject.toml proto/kvpack/v1/kvpack.proto; do
  [ -f "$tmp/src/$f" ] || { echo "check_python_install: $f missing from the copy" >&2; exit 1; }
done
if [ -e "$tmp/src/client/python/kvpack/v1" ]; then
  echo "check_python_install: the copy holds client/python/kvpack/v1 (not a clean tree)" >&2
  exit 1
fi
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check "$tmp/src/client/python"
(cd "$tmp" && "$tmp/venv/bin/python" -c '
import kvpack, kvpack.v1.kvpack_pb2 as pb, kvpack.v1.kvpack_pb2_grpc as rpc, kvpack.client
assert pb.LayerHeader.DESCRIPTOR.full_name == "kvpack.v1.LayerHeader"
assert hasattr(rpc, "KvpackStub")
print("check_python_install: kvpack.v1 imports from a fresh venv:", pb.__file__)')
