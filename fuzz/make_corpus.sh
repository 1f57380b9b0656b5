#!/usr/bin/env bash
# Regenerates the seed corpora in fuzz/corpus/ (small, committed) from readable sources:
#   seeds/plan_*.textproto   v1.PlanRequest            → corpus/plan_fuzz/
#   seeds/layer_*.textproto  flags byte + v1.LayerHeader → corpus/layer_fuzz/ (flags from "# flags 0x..")
#   page_fuzz and npy_fuzz seeds are written below (hand-made byte layouts).
# Needs protoc (Debian protobuf-compiler). Run from anywhere; only needed when a seed changes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
proto_root=$here/../proto
encode() { protoc --proto_path="$proto_root" --encode="$1" kvpack/v1/kvpack.proto <"$2"; }
mkdir -p "$here"/corpus/{plan_fuzz,layer_fuzz,page_fuzz,npy_fuzz}

# Each seed twice: wire bytes, and 't' + the text itself (plan_fuzz.cc ParseInput).
for f in "$here"/seeds/plan_*.textproto; do
  encode kvpack.v1.PlanRequest "$f" >"$here/corpus/plan_fuzz/$(basename "$f" .textproto)"
  { printf t; grep -v '^#' "$f"; } >"$here/corpus/plan_fuzz/$(basename "$f" .textproto).txt"
done
for f in "$here"/seeds/layer_*.textproto; do
  flags=$(sed -n 's/^# flags 0x\([0-9a-f][0-9a-f]\).*/\1/p' "$f")
  { printf "\\x$flags"; encode kvpack.v1.LayerHeader "$f"; } >"$here/corpus/layer_fuzz/$(basename "$f" .textproto)"
  { printf "\\x$flags"; printf t; grep -v '^#' "$f"; } >"$here/corpus/layer_fuzz/$(basename "$f" .textproto).txt"
  { printf 'theader {\n'; grep -v '^#' "$f"; printf '}\n'; } >"$here/corpus/plan_fuzz/$(basename "$f" .textproto).txt"
  # Each layer seed is a plan seed too (PlanRequest.header is field 1, length-delimited).
  encode kvpack.v1.LayerHeader "$f" | python3 -c '
import sys
b = sys.stdin.buffer.read()
n, v = len(b), bytearray()
while True:
    v.append((n & 0x7f) | (0x80 if n > 0x7f else 0)); n >>= 7
    if not n: break
sys.stdout.buffer.write(b"\x0a" + bytes(v) + b)' >"$here/corpus/plan_fuzz/$(basename "$f" .textproto)"
done

# page_fuzz: selector byte (0 raw validation, 1 entry over arbitrary bytes, 2 row round trip), then
# the fields each part reads (page_fuzz.cc).
python3 - "$here/corpus/page_fuzz" <<'PY'
import struct, sys, random
out = sys.argv[1]
rng = random.Random(20261203)
def w(name, b): open(f"{out}/{name}", "wb").write(b)
# Raw validation: N = 200, shape (200, 64, 2, 32), gpu flag, 2 ranges tiling [0, 200).
w("validate_ok", bytes([0]) + struct.pack("<qiii", 200, 64, 2, 32) + b"\x00" + bytes([2])
  + struct.pack("<qqiB", 0, 120, 0, 0) + struct.pack("<qqiB", 120, 200, 1, 2))
# Raw validation with a range past N and an int64 extreme.
w("validate_bad", bytes([0]) + struct.pack("<qiii", 10, 1, 1, 16) + b"\x01" + bytes([1])
  + struct.pack("<qqiB", 0, 2**63 - 1, 0, 7))
# Entry: d = 64, H = 2, 3 ranges (70 int4, 1 int8, 130 bf16), causal, rotated, then page bytes.
w("entry_mixed", bytes([1, 2, 1, 2, 69, 0, 0, 0, 1, 1, 129, 2, 2, 1, 1]) + struct.pack("<Q", 42)
  + bytes(rng.randrange(256) for _ in range(512)))
# Entry: d = 256, one INT4 range of 64 tokens, codes and metadata of fp16 specials.
w("entry_int4_specials", bytes([1, 4, 0, 0, 63, 0, 0, 0, 0]) + struct.pack("<Q", 1)
  + struct.pack("<8H", 0x7c00, 0xfc00, 0x7e00, 0x0001, 0x8001, 0x3c00, 0xbc00, 0x7bff))
# Row round trips: d = 128 of seeded floats with an outlier, and d = 16 of tiny values.
xs = [rng.gauss(0, 1) for _ in range(128)]; xs[5] = 900.0
w("row_outlier", bytes([2, 3]) + struct.pack("<128f", *xs) + bytes([7, 63, 0]))
w("row_tiny", bytes([2, 0]) + struct.pack("<16f", *[rng.uniform(-1e-7, 1e-7) for _ in range(16)]) + bytes([1, 2, 3]))
PY

# npy_fuzz: valid version 1.0 and 2.0 files, and the refusals a user meets most.
python3 - "$here/corpus/npy_fuzz" <<'PY'
import struct, sys
out = sys.argv[1]
def npy(header, data, major=1):
    h = header + " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    pre = b"\x93NUMPY" + bytes([major, 0]) + (struct.pack("<H", len(h)) if major == 1 else struct.pack("<I", len(h)))
    return pre + h.encode() + data
vals = struct.pack("<6f", 0.5, -1.25, 3.0, 7.5, -0.125, 2.0)
open(f"{out}/v1_2x3", "wb").write(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", vals))
open(f"{out}/v2_6", "wb").write(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }", vals, 2))
open(f"{out}/v1_scalar", "wb").write(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", vals[:4]))
open(f"{out}/f8", "wb").write(npy("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", vals))
open(f"{out}/fortran", "wb").write(npy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", vals))
open(f"{out}/truncated", "wb").write(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 3), }", vals))
PY
echo "corpus: $(find "$here/corpus" -type f | wc -l) seeds, $(du -sk "$here/corpus" | cut -f1) KiB"
