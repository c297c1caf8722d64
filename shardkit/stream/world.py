"""Where this process sits: distributed rank and DataLoader worker. The only module that asks.

Everything else in the streaming pipeline receives a ``World`` and does plain arithmetic on it, so
splitting can be tested by simulating ranks and workers in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InputError

__all__ = [
    "World",
    "WorkerCounter",
    "current_world",
    "dataloader_worker",
    "distributed_rank",
    "worker_slot",
]


@dataclass(frozen=True, slots=True)
class World:
    """Rank ``rank`` of ``world_size``, DataLoader worker ``worker`` of ``num_workers``.

    A process that is not a DataLoader worker (``num_workers=0``) is worker 0 of 1.
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1


def distributed_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit, else torch.distributed, else RANK/WORLD_SIZE, else (0, 1).

    Explicit values exist so tests and odd launchers can simulate a world without processes.
    torch.distributed wins over the environment because it is what the training loop synchronises
    on; the environment is what torchrun sets before the process group exists.
    """
    if rank is None or world_size is None:
        dist_rank, dist_size = _discover()
        rank = dist_rank if rank is None else rank
        world_size = dist_size if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise InputError(
            f"rank {rank} is not within world size {world_size}: pass 0 <= rank < world_size"
        )
    return rank, world_size


def _discover() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    env_rank, env_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_size is not None:
        try:
            return int(env_rank), int(env_size)
        except ValueError:
            raise InputError(
                f"RANK={env_rank!r} / WORLD_SIZE={env_size!r} are not integers: fix the launcher "
                "environment or pass rank= and world_size= explicitly"
            ) from None
    return 0, 1


def worker_slot() -> tuple[int, int]:
    """(worker id, number of workers) of the current DataLoader worker, (0, 1) outside one."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return 0, 1
    return info.id, info.num_workers


def dataloader_worker() -> int | None:
    """The DataLoader worker id of this process; None in the main process (``num_workers=0``)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return None if info is None else info.id


class WorkerCounter:
    """A count that DataLoader workers add to and the main process reads, after or during a run.

    One shared-memory int64 slot per worker (the main process in slot 0), so every slot has a
    single writer and no increment is lost between processes; ``total`` sums the slots.
    """

    def __init__(self, slots: int = 257):
        import torch

        self.slots = torch.zeros(slots, dtype=torch.int64).share_memory_()

    def add(self, n: int = 1) -> None:
        worker = dataloader_worker()
        self.slots[(0 if worker is None else worker + 1) % len(self.slots)] += n

    def total(self) -> int:
        return int(self.slots.sum())


def current_world(rank: int, world_size: int) -> World:
    """The ``World`` of the calling process, given the rank fixed when the dataset was built."""
    worker, num_workers = worker_slot()
    return World(rank, world_size, worker, num_workers)
