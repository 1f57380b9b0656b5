"""Makes a timing-only variant of a kvpack tree with one part of the wgmma attention removed, to see
what limits it (its outputs are wrong; bench/attn_h200.sh VARIANTS=... times it next to the real one).

    python3 bench/attn_variant.py VARIANT TREE [BASE_TREE]

  nodecode  the producers write the key table but skip decoding K and V (the tiles keep stale bytes)
  noexp     the consumers skip the exponentials of the softmax (no MUFU.EX2 per logit)
  nopingpong the deep ring's consumer groups issue their MMAs without taking turns (a correct kernel)
  basepages BASE_TREE's producer decode (wgmma_pages.cuh) in this tree (a correct kernel)
"""
import pathlib
import sys

WGMMA = "kernels/cuda/attention_wgmma.cu"
EDITS = {  # variant: [(file, old text, new text)]
    "nodecode": [("kernels/cuda/wgmma_pages.cuh", "    keys[ptid] = key;\n  }\n", "    keys[ptid] = key;\n  }\n  return;\n")],
    "noexp": [(WGMMA, "sc[n][e] = Exp2Ftz(sc[n][e] - m_use);", "sc[n][e] = sc[n][e] - m_use;")],
    "nopingpong": [(WGMMA, "if (consumer == 1) BarArrive(T::kTurnBar, 2 * 128);", ""),
                   (WGMMA, "BarSync(turn, 2 * 128);", ""),
                   (WGMMA, "if (consumer == 0 || more) BarArrive(other_turn, 2 * 128);", "")],
}

variant, tree = sys.argv[1], pathlib.Path(sys.argv[2])
if variant == "basepages":
    pages = "kernels/cuda/wgmma_pages.cuh"
    text = (pathlib.Path(sys.argv[3]) / pages).read_text().replace("PackBf16x2(", "PackBf16(")
    marker = "template <int kDim>\nstruct ProducerUnits"
    assert text.count(marker) == 1, "BASE_TREE's ProducerUnits"
    (tree / pages).write_text(text.replace(marker, "inline constexpr int kProducerThreads = 256;\n" + marker))
    sys.exit(0)
for path, old, new in EDITS[variant]:
    text = (tree / path).read_text()
    if text.count(old) != 1:
        sys.exit(f"attn_variant: {variant}: the text to replace is not once in {path}")
    (tree / path).write_text(text.replace(old, new))
