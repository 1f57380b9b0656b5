"""kvpack.shm.SharedArena against the fake daemon, and a real kvpackd when one is built."""

import numpy as np
import pytest

from kvpack import reference, tensors
from kvpack.shm import SharedArena
from kvpack.types import Range

H, HD, D = 2, 32, 48


@pytest.fixture
def client(each_daemon_client):
    return each_daemon_client


def test_layers_through_the_arena_grow_and_survive_a_dropped_region(client):
    r = np.random.default_rng(6)
    w = tensors.to_bf16_bits(r.standard_normal((3 * H * HD, D)) / D ** 0.5)
    weights = client.register_weights(w, n_heads=H, head_dim=HD)
    with SharedArena(client, initial_bytes=1 << 14) as arena:
        for n in (40, 300):                       # the second needs a bigger object
            x = tensors.to_bf16_bits(r.standard_normal((n, D)))
            out = arena.attention_layer(x, weights, n_heads=H, head_dim=HD,
                                        ranges=[Range(0, n, 0, ("bf16",))])
            want = reference.attention_layer(tensors.from_bf16_bits(x),
                                             tensors.from_bf16_bits(w), H, HD)
            got = tensors.from_bf16_bits(out.output)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.01
        assert arena.size >= 300 * D * 2 + 300 * H * HD * 2
        client.unregister_region(arena.region_id)  # as if its lease had run out
        out2 = arena.attention_layer(x, weights, n_heads=H, head_dim=HD,
                                     ranges=[Range(0, 300, 0, ("bf16",))])
        np.testing.assert_array_equal(out2.output, out.output)
        assert len(client.region_status()) == 1
    assert client.region_status() == [], "close() unregisters"


def test_output_location_is_the_arenas(client):
    with SharedArena(client) as arena:
        with pytest.raises(ValueError):
            arena.attention_layer(np.zeros((4, D), np.uint16), "w", n_heads=H, head_dim=HD,
                                  ranges=[Range(0, 4)], output="in_place")
