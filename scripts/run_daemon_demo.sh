#!/usr/bin/env bash
# Demo of the daemon: starts kvpackd (CPU backend when no GPU answers) on loopback, runs
# `kvpack health`, `kvpack plan` and `kvpack run` on a small synthetic layer, prints the results and
# stops the daemon with SIGTERM (it drains, then exits). Builds nothing.
#   scripts/run_daemon_demo.sh [BUILD_DIR]     (default: build/ or $KVPACK_BUILD_DIR)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-${KVPACK_BUILD_DIR:-$here/build}}
kvpackd=$build/server/service/kvpackd
kvpack=$build/client/kvpack
for b in "$kvpackd" "$kvpack"; do
  [ -x "$b" ] || { echo "run_daemon_demo: $b not found; build first (scripts/build.sh)" >&2; exit 1; }
done

log=$(mktemp -t kvpackd.XXXXXX.log)
"$kvpackd" --listen=127.0.0.1:0 --metrics_address=127.0.0.1:0 --vram_budget=2Gi --backend=auto >"$log" 2>&1 &
pid=$!
stop() {
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    wait "$pid" || true
  fi
}
trap stop EXIT

# The daemon prints "listening on … (port P), metrics port M" once it serves.
for _ in $(seq 1 100); do
  grep -q "listening on" "$log" && break
  kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.05
done
port=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$log" | head -1)
metrics=$(sed -n 's/.*metrics port \([0-9]*\).*/\1/p' "$log" | head -1)
[ -n "$port" ] || { cat "$log" >&2; exit 1; }
server=127.0.0.1:$port
echo "== kvpackd: $(grep 'listening on' "$log")"

layer=(--tokens 2048 --hidden 512 --heads 8 --head_dim 64 --causal --rope --bias
       --ranges "128:bf16,640:bf16|int8|int4,1280:int8|int4")
echo "== kvpack health";  "$kvpack" --server "$server" health
echo "== kvpack plan";    "$kvpack" --server "$server" plan "${layer[@]}"
echo "== kvpack run";     "$kvpack" --server "$server" run "${layer[@]}"
echo "== kvpack status";  "$kvpack" --server "$server" status
if command -v curl >/dev/null && [ -n "$metrics" ]; then
  echo "== /metrics (pool and requests)"
  curl -s "http://127.0.0.1:$metrics/metrics" | grep -E '^kvpack_(pool_bytes|pool_high_water_bytes|requests_total)' || true
fi
echo "== stopping kvpackd (SIGTERM drains in-flight work)"
stop
trap - EXIT
tail -n 2 "$log"
rm -f "$log"
