#!/usr/bin/env bash
# Status round-trip latency while 16 client threads run layers on the same host (issue 16: Status
# p99 must stay <= 5 ms on a 2-core host; it was ~15 ms). Loopback only, bounded: at most
# LAYERS (64) small layers and STATUS_CALLS (5000) Status calls, each side under a timeout.
#
#   bench/status_under_load.sh [BUILD_DIR] [extra kvpackd flags...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
shift || true
layers=${LAYERS:-64}
calls=${STATUS_CALLS:-5000}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$build/server/service/kvpackd" --listen=127.0.0.1:$port --metrics_address=off --vram_budget=1Gi "$@" \
  >/dev/null 2>&1 &
daemon=$!
load=""
cleanup() {
  [ -n "$load" ] && kill "$load" 2>/dev/null || true
  kill "$daemon" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
cli="$build/client/kvpack --server=127.0.0.1:$port"
for _ in $(seq 50); do $cli health >/dev/null 2>&1 && break; sleep 0.1; done
timeout 300 $cli bench --iterations "$layers" --concurrency 16 --tokens 1000 >/dev/null 2>&1 &
load=$!
sleep 2  # the 16 threads are uploading and the executor is busy
timeout 120 $cli bench --rpc status --iterations "$calls"
echo "(under load: $(nproc) cores, 16 layer threads, $layers layers of N=1000; load average $(cut -d' ' -f1 /proc/loadavg))"
