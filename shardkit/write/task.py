"""Run a task of a pack's plan: write its shards into the job folder, a receipt beside each.

``run_task`` is what any engine calls, in any process on any machine that sees SRC and OUT
(``write.plan`` has the plan and the types, ``write.commit`` publishes the receipts): reader
threads load and check each sample, the calling thread writes one shard at a time under a
temporary name and renames it when complete. A shard whose receipt and file size agree is kept,
so a repeated or resumed task writes nothing twice.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice

from ..errors import InputError
from ..formats import get_format
from ..formats.sample_index import index_path
from ..fsutil import atomic_write_bytes, fsync_dir, open_regular, temp_name, write_error
from ..scan import field_files, inline_fields
from .plan import ShardReceipt, ShardTask
from .read import (
    READ_AHEAD,
    READ_BATCH,
    Ahead,
    check_sample,
    ordered_map,
    read_fields,
    read_file,
    stat_pair,
)
from .writer import shard_name

__all__ = ["done_receipt", "run_task"]


def _receipt_path(job: str, shard: int) -> str:
    return os.path.join(job, shard_name(shard, ".json"))


def done_receipt(job: str, shard: int) -> ShardReceipt | None:
    """The receipt of ``shard`` in ``job`` if its shard is there at the size it records."""
    try:
        with open_regular(_receipt_path(job, shard)) as f:
            receipt = ShardReceipt.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if receipt.shard != shard:
        return None
    if receipt.samples and stat_pair(os.path.join(job, receipt.path))[0] != receipt.bytes:
        return None
    return receipt


def _loader(task: ShardTask) -> Callable:
    """The reader-thread function: ``(k, batch, ahead, hint_own)`` -> ``(k, loaded samples)``;
    hinting ``ahead`` (the batch this thread likely reads next) overlaps its reads with these."""
    root, files, exts, keys, labels = task.root, task.files, task.exts, task.keys, task.labels
    validate, resize = task.validate, task.resize_short
    sidecars, inline = task.sidecars, task.inline

    def load(item: tuple) -> tuple[int, list]:
        k, batch, ahead, hint_own = item
        if hint_own:
            load.ahead.hint(root, files, batch)
        load.ahead.hint(root, files, ahead)
        out = []
        for i in batch:
            ext, key, label = exts[i], keys[i], int(labels[i])
            try:
                data, _ = read_file(os.path.join(root, files[i]), load.ahead.take(i))
            except OSError as exc:
                out.append((i, key, None, ext, f"unreadable: {exc.strerror or exc}", label, None))
                continue
            checked = check_sample(data, ext, validate, resize)
            fields, why = None, None
            if len(sidecars) and sidecars[i]:
                fields, why = read_fields(root, field_files(files[i], sidecars[i]), validate)
            if len(inline) and inline[i]:
                fields = {**(fields or {}), **inline_fields(inline[i])}
            if why is not None and checked[2] is None:
                checked = (None, ext, why)
            out.append((i, key, *checked, label, fields))
        return k, out

    load.ahead = Ahead()
    return load


def _batches(task: ShardTask, todo: list[int], threads: int) -> Iterator[tuple]:
    """Read batches of the shards ``todo`` in order; each names the batch its thread reads next.

    Sliced from the numpy order as they are needed: no Python list of every sample."""

    def plain() -> Iterator[tuple[int, list]]:
        for k in todo:
            lo, hi = task.starts[k], task.starts[k + 1]
            for a in range(lo, hi, READ_BATCH):
                yield k, task.order[a : min(a + READ_BATCH, hi)].tolist()

    window: deque = deque()
    it = plain()
    window.extend(islice(it, threads + 1))
    j = 0
    while window:
        k, batch = window.popleft()
        ahead = window[threads - 1][1] if len(window) >= threads else []
        yield k, batch, ahead, j < threads
        window.extend(islice(it, 1))
        j += 1


def run_task(
    task: ShardTask,
    threads: int = 1,
    *,
    on_shard: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[ShardReceipt]:
    """Write ``task``'s shards into its job folder; a receipt per shard, in shard order.

    Shards already there with a matching receipt are kept (a resumed or repeated task);
    each other shard is written under a temporary name, renamed when complete, then its receipt
    written. ``threads`` read (the calling thread writes); ``on_shard(path)`` is called as each
    shard is complete; ``progress(n)`` as ``n`` more samples are read.
    """
    out = os.path.dirname(task.job)
    try:
        os.makedirs(task.job, exist_ok=True)
    except OSError as exc:
        raise write_error(out, exc, "the job folder") from None
    receipts: dict[int, ShardReceipt] = {}
    todo = []
    for k, shard in enumerate(task.shards):
        old = done_receipt(task.job, shard)
        if old is None:
            todo.append(k)
            continue
        receipts[shard] = old
        if progress is not None:
            progress(task.starts[k + 1] - task.starts[k])
        if on_shard is not None and old.samples:
            on_shard(os.path.join(task.job, old.path))
    _write_shards(task, todo, threads, receipts, on_shard, progress)
    return [receipts[s] for s in task.shards]


def _write_shards(
    task: ShardTask, todo: list[int], threads: int, receipts: dict, on_shard, progress
):
    """Read the ``todo`` shards' samples on ``threads`` and write them, one shard at a time."""
    fmt = get_format(task.format)
    out = os.path.dirname(task.job)
    load = _loader(task)
    cur: _Open | None = None
    try:
        batches = _batches(task, todo, threads)
        for k, loaded in ordered_map(load, batches, threads, READ_AHEAD * threads):
            if cur is None or cur.k != k:
                if cur is not None:
                    receipts[cur.shard] = _finish(task, cur, on_shard)
                cur = _Open(task, k, fmt)
            for i, key, data, ext, reason, label, fields in loaded:
                if data is None:
                    if task.on_error == "raise":
                        raise InputError(
                            f"{os.path.join(task.root, task.files[i])}: {reason}; remove or fix "
                            'it, or pass on_error="skip"'
                        )
                    cur.skipped.append((task.files[i], reason))
                    continue
                try:
                    cur.writer.add(key, ext, data, label, tuple(fields.items()) if fields else ())
                except OSError as exc:
                    raise write_error(out, exc, "shards") from None
                for name in fields or ():
                    cur.fields[name] = cur.fields.get(name, 0) + 1
            if progress is not None:
                progress(len(loaded))
        if cur is not None:
            receipts[cur.shard] = _finish(task, cur, on_shard)
            cur = None
    finally:
        if cur is not None:
            cur.writer.abort()
        load.ahead.close()


