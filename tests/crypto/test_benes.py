"""Beneš routing: masked swaps at power-of-two distances realise any permutation."""

from __future__ import annotations

import time
from itertools import permutations

import numpy as np
import pytest

from fedfm.crypto.benes import (
    SwapLayer,
    apply_layers,
    benes_layers,
    drop_identity_layers,
    gather_permutation,
    pad_permutation,
)
from fedfm.errors import ConfigError

SIZES = [1, 2, 4, 8, 64, 256, 1024]


def _expected_distances(size: int) -> list[int]:
    down = [size >> (k + 1) for k in range(size.bit_length() - 1)]
    return down + down[-2::-1]


@pytest.mark.parametrize("size", SIZES)
def test_random_permutations_route_correctly(size: int) -> None:
    rng = np.random.default_rng(1234 + size)
    x = rng.normal(size=size)
    for _ in range(5):
        perm = rng.permutation(size)
        layers = benes_layers(perm)
        np.testing.assert_array_equal(apply_layers(x, layers), x[perm])
        # skipping the layers that swap nothing changes nothing
        np.testing.assert_array_equal(apply_layers(x, drop_identity_layers(layers)), x[perm])


@pytest.mark.parametrize("size", [2, 4])
def test_every_small_permutation_routes(size: int) -> None:
    x = np.arange(size) * 10
    for perm in permutations(range(size)):
        p = np.array(perm)
        assert np.array_equal(apply_layers(x, benes_layers(p)), x[p]), perm


def test_many_random_permutations_of_eight_route() -> None:
    rng = np.random.default_rng(8)
    x = np.arange(8) * 10
    for _ in range(500):
        p = rng.permutation(8)
        assert np.array_equal(apply_layers(x, benes_layers(p)), x[p]), p


def test_routing_acts_on_the_first_axis_of_multidimensional_values() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, 3, 2))
    perm = rng.permutation(16)
    np.testing.assert_array_equal(apply_layers(x, benes_layers(perm)), x[perm])


def test_structured_permutations_route() -> None:
    size = 64
    x = np.arange(size)
    cases = [
        np.arange(size)[::-1],
        np.roll(np.arange(size), 5),
        np.arange(size).reshape(8, 8).T.ravel(),  # transpose
        np.concatenate([np.arange(0, size, 2), np.arange(1, size, 2)]),  # deinterleave
    ]
    for perm in cases:
        np.testing.assert_array_equal(apply_layers(x, benes_layers(perm)), x[perm])


@pytest.mark.parametrize("size", SIZES)
def test_identity_swaps_nothing(size: int) -> None:
    layers = benes_layers(np.arange(size))
    assert all(not layer.swap.any() for layer in layers)
    assert drop_identity_layers(layers) == []


@pytest.mark.parametrize("size", SIZES)
def test_layer_count_distances_and_shapes(size: int) -> None:
    rng = np.random.default_rng(size)
    layers = benes_layers(rng.permutation(size))
    expected = _expected_distances(size)
    assert len(layers) == (0 if size == 1 else 2 * (size.bit_length() - 1) - 1)
    assert [layer.distance for layer in layers] == expected
    for layer in layers:
        assert layer.swap.dtype == np.bool_
        assert layer.swap.shape == (size,)


def test_distance_sequence_for_size_sixteen() -> None:
    layers = benes_layers(np.random.default_rng(0).permutation(16))
    assert [layer.distance for layer in layers] == [8, 4, 2, 1, 2, 4, 8]


@pytest.mark.parametrize("size", [2, 8, 256, 1024])
def test_swaps_never_set_at_positions_with_the_distance_bit(size: int) -> None:
    rng = np.random.default_rng(99)
    positions = np.arange(size)
    for _ in range(3):
        for layer in benes_layers(rng.permutation(size)):
            assert not layer.swap[(positions & layer.distance) != 0].any()


def test_random_permutations_use_swaps() -> None:
    # a non-trivial permutation needs at least one swapping layer
    rng = np.random.default_rng(3)
    layers = drop_identity_layers(benes_layers(rng.permutation(64)))
    assert layers
    assert all(layer.swap.any() for layer in layers)


def test_drop_identity_layers_keeps_order_and_non_identity() -> None:
    a = SwapLayer(1, np.array([True, False, False, False]))
    b = SwapLayer(2, np.zeros(4, dtype=bool))
    c = SwapLayer(2, np.array([False, True, False, False]))
    assert drop_identity_layers([a, b, c]) == [a, c]
    assert drop_identity_layers(iter([b, b])) == []


