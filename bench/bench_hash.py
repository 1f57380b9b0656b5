"""bench/bench_inputs.h's seeded hash, for numpy arrays and torch tensors alike (integer idx):
the 24 bits that bench_layer's inputs turn into a uniform value in [0, 1) as bits · 2^-24."""

M32 = 0xFFFFFFFF


def hash24(stream, idx):
    h = ((idx + stream * 0x9E3779B) * 0x2545F491) & M32
    h ^= h >> 16
    h = (h * 0x3B9ACA07) & M32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & M32
    h ^= h >> 16
    return h >> 8