class _Open:
    """The shard being written: its writer on a temporary name, and the files it skipped."""

    def __init__(self, task: ShardTask, k: int, fmt):
        self.k, self.shard = k, task.first + k
        self.name = shard_name(self.shard, fmt.suffix)
        self.tmp = temp_name(os.path.join(task.job, self.name))
        self.skipped: list[tuple[str, str]] = []
        self.fields: dict[str, int] = {}
        try:
            self.writer = fmt.open_writer(self.tmp)
        except OSError as exc:
            raise write_error(os.path.dirname(task.job), exc, "shards") from None


def _finish(task: ShardTask, cur: _Open, on_shard) -> ShardReceipt:
    """Close, rename and record one shard; a shard whose every file was skipped is not kept."""
    try:
        stats = cur.writer.close()
        final = os.path.join(task.job, cur.name)
        if stats.samples:
            if os.path.exists(index_path(cur.tmp)):  # the index first: a kept shard has one
                os.replace(index_path(cur.tmp), index_path(final))
            os.replace(cur.tmp, final)
            fsync_dir(task.job)
        else:
            os.unlink(cur.tmp)
        receipt = ShardReceipt(
            cur.shard,
            cur.name,
            stats.samples,
            stats.bytes if stats.samples else 0,
            stats.sha256,
            tuple(stats.index),
            tuple(cur.skipped),
            tuple(sorted(cur.fields.items())),
            stats.index_sha256,
            stats.columns_sha256,
        )
        atomic_write_bytes(_receipt_path(task.job, cur.shard), receipt.to_json())
    except OSError as exc:
        cur.writer.abort()
        raise write_error(os.path.dirname(task.job), exc, "shards") from None
    if on_shard is not None and stats.samples:
        on_shard(final)
    return receipt
