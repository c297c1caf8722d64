"""Rank and worker discovery: explicit values, environment, DataLoader workers."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, IterableDataset

from shardkit.errors import InputError
from shardkit.stream.world import World, current_world, distributed_rank, worker_slot


def test_defaults_without_distributed(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed_rank() == (0, 1)


def test_environment_is_read(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert distributed_rank() == (2, 3)


def test_explicit_values_win_over_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert distributed_rank(rank=0, world_size=2) == (0, 2)
    assert distributed_rank(rank=1) == (1, 3)


@pytest.mark.parametrize("rank,size", [(2, 2), (-1, 2), (0, 0)])
def test_impossible_rank_is_an_input_error(rank, size):
    with pytest.raises(InputError, match="world size"):
        distributed_rank(rank, size)


def test_garbage_environment_names_the_variables(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="RANK="):
        distributed_rank()


def test_outside_a_worker_is_worker_zero_of_one():
    assert worker_slot() == (0, 1)
    assert current_world(1, 2) == World(1, 2, 0, 1)


class _Report(IterableDataset):
    def __iter__(self):
        yield current_world(0, 1)


def test_inside_dataloader_workers():
    loader = DataLoader(_Report(), batch_size=None, num_workers=2)
    worlds = sorted(list(loader), key=lambda w: w.worker)
    assert worlds == [World(0, 1, 0, 2), World(0, 1, 1, 2)]
