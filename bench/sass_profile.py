#!/usr/bin/env python3
"""Summarises an Nsight Compute source page (`ncu --page source --csv --print-source sass`) of one
attention launch: warp instructions per CTA per page by opcode, stall reasons, and the hottest sites.

    python3 bench/sass_profile.py sass.csv --ctas 1792 --pages 256
"""
import argparse
import csv
import re
from collections import Counter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--ctas", type=int, required=True, help="CTAs of the profiled launch")
    ap.add_argument("--pages", type=int, required=True, help="pages each CTA visits")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names, data = rows[header], rows[header + 1:]
    col = {n: i for i, n in enumerate(names)}
    num = lambda r, n: int(r[col[n]] or 0) if n in col else 0
    stalls = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    per_page = args.ctas * args.pages

    ops = Counter()
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[col["Source"]].strip()).split(" ")[0]
        ops[op] += num(r, "Instructions Executed") / per_page
    print(f"warp instructions per CTA-page: {sum(ops.values()):.0f}")
    print("  " + ", ".join(f"{op} {n:.0f}" for op, n in ops.most_common(30)))
    totals = Counter({s[6:]: sum(num(r, s) for r in data) for s in stalls})
    all_samples = sum(totals.values()) or 1
    print("stall samples: " + ", ".join(f"{s} {100 * n / all_samples:.1f}%" for s, n in totals.most_common(10)))
    # Regions by setmaxnreg, in address order: the code after each USETMAXREG runs under its register
    # count, so the highest register it names must stay below that count (else the kernel is wrong).
    region, regions = "entry", {}
    for r in data:
        src = r[col["Source"]]
        if "SETMAXREG" in src:
            region = src.strip().split(" ")[0] + " " + src.strip().split(" ")[-1]
        reg = max((int(x) for x in re.findall(r"\bR(\d+)\b", src)), default=-1)
        info = regions.setdefault(region, [0, -1])
        info[0] += num(r, "Instructions Executed") / per_page
        info[1] = max(info[1], reg)
    for name, (n, reg) in regions.items():
        print(f"region {name}: {n:.0f} warp instructions per CTA-page, highest register R{reg}")
    print(f"hottest {args.top} sites (samples, executions per CTA-page, top reasons):")
    hot = sorted(data, key=lambda r: -num(r, "Warp Stall Sampling (All Samples)"))[: args.top]
    for r in hot:
        reasons = sorted(((num(r, s), s[6:]) for s in stalls), reverse=True)[:3]
        print(f"  {r[0][-5:]} {num(r, 'Warp Stall Sampling (All Samples)'):7d} "
              f"{num(r, 'Instructions Executed') / per_page:6.2f}  {r[col['Source']].strip()[:60]:60} "
              + " ".join(f"{s}:{n}" for n, s in reasons if n))


if __name__ == "__main__":
    main()
