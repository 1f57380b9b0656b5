#!/usr/bin/env python3
"""docs/quality.md's real-activation table from minilm_qkv.py's captures.

For each layer and format: kvpack-eval naive (--no-rotate --no-smooth --no-balance), all transforms on
(--fixed-transforms) and the per-head choice (default), mean cosine averaged over the chunks and the
worst head over them, the choice's rel_l2 (mean over chunks), estimate / measured rel_l2 (range over
chunks), and the heads whose chosen cosine is below their naive one (count, largest deficit).

  real_table.py build/tools/kvpack_eval/kvpack-eval /tmp/qkv_gfdl:0 /tmp/qkv_gfdl:1 /tmp/qkv_apache:0
"""
import concurrent.futures
import json
import subprocess
import sys

METHODS = {"naive": ["--no-rotate", "--no-smooth", "--no-balance"], "all": ["--fixed-transforms"], "chosen": []}
FORMATS = ("int4", "int8")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    binary = sys.argv[1]
    chunks = [(d, int(c)) for d, c in (a.rsplit(":", 1) for a in sys.argv[2:])]
    layers = 6

    def run(job):
        directory, chunk, layer, fmt, method = job
        prefix = f"{directory}/chunk{chunk}_layer{layer}_"
        args = [binary, "--q", prefix + "q.npy", "--k", prefix + "k.npy", "--v", prefix + "v.npy", "--format", fmt,
                "--threads", "1"] + METHODS[method]
        return job, json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)

    jobs = [(d, c, l, f, m) for f in FORMATS for l in range(layers) for d, c in chunks for m in METHODS]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = dict(pool.map(run, jobs))
    print("| layer | naive cos (worst) | all on cos (worst) | chosen cos (worst) | chosen rel_l2 | est/meas "
          "| heads < naive (largest deficit) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for f in FORMATS:
        below_total = 0
        for l in range(layers):
            of = {m: [results[(d, c, l, f, m)] for d, c in chunks] for m in METHODS}
            cells = [f"{sum(r['cosine'] for r in rs) / len(rs):.6f} ({min(r['worst_head_cosine'] for r in rs):.5f})"
                     for rs in of.values()]
            chosen = of["chosen"]
            ratios = [r["estimated_rel_l2"] / r["rel_l2"] for r in chosen]
            deficits = [hn["cosine"] - hc["cosine"] for rc, rn in zip(chosen, of["naive"])
                        for hc, hn in zip(rc["heads"], rn["heads"]) if hc["cosine"] < hn["cosine"]]
            below_total += len(deficits)
            heads = sum(len(r["heads"]) for r in chosen)
            print(f"| {f} L{l} | " + " | ".join(cells) + f" | {sum(r['rel_l2'] for r in chosen) / len(chosen):.4f} | "
                  f"{min(ratios):.2f}–{max(ratios):.2f} | {len(deficits)}/{heads} ({max(deficits, default=0):.1e}) |")
        print(f"{f}: {below_total} heads below naive", file=sys.stderr)


if __name__ == "__main__":
    main()
