#!/usr/bin/env python3
"""Static instruction counts of the sm90 attention kernel's two hot loops, from `cuobjdump -sass` of a
cubin built here (no GPU needed), so that a change to the kernel can be weighed before a device run:

    nvcc -I. --expt-relaxed-constexpr -O2 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a -std=c++17 \
        -cubin -o /tmp/k.cubin kernels/cuda/attention_sm90.cu
    cuobjdump -sass /tmp/k.cubin > /tmp/k.sass     # pip install nvidia-cuda-cuobjdump
    python3 bench/sass_loop.py /tmp/k.sass ILi128ELi4ELb1ELb0E   # d = 128, 4 stages, INT8 path, dense

consumer: the smallest backward-branch loop holding the MMAs and MUFU.EX2, less the ranges a forward
branch skips that hold the mask code (BSSY) or the O rescale (mostly in-place FMULs): what a consumer warp
issues per page on an unmasked page without a new row maximum. producer: the smallest loop holding the
INT4 V decode (HFMA2) and no MMA, every branch counted (both page formats' decodes). Dynamic counts
per CTA-page come from Nsight Compute (bench/sass_profile.py).
"""
import re
import sys
from collections import Counter


def instructions(sass, kernel):
    funcs = re.split(r"\n\s*Function : ", sass)
    body = next(f for f in funcs[1:] if kernel in f.split("\n")[0])
    out = []
    for line in body.split("\n"):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0]


def branch_target(text):
    m = re.search(r"BRA (0x[0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def smallest_loop(ins, keep):
    best = None
    for addr, text in ins:
        target = branch_target(text)
        if target is None or target >= addr:
            continue
        body = [x for x in ins if target <= x[0] <= addr]
        if keep(body) and (best is None or len(body) < len(best)):
            best = body
    return best


def consumer_loop(ins):  # holds the MMAs and the exponentials
    return smallest_loop(ins, lambda b: any("GMMA" in x[1] for x in b) and any("MUFU.EX2" in x[1] for x in b))


def producer_loop(ins):  # holds the INT4 V decode and no MMA
    return smallest_loop(ins, lambda b: any("HFMA2" in x[1] for x in b) and not any("GMMA" in x[1] for x in b))


def is_rescale(text):  # FMUL Rn, Rn, corr: O (and the row sums) scaled in place
    return re.match(r"FMUL (R\d+), \1,", text) is not None


def hot_path(loop):
    cold = set()
    for addr, text in loop:
        target = branch_target(text)
        if target is None or not text.startswith("@") or target <= addr or target > loop[-1][0]:
            continue
        skipped = [x for x in loop if addr < x[0] < target]
        if any("MUFU.EX2" in x[1] or "F2FP" in x[1] for x in skipped):
            continue
        if any("BSSY" in x[1] for x in skipped) or sum(is_rescale(x[1]) for x in skipped) > 0.8 * len(skipped):
            cold.update(x[0] for x in skipped)
    return [x for x in loop if x[0] not in cold]


def summary(name, body):
    ops = Counter(opcode(text) for _, text in body)
    print(f"{name}: {len(body)} instructions  " + ", ".join(f"{o} {n}" for o, n in ops.most_common(16)))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ins = instructions(open(sys.argv[1]).read(), sys.argv[2])
    consumer, producer = consumer_loop(ins), producer_loop(ins)
    if consumer:
        summary("consumer loop, hot path", hot_path(consumer))
    if producer:
        summary("producer loop, all branches", producer)


if __name__ == "__main__":
    main()
