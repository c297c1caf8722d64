"""Shard permutation per epoch and the bounded shuffle buffer."""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.stream.shuffle import buffer_rng, rng_for, shard_order, shuffle_buffer


def test_shard_order_is_a_permutation_fixed_by_seed_and_epoch():
    a = shard_order(50, seed=3, epoch=0)
    assert sorted(a.tolist()) == list(range(50))
    assert np.array_equal(a, shard_order(50, seed=3, epoch=0))
    assert not np.array_equal(a, shard_order(50, seed=3, epoch=1))
    assert not np.array_equal(a, shard_order(50, seed=4, epoch=0))


def test_shard_order_without_shuffle_is_identity():
    assert shard_order(7, seed=1, epoch=5, shuffle=False).tolist() == list(range(7))


@pytest.mark.parametrize(
    "n,size", [(0, 10), (5, 10), (10, 10), (11, 10), (1000, 64), (50, 0), (50, 1)]
)
def test_every_item_comes_out_exactly_once(n, size):
    out = list(shuffle_buffer(range(n), size, rng_for(0, 0)))
    assert sorted(out) == list(range(n))


def test_small_buffers_pass_through_in_order():
    assert list(shuffle_buffer(range(20), 1, rng_for(0, 0))) == list(range(20))
    assert list(shuffle_buffer(range(20), 0, rng_for(0, 0))) == list(range(20))


def test_order_is_reproducible_and_depends_on_the_generator():
    a = list(shuffle_buffer(range(500), 50, buffer_rng(1, 2, 0, 0)))
    b = list(shuffle_buffer(range(500), 50, buffer_rng(1, 2, 0, 0)))
    c = list(shuffle_buffer(range(500), 50, buffer_rng(1, 2, 0, 1)))
    assert a == b
    assert a != c
    assert a != list(range(500))


def test_buffer_never_holds_more_than_its_size():
    consumed = 0

    def source():
        nonlocal consumed
        for i in range(2000):
            consumed += 1
            yield i

    produced = 0
    for _ in shuffle_buffer(source(), 100, rng_for(0, 0)):
        produced += 1
        # Items taken from the source but not yet emitted are the ones held in the buffer.
        assert consumed - produced <= 100
    assert produced == 2000


def test_displacement_grows_with_buffer_size():
    n = 20000
    means = []
    for size in (10, 100, 1000):
        out = np.fromiter(shuffle_buffer(range(n), size, rng_for(0, 0)), dtype=np.int64)
        displacement = np.abs(np.arange(n) - out)
        means.append(displacement.mean())
        # A sample waits a geometric number of steps (mean = size) in the buffer.
        assert 0.5 * size < displacement.mean() < 2.0 * size
    assert means[0] < means[1] < means[2]
