"""bench/sass_loop.py on a made-up cuobjdump listing: which loop is the consumer's, which branch-skipped
ranges leave its hot path (mask code, O rescale) and which stay (the softmax itself), and the producer's."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sass_loop  # noqa: E402


def listing(lines):
    body = "\n".join(f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(lines))
    return "\n\tFunction : _Z6OtherKernelv\n        /*0000*/ EXIT ;\n\tFunction : _Z6KernelILi128ELi4ELb1ELb0E\n" + body


def consumer_and_producer():
    lines = [
        "S2R R0, SR_TID.X",                        # 0x00: prologue
        "HGMMA.64x128x16.F32.BF16 R24, R4, gdesc[UR8], R24",   # 0x10: consumer loop starts
        "@P0 BRA 0x50",                            # 0x20: skips the mask code
        "BSSY B0, 0x50",                           # 0x30
        "FSEL R8, R8, -INF, P1",                   # 0x40
        "MUFU.EX2 R9, R9",                         # 0x50
        "@!P2 BRA 0x80",                           # 0x60: skips the O rescale
        "FMUL R24, R24, R30",                      # 0x70
        "F2FP.BF16.F32.PACK_AB R4, R9, R8",        # 0x80
        "@P3 BRA 0xb0",                            # 0x90: skips work that holds an exponential: stays
        "MUFU.EX2 R10, R10",                       # 0xa0
        "@P4 BRA 0x10",                            # 0xb0: back edge
        "LOP3.LUT R2, R3, 0xf000f, R4, 0xea, !PT",  # 0xc0: producer loop
        "HFMA2.BF16_V2 R2, R2, R5, R6",            # 0xd0
        "@P5 BRA 0xc0",                            # 0xe0: back edge
        "EXIT",
    ]
    ins = sass_loop.instructions(listing(lines), "ILi128ELi4ELb1ELb0E")
    return sass_loop.consumer_loop(ins), sass_loop.producer_loop(ins)


def test_finds_the_named_kernel_and_its_two_loops():
    consumer, producer = consumer_and_producer()
    assert [a for a, _ in consumer] == list(range(0x10, 0xc0, 0x10))
    assert [a for a, _ in producer] == [0xc0, 0xd0, 0xe0]


def test_hot_path_leaves_out_mask_code_and_o_rescale_only():
    consumer, _ = consumer_and_producer()
    hot = [a for a, _ in sass_loop.hot_path(consumer)]
    assert 0x30 not in hot and 0x40 not in hot  # the mask code
    assert 0x70 not in hot                      # the O rescale
    assert 0xa0 in hot                          # a skipped range with an exponential stays
    assert len(hot) == len(consumer) - 3


def test_opcode_drops_the_predicate():
    assert sass_loop.opcode("@!UP0 UIADD3 UR6, UR6, 0x2, URZ") == "UIADD3"
    assert sass_loop.opcode("@P1 BRA 0x10") == "BRA"