@pytest.mark.parametrize(
    ("permutation", "match"),
    [
        (np.array([0, 2, 1]), "power of two"),
        (np.array([], dtype=np.int64), "power of two"),
        (np.array([0, 1, 1, 3]), "repeated"),
        (np.array([0, 1, 2, 4]), "outside range"),
        (np.array([-1, 0, 1, 2]), "outside range"),
        (np.arange(4).reshape(2, 2), "1-D"),
        (np.array([0.0, 1.0]), "integers"),
    ],
)
def test_bad_permutations_raise_config_error(permutation: np.ndarray, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        benes_layers(permutation)


def test_pad_permutation_fixes_the_new_positions() -> None:
    padded = pad_permutation(np.array([2, 0, 1]), 8)
    np.testing.assert_array_equal(padded, [2, 0, 1, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(pad_permutation(np.array([1, 0]), 2), [1, 0])
    x = np.arange(8) * 3
    np.testing.assert_array_equal(apply_layers(x, benes_layers(padded)), x[padded])
    with pytest.raises(ConfigError, match="cannot pad"):
        pad_permutation(np.array([1, 0, 2]), 2)
    with pytest.raises(ConfigError, match="repeated"):
        pad_permutation(np.array([0, 0]), 4)


def test_gather_permutation_puts_selection_first() -> None:
    indices = np.array([4, 1, 5])
    perm = gather_permutation(indices, source_size=6, size=8)
    np.testing.assert_array_equal(perm, [4, 1, 5, 0, 2, 3, 6, 7])
    assert np.array_equal(np.sort(perm), np.arange(8))
    x = np.arange(8) + 100
    routed = apply_layers(x, benes_layers(perm))
    np.testing.assert_array_equal(routed[:3], x[indices])


def test_gather_permutation_random_selection_routes() -> None:
    rng = np.random.default_rng(11)
    source_size, size = 300, 512
    indices = rng.choice(source_size, size=100, replace=False)
    perm = gather_permutation(indices, source_size, size)
    assert np.array_equal(np.sort(perm), np.arange(size))
    np.testing.assert_array_equal(perm[:100], indices)
    rest = perm[100:]
    assert np.all(np.diff(rest) > 0)
    x = rng.normal(size=(size, 2))
    np.testing.assert_array_equal(apply_layers(x, benes_layers(perm))[:100], x[indices])


def test_gather_permutation_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="distinct"):
        gather_permutation(np.array([1, 1]), 4, 4)
    with pytest.raises(ConfigError, match="outside range"):
        gather_permutation(np.array([0, 4]), 4, 8)
    with pytest.raises(ConfigError, match="outside range"):
        gather_permutation(np.array([-1]), 4, 4)
    with pytest.raises(ConfigError, match="power of two"):
        gather_permutation(np.array([0]), 4, 6)
    with pytest.raises(ConfigError, match="power of two"):
        gather_permutation(np.array([0]), 8, 4)


def test_apply_layers_returns_a_new_array_and_checks_sizes() -> None:
    x = np.arange(4)
    layer = SwapLayer(2, np.array([True, False, False, False]))
    out = apply_layers(x, [layer])
    np.testing.assert_array_equal(out, [2, 1, 0, 3])
    np.testing.assert_array_equal(x, [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="positions"):
        apply_layers(np.arange(8), [layer])


def test_swap_layer_rejects_masks_at_upper_positions() -> None:
    with pytest.raises(ConfigError, match="bit"):
        SwapLayer(1, np.array([False, True]))
    with pytest.raises(ConfigError, match="power of two"):
        SwapLayer(3, np.zeros(6, dtype=bool))
    with pytest.raises(ConfigError, match="multiple"):
        SwapLayer(4, np.zeros(4, dtype=bool))


def test_swap_layer_is_immutable_and_hashable() -> None:
    mask = np.array([True, False, False, False])
    layer = SwapLayer(1, mask)
    mask[0] = False  # the layer keeps its own copy
    assert layer.swap[0]
    with pytest.raises(ValueError):
        layer.swap[0] = False
    assert layer == SwapLayer(1, np.array([True, False, False, False]))
    assert hash(layer) == hash(SwapLayer(1, np.array([True, False, False, False])))


def test_routing_4096_is_fast() -> None:
    perm = np.random.default_rng(5).permutation(4096)
    start = time.perf_counter()
    layers = benes_layers(perm)
    elapsed = time.perf_counter() - start
    x = np.arange(4096)
    np.testing.assert_array_equal(apply_layers(x, layers), x[perm])
    assert elapsed < 10.0  # about 0.1 s idle; a generous bound that load cannot trip
