"""Pack a folder on a Ray cluster: the plan's shard tasks as Ray tasks, one commit on the driver.

    from shardkit.integrations.ray import pack
    pack("/shared/imagenet21k", "/shared/shards/in21k", shard_size="256MB", address="auto")

Ray core only (``pip install 'shardkit[ray]'``): tasks are plain functions, retried by Ray when
a worker or node dies (``max_retries``) or a task raises an ``OSError``/``StorageError``
(``retry_exceptions``). Each task's receipts come back through Ray's object store, so the
driver never lists the output; SRC and OUT must be the same paths on every node (a shared
filesystem whose ``flock`` is cluster-wide: NFSv4, Lustre with ``-o flock``; FUSE mounts such as
s3fs or gcsfuse are refused). Byte-identical to ``shardkit.pack`` on one machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import InputError, MissingExtraError, ShardkitError
from ..extras import require
from ..write.engines import PLAN_CHUNK, RETRYABLE, TaskFailed
from ..write.packer import PackReport
from ..write.packer import pack as _pack
from ..write.plan import ShardReceipt, ShardTask
from ..write.task import run_task

__all__ = ["RayRunner", "pack"]

T = TypeVar("T")


def _ray():
    try:
        import ray
    except ImportError:
        raise MissingExtraError(
            "--engine ray needs ray, which is not installed: pip install 'shardkit[ray]'"
        ) from None
    return ray


@dataclass
class RayRunner:
    """Runs tasks as Ray tasks on the cluster at ``address`` (None: a local one started for
    the pack and stopped after it; ``"auto"``: the running cluster this node belongs to).

    ``num_cpus`` caps a local cluster's CPUs; ``cpus_per_task`` is what each task reserves
    (raise it for fewer tasks at once); ``init`` passes more ``ray.init`` arguments.
    ``map_chunks`` runs the plan's per-file ``stat`` calls as Ray tasks too, ``plan_chunk``
    files each, retried as pack tasks are; a cluster started for the plan serves its tasks.
    """

    address: str | None = None
    retries: int = 3
    threads: int = 1
    num_cpus: int | None = None
    cpus_per_task: float = 1
    init: dict[str, Any] = field(default_factory=dict)
    fn: Callable[..., list[ShardReceipt]] = run_task
    plan_chunk: int = PLAN_CHUNK
    #: Whether this runner started the cluster it uses (then ``close`` stops it).
    _started: bool = field(default=False, init=False, repr=False)
    #: Tasks run on other machines: OUT's lock must hold across them (``pack`` checks).
    cluster = True

    def __post_init__(self):
        require("ray", "--engine ray")  # before the plan's scan, not after it
        v = self.plan_chunk
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"invalid plan_chunk={self.plan_chunk!r}; use 1 or more")

    def __call__(self, tasks: Sequence[ShardTask]) -> list[ShardReceipt]:
        try:
            done = self._run("a pack task", ((self.fn, t, self.threads) for t in tasks))
        finally:
            self.close()
        return [r for receipts in done for r in receipts]

    def map_chunks(self, fn: Callable[..., T], chunks: Sequence[tuple]) -> list[T]:
        """``[fn(*chunk) for chunk in chunks]`` as Ray tasks, in order; the cluster stays up
        for the pack's tasks (``close`` stops one this runner started)."""
        return self._run("a planning task", ((fn, *c) for c in chunks))

    def close(self) -> None:
        """Stop the local cluster this runner started, if it did."""
        if self._started:
            self._started = False
            _ray().shutdown()

    def _connect(self):
        ray = _ray()
        if not ray.is_initialized():
            kw: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "logging_level": logging.WARNING,
            }
            if self.address is None and self.num_cpus is not None:
                kw["num_cpus"] = self.num_cpus
            ray.init(address=self.address, **{**kw, **self.init})
            self._started = True
        return ray

    def _run(self, what: str, calls: Iterable[tuple]) -> list:
        """``call[0](*call[1:])`` for each call, as Ray tasks, results in order; failures as
        one-line errors. Two tasks per CPU of the cluster are in flight: the object store holds
        their arguments, not every task's (each task is made as it is submitted)."""
        ray = self._connect()
        remote = ray.remote(
            max_retries=self.retries,
            retry_exceptions=list(RETRYABLE),
            num_cpus=self.cpus_per_task,
        )(_call)
        cpus = ray.cluster_resources().get("CPU", 1)
        window = max(2, int(2 * cpus / max(self.cpus_per_task, 1e-3)))
        running: dict = {}  # ObjectRef -> the call's position
        results: dict[int, Any] = {}
        try:
            for i, c in enumerate(calls):
                if len(running) >= window:
                    _collect(ray, running, results)
                running[remote.remote(*c)] = i
            while running:
                _collect(ray, running, results)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ShardkitError):
                raise type(cause)(str(cause)) from None
            raise TaskFailed(
                f"{what} failed after {self.retries} retries ({type(cause).__name__}: "
                f"{cause}); pack again with the same options to resume"
            ) from None
        except ray.exceptions.RayError as exc:  # a worker or node died past its retries
            raise TaskFailed(
                f"{what}'s worker died {self.retries + 1} times ({type(exc).__name__}); "
                "pack again with the same options to resume"
            ) from None
        return [results[i] for i in range(len(results))]


def _collect(ray, running: dict, results: dict) -> None:
    """Wait for one of the ``running`` tasks at least; move what finished into ``results``."""
    done, _ = ray.wait(list(running), num_returns=1)
    for ref in done:
        results[running.pop(ref)] = ray.get(ref)


def _call(fn: Callable, *args):
    """The Ray task: ``fn(*args)`` (``ray.remote`` takes functions, not partials)."""
    return fn(*args)


def pack(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    address: str | None = None,
    shards_per_task: int = 1,
    retries: int = 3,
    num_cpus: int | None = None,
    **kwargs: Any,
) -> PackReport:
    """``shardkit.pack(src, out, **kwargs)`` with its shard tasks on Ray (see ``RayRunner``);
    ``shards_per_task`` consecutive shards make one Ray task."""
    runner = RayRunner(address, retries, kwargs.pop("workers", 1), num_cpus)
    return _pack(src, out, runner=runner, shards_per_task=shards_per_task, **kwargs)
