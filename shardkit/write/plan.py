"""Plan, run, commit: a folder pack as shard tasks that any engine runs, byte-identical to one.

- ``plan_pack`` (the driver) lists SRC, shuffles, and fixes every shard's samples and final name
  from file sizes alone, before any image is read: the writers roll by size only
  (``ShardFormat.sizer``), so the plan is a function of the listing, the options and the seed.
- ``run_task`` (any process on any machine that sees SRC and OUT) writes its planned shards
  under temporary names in the job folder, renames each when complete and returns a
  ``ShardReceipt`` (also written beside it). Run twice, it writes the same bytes under the same
  names: a retried, duplicated or speculative task is harmless.
- ``commit_pack`` (the driver) refuses unless the receipts cover every shard exactly once,
  builds the manifest ``pack`` writes and publishes it with the commit journal, manifest last.

``pack`` on one machine runs the whole plan as one task in-process (reader threads), and
``--engine`` runs it as many tasks elsewhere: same planner, same bytes, by construction. A
skipped (bad) file keeps its slot in the plan, so its shard ends a little smaller; with
``resize_short`` the plan budgets each image at its source size (``shard_size`` is then a
budget on source bytes). The job folder ``OUT/.partial-job-<plan>/`` holds finished shards and
their receipts (``shard-NNNNNN.json``): a re-run of the same plan skips shards whose receipt and
file size agree, so a killed job resumes; another plan (other files, other options) never reads
them, and its commit removes them. Nothing here imports an engine.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from ..errors import InputError, OutputError
from ..formats import get_format
from ..formats.sample_index import ensure_indexes, index_path
from ..fsutil import (
    JOB_MARK,
    JOURNAL_NAME,
    STAGING_PREFIX,
    atomic_write_bytes,
    fsync_dir,
    interrupted_commit,
    open_regular,
    publish,
    temp_name,
    write_error,
)
from ..images.decode import RESIZE_QUALITY
from ..manifest import MANIFEST_NAME, Manifest, ShardEntry, SkippedFile, write_manifest
from ..scan import (
    SourceScan,
    check_source_dir,
    field_files,
    inline_fields,
    is_table,
    repeats,
    scan_source,
)
from .read import (
    FINGERPRINT_FIELD,
    READ_AHEAD,
    READ_BATCH,
    Ahead,
    PackWarning,
    SourceStats,
    check_sample,
    fingerprint,
    ordered_map,
    pack_options,
    pack_version,
    read_fields,
    read_file,
    source_stats,
    stat_pair,
)
from .writer import ShardSizeWarning, next_shard_number, shard_name

__all__ = [
    "APPENDED_FIELD",
    "load_task",
    "save_tasks",
    "JOB_PREFIX",
    "CommitResult",
    "PackPlan",
    "PlanTasks",
    "ShardReceipt",
    "ShardTask",
    "commit_pack",
    "plan_pack",
    "run_task",
]

#: The manifest's ``pack`` key listing, per ``--append``, how the shards it added were packed.
APPENDED_FIELD = "appended"
#: A job folder inside OUT: ``.partial-job-<first 16 hex digits of the plan's fingerprint>``.
JOB_PREFIX = STAGING_PREFIX + JOB_MARK


@dataclass(frozen=True)
class ShardReceipt:
    """One finished shard, as ``run_task`` returns it and writes it beside the shard: plain
    data (it crosses processes, engines and JSON files), never pickled to disk."""

    shard: int
    path: str
    samples: int
    bytes: int
    sha256: str
    index: tuple[int, ...] = ()
    #: ``(path under SRC, reason)`` of each file of this shard that could not be packed.
    skipped: tuple[tuple[str, str], ...] = ()
    #: ``(field name, samples of this shard carrying it)``, for the manifest's ``fields``.
    fields: tuple[tuple[str, int], ...] = ()
    #: The sha256 of the shard's sample index ("": none; the commit checks or builds it).
    index_sha256: str = ""

    def to_json(self) -> bytes:
        doc = {
            "shard": self.shard,
            "path": self.path,
            "samples": self.samples,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "index": list(self.index),
            "skipped": [list(s) for s in self.skipped],
        }
        if self.fields:
            doc["fields"] = [list(f) for f in self.fields]
        if self.index_sha256:
            doc["index_sha256"] = self.index_sha256
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, text: bytes) -> ShardReceipt:
        d = json.loads(text)
        return cls(
            int(d["shard"]),
            str(d["path"]),
            int(d["samples"]),
            int(d["bytes"]),
            str(d["sha256"]),
            tuple(int(x) for x in d["index"]),
            tuple((str(p), str(r)) for p, r in d["skipped"]),
            tuple((str(n), int(c)) for n, c in d.get("fields", ())),
            str(d.get("index_sha256", "")),
        )

    def entry(self):
        """This shard's manifest entry."""
        return ShardEntry(
            self.path, self.samples, self.bytes, self.sha256, self.index, self.index_sha256
        )


@dataclass
class ShardTask:
    """Consecutive planned shards and everything a worker needs to write them (no driver state).

    Shard ``first + k`` holds the samples ``order[starts[k]:starts[k + 1]]``, each an index into
    ``files``/``keys``/``exts``/``labels``. The task of a whole plan shares the scan's tables;
    a task sent to another process carries only its own samples, as ``StrTable``s (arrays:
    a plan of many tasks holds no Python string per sample, and pickles small).
    """

    job: str
    root: str
    format: str
    validate: str
    resize_short: int | None
    on_error: str
    first: int
    starts: tuple[int, ...]
    order: np.ndarray
    files: Sequence[str]
    keys: Sequence[str]
    exts: Sequence[str]
    labels: np.ndarray
    #: Per sample: its field files (``SourceScan.sidecars`` form) and a table row's fields
    #: (``SourceScan.inline`` form); empty sequences: no sample has any.
    sidecars: Sequence[str] = ()
    inline: Sequence[str] = ()

    @property
    def shards(self) -> range:
        return range(self.first, self.first + len(self.starts) - 1)

    def to_dict(self) -> dict:
        """Plain JSON (a plan file for batch schedulers such as SLURM arrays; never pickle)."""
        n = len(self.order)
        pick = self.order.tolist() if n else []
        return {
            "job": self.job,
            "root": self.root,
            "format": self.format,
            "validate": self.validate,
            "resize_short": self.resize_short,
            "on_error": self.on_error,
            "first": self.first,
            "starts": list(self.starts),
            "files": [self.files[i] for i in pick],
            "keys": [self.keys[i] for i in pick],
            "exts": [self.exts[i] for i in pick],
            "labels": [int(self.labels[i]) for i in pick],
            **({"sidecars": [self.sidecars[i] for i in pick]} if len(self.sidecars) else {}),
            **({"inline": [self.inline[i] for i in pick]} if len(self.inline) else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ShardTask:
        return cls(
            job=str(d["job"]),
            root=str(d["root"]),
            format=str(d["format"]),
            validate=str(d["validate"]),
            resize_short=d["resize_short"],
            on_error=str(d["on_error"]),
            first=int(d["first"]),
            starts=tuple(int(x) for x in d["starts"]),
            order=np.arange(len(d["files"])),
            files=list(d["files"]),
            keys=list(d["keys"]),
            exts=list(d["exts"]),
            labels=np.array(d["labels"], dtype=np.int64),
            sidecars=list(d.get("sidecars", ())),
            inline=list(d.get("inline", ())),
        )

    def __repr__(self) -> str:
        return f"ShardTask(shards {self.first}..{self.shards.stop - 1}, {len(self.order)} samples)"


@dataclass
class PackPlan:
    """Every shard's samples and final name, fixed before any image is read."""

    src: str
    out: str
    options: dict
    #: ``sha256:...`` of the options and the listing (paths, sizes, mtimes): names the job.
    fingerprint: str
    scan: SourceScan
    order: np.ndarray
    #: Shard ``i`` is ``order[starts[i]:starts[i + 1]]``.
    starts: np.ndarray
    pack_info: dict = field(default_factory=dict)
    #: Set by ``appending``: the number of the plan's first shard, the dataset's classes (the
    #: old ones, then the source's new ones) and each scan label's index among them.
    first: int = 0
    classes: list[str] | None = None
    label_map: np.ndarray | None = None
    #: The dataset this plan appends to (None: a fresh pack).
    base: Manifest | None = None
    #: Samples left out as duplicates (``plan_pack``): table rows naming an image again
    #: (listed in ``skipped``), and the number whose key the dataset appended to already holds.
    repeated: list[SkippedFile] = field(default_factory=list)
    already_there: int = 0

    @property
    def num_shards(self) -> int:
        return len(self.starts) - 1

    @property
    def job(self) -> str:
        """The job folder (absolute: workers may run elsewhere in the tree)."""
        key = self.fingerprint
        if self.base is not None:  # an append's shards are numbered after the dataset's
            doc = [key, self.first, self.classes, len(self.order)]
            key = hashlib.sha256(json.dumps(doc).encode()).hexdigest()
        digest = key.split(":", 1)[-1][:16]
        return os.path.join(os.path.abspath(self.out), JOB_PREFIX + digest)

    def appending(self, base: Manifest) -> PackPlan:
        """This plan numbered and labelled to follow the dataset ``base`` describes."""
        old = list(base.classes)
        self.classes = old + [c for c in self.scan.classes if c not in old]
        self.label_map = np.array([self.classes.index(c) for c in self.scan.classes], np.int64)
        self.first = next_shard_number(self.out, [s.path for s in base.shards])
        self.base = base
        return self

    def _labels(self, rows) -> np.ndarray:
        """The scan's labels (of ``rows``), as the dataset's: -1 ("no label") stays -1."""
        labels = self.scan.labels if rows is None else self.scan.labels[rows]
        if self.label_map is None:
            return labels
        mapped = np.append(self.label_map, -1)  # index -1 reads the appended -1
        return mapped[labels]

    def _task(self, lo: int, hi: int, whole: bool) -> ShardTask:
        a, b = int(self.starts[lo]), int(self.starts[hi])
        scan, o = self.scan, self.options
        sidecars = scan.sidecars if scan.sidecars.blob.size else ()
        inline = scan.inline if scan.inline.blob.size else ()
        if whole:
            order, files, keys, exts = self.order, scan.files, scan.keys, scan.exts
            labels = self._labels(None)
        else:
            pos = self.order[a:b]  # a task's own rows, as tables: no str per sample
            files, keys, exts = (t.take(pos) for t in (scan.files, scan.keys, scan.exts))
            sidecars = sidecars.take(pos) if len(sidecars) else ()
            inline = inline.take(pos) if len(inline) else ()
            labels = self._labels(self.order[a:b])
            order = np.arange(b - a)
        return ShardTask(
            job=self.job,
            root=os.path.abspath(scan.root),
            format=o["format"],
            validate=o["validate"],
            resize_short=o["resize_short"],
            on_error=o["on_error"],
            first=self.first + lo,
            starts=tuple(int(s) - (0 if whole else a) for s in self.starts[lo : hi + 1]),
            order=order,
            files=files,
            keys=keys,
            exts=exts,
            labels=labels,
            sidecars=sidecars,
            inline=inline,
        )

    def whole(self) -> ShardTask:
        """The whole plan as one task, sharing the scan's tables: ``pack`` on one machine."""
        return self._task(0, self.num_shards, True)

    def tasks(self, shards_per_task: int = 1) -> Sequence[ShardTask]:
        """Tasks of ``shards_per_task`` consecutive shards each, self-contained for any engine;
        each is made when a runner takes it (``PlanTasks``), so the driver holds the plan's
        arrays and the tasks in flight, not a second copy of every row."""
        k = int(shards_per_task)
        if k < 1:
            raise InputError(f"invalid shards_per_task={shards_per_task!r}; use 1 or more")
        return PlanTasks(self, k)


class PlanTasks(Sequence[ShardTask]):
    """A plan's tasks as a sequence whose items are made on access from the plan's arrays."""

    def __init__(self, plan: PackPlan, per_task: int):
        self.plan, self.per_task = plan, per_task

    def __len__(self) -> int:
        return -(-self.plan.num_shards // self.per_task)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        lo = i * self.per_task
        return self.plan._task(lo, min(lo + self.per_task, self.plan.num_shards), False)


# --- plan --------------------------------------------------------------------------------------


def plan_pack(
    src: str,
    out: str,
    *,
    shard_size,
    format: str,
    shuffle: bool,
    seed: int,
    validate: str,
    resize_short: int | None,
    on_error: str,
    progress: bool = False,
    root: str | None = None,
    existing: Callable[[Sequence[str]], np.ndarray] | None = None,
    allow_duplicates: bool = False,
    engine=None,
) -> PackPlan:
    """Scan ``src``, shuffle, ``stat`` each file, and roll shards by the format's size rule.

    ``root``: a table source's root (``shardkit.scan.scan_table``). Unless
    ``allow_duplicates``, samples whose key the dataset an append adds to holds (``existing``:
    a bool per key given, ``keys.found_in``) and table rows naming an image an earlier row
    named are left out.
    ``engine``: a runner whose ``map_chunks`` runs the ``stat`` calls (``source_stats``)."""
    check_source_dir(src)
    options = pack_options(format, shard_size, shuffle, seed, validate, resize_short, on_error)
    if root is not None:  # a table's; folder packs keep their fingerprints
        options["root"] = root = os.path.abspath(root)
    if allow_duplicates:  # other packs keep their fingerprints
        options["allow_duplicates"] = True
    scan = scan_source(src, progress=progress, root=root)
    if scan.errors and on_error == "raise":
        bad = scan.errors[0]
        where = bad.path if is_table(src) else os.path.join(src, bad.path)  # rows name the table
        raise InputError(f'{where}: {bad.reason}; remove or fix it, or pass on_error="skip"')
    for cls in scan.empty_classes:
        warnings.warn(
            f"class folder {os.path.join(src, cls)!r} has no images; it keeps its label so labels "
            "match the sorted folder list",
            PackWarning,
            stacklevel=4,  # the caller of pack()
        )
    if scan.outside_links:
        warnings.warn(
            f"{scan.outside_links} symbolic link(s) under {src!r} lead outside it; their targets "
            "were packed like files of the source (see pack.links_outside_source in the manifest)",
            PackWarning,
            stacklevel=4,  # the caller of pack()
        )
    n = len(scan.files)
    if n == 0:
        first = scan.errors[0] if scan.errors else SkippedFile("-", "the source is empty")
        raise InputError(
            f"source {src}: none of its {len(scan.errors)} images could be packed "
            f"(first: {first.path}: {first.reason}); see validate= and on_error="
        )
    stats = source_stats(scan, engine)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    repeated, already, dropped = [], 0, None
    if not allow_duplicates:
        repeated, already, dropped = _duplicates(src, scan, existing)
    if dropped is not None:
        order = order[~dropped[order]]
    starts = _roll(scan, stats, order, options["format"], options["shard_size"])
    fp = fingerprint(scan, stats, options)
    info = {
        "source": src,
        "shard_size": options["shard_size"],
        "shuffle": bool(shuffle),
        "seed": int(seed),
        "validate": validate,
        "resize_short": resize_short,
        "resize_quality": RESIZE_QUALITY if resize_short else None,
        "format": options["format"],
        "on_error": on_error,
        "shardkit_version": pack_version(),
        "non_image_files": dict(sorted(scan.non_image_exts.items())),
        "links_outside_source": scan.outside_links,
        FINGERPRINT_FIELD: fp,
    }
    if already:
        info["already_in_dataset"] = already
    plan = PackPlan(src, os.fspath(out), options, fp, scan, order, starts, info)
    plan.repeated, plan.already_there = repeated, already
    return plan


def _duplicates(src: str, scan: SourceScan, existing):
    """``(rows naming an image again, count of keys in existing, mask of both or None)``.

    A table may list one image on several rows; packing each would store it under several
    keys, which a split by key could place on both sides (train and val): the first row wins.
    """
    dropped = repeats(scan.files) if is_table(src) else np.zeros(len(scan.files), dtype=bool)
    why = f"{src}: listed on more than one row; packed once, from its first row"
    why += " (allow_duplicates=True keeps each)"
    repeated = [SkippedFile(scan.files[i], why) for i in np.flatnonzero(dropped).tolist()]
    already = 0
    if existing is not None and len(scan.keys):
        there = np.asarray(existing(scan.keys), dtype=bool) & ~dropped
        already = int(there.sum())
        dropped |= there
    return repeated, already, dropped if dropped.any() else None


#: Samples the planner handles at a time (their sizes as Python ints, their fields' sizes).
PLAN_BLOCK = 1 << 16


def _roll(scan: SourceScan, stats: SourceStats, order: np.ndarray, fmt: str, limit: int):
    """Shard starts in ``order``: a shard closes when the next sample would pass ``limit``
    (a sample bigger than ``limit`` gets a shard of its own), as ``ShardWriter`` rolls; fields
    count with their names and sizes (``stats.fields``). ``PLAN_BLOCK`` samples at a time: only
    one block's sizes are ever Python objects."""
    new = get_format(fmt).sizer
    key_lens, ext_lens = np.diff(scan.keys.offsets), np.diff(scan.exts.offsets)
    starts, sizer, single, sizes = [0], new(), 0, stats.files[:, 0]
    for lo in range(0, len(order), PLAN_BLOCK):
        block = order[lo : lo + PLAN_BLOCK]
        extras = _field_sizes(scan, stats, block.tolist())
        klen, elen = key_lens[block].tolist(), ext_lens[block].tolist()
        nbytes = np.maximum(sizes[block], 0).tolist()
        for j, (k, e, b, extra) in enumerate(zip(klen, elen, nbytes, extras, strict=True)):
            if sizer.samples and sizer.projected_size(k, e, b, extra) > limit:
                single = single + 1 if sizer.samples == 1 else 0
                if single == 2:
                    warnings.warn(
                        f"shard_size={limit} bytes holds one sample per shard (the last one "
                        f"closed at one sample when the next, {b} bytes, did not fit): every "
                        "sample becomes its own shard; use a shard size of at least ~100 "
                        "samples, e.g. 64MB",
                        ShardSizeWarning,
                        stacklevel=5,  # the caller of pack()
                    )
                starts.append(lo + j)
                sizer = new()
            sizer.add(k, e, b, extra)
    starts.append(len(order))
    return np.array(starts, dtype=np.int64)


def _field_sizes(scan: SourceScan, stats: SourceStats, rows: list[int]) -> list:
    """Per sample of ``rows``: ``(name bytes, value bytes)`` of each of its fields, as they will
    be stored (``()``: none)."""
    inline, side = bool(scan.inline.blob.size), bool(scan.sidecars.blob.size)
    if not side and not inline:
        return [()] * len(rows)
    out = []
    for i in rows:
        sizes = []
        if side and scan.sidecars[i]:
            names = [n for n, _ in scan.fields_of(i)]
            got = stats.of_fields(i)
            sizes = [(len(n), max(st[0], 0)) for n, st in zip(names, got, strict=True)]
        if inline:
            sizes += [(len(n), len(v)) for n, v in scan.inline_fields(i).items()]
        out.append(sizes or ())
    return out


# --- run ---------------------------------------------------------------------------------------


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
        )
        atomic_write_bytes(_receipt_path(task.job, cur.shard), receipt.to_json())
    except OSError as exc:
        cur.writer.abort()
        raise write_error(os.path.dirname(task.job), exc, "shards") from None
    if on_shard is not None and stats.samples:
        on_shard(final)
    return receipt


# --- commit ------------------------------------------------------------------------------------


@dataclass
class CommitResult:
    """What ``commit_pack`` published."""

    manifest_path: str
    manifest: Manifest
    #: Files the tasks could not pack (bad or unreadable images), beside the scan's errors.
    task_skipped: list[SkippedFile]


def check_receipts(plan: PackPlan, receipts: Iterable[ShardReceipt]) -> list[ShardReceipt]:
    """The receipts in shard order, exactly one per planned shard; else an ``OutputError``."""
    by: dict[int, ShardReceipt] = {}
    twice: set[int] = set()
    for r in receipts:
        if r.shard in by:
            twice.add(r.shard)
        by[r.shard] = r
    n, first = plan.num_shards, plan.first
    missing = [i for i in range(first, first + n) if i not in by]
    unknown = sorted(i for i in by if not first <= i < first + n)
    if missing or twice or unknown:
        what = "; ".join(
            f"{label} {_ranges(ids)}"
            for label, ids in (
                ("no receipt for shard(s)", missing),
                ("more than one receipt for shard(s)", sorted(twice)),
                ("receipt(s) for shard(s) the plan does not have", unknown),
            )
            if ids
        )
        raise OutputError(
            f"cannot commit {plan.out!r}: the plan has {n} shard(s) and {what}; run the missing "
            "tasks (or pack again with the same options, which resumes) and commit each shard once"
        )
    return [by[i] for i in range(first, first + n)]


def _ranges(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:8])
    return shown + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


def commit_pack(
    plan: PackPlan, receipts: Iterable[ShardReceipt], *, replaced: Sequence[str] = ()
) -> CommitResult:
    """Publish the job's shards and the manifest ``pack`` writes, all or nothing, manifest last.

    The caller holds OUT's lock (``writer.open_local_output``); ``replaced`` are the old
    dataset's shards, deleted by the commit. Other plans' job folders are removed afterwards.
    """
    ordered = check_receipts(plan, receipts)
    scan = plan.scan
    task_skipped = [SkippedFile(p, why) for r in ordered for p, why in r.skipped]
    entries = []
    for r in ordered:
        if not r.samples:
            continue
        if stat_pair(os.path.join(plan.job, r.path))[0] != r.bytes:
            raise OutputError(
                f"cannot commit {plan.out!r}: {os.path.join(plan.job, r.path)} is missing or not "
                f"the {r.bytes} bytes its receipt says; pack again with the same options, which "
                "rewrites it"
            )
        entries.append(r.entry())
    try:  # the indexes checked (or built) now: the manifest lists their sha256
        entries = ensure_indexes(plan.job, entries)
    except OSError as exc:
        raise write_error(plan.out, exc, "the sample indexes") from None
    if not entries:
        skipped = list(scan.errors) + task_skipped
        first = skipped[0]
        raise InputError(
            f"source {plan.src}: none of its {len(scan.files) + len(scan.errors)} images could "
            f"be packed (first: {first.path}: {first.reason}); see validate= and on_error="
        )
    skipped = list(scan.errors) + task_skipped + list(scan.ignored) + plan.repeated
    fields: dict[str, int] = {}
    for r in ordered:
        for name, count in r.fields:
            fields[name] = fields.get(name, 0) + count
    manifest = Manifest(
        shard_format=plan.options["format"],
        classes=list(scan.classes),
        shards=entries,
        skipped=sorted(skipped, key=lambda s: s.path),
        pack=dict(plan.pack_info),
        fields=fields,
    )
    if plan.base is not None:  # the old entries as they are, then the new shards
        base = plan.base
        manifest = Manifest(
            shard_format=base.shard_format,
            classes=list(plan.classes or ()),
            shards=list(base.shards) + entries,
            skipped=list(base.skipped) + sorted(skipped, key=lambda s: s.path),
            pack={
                **base.pack,
                APPENDED_FIELD: [*base.pack.get(APPENDED_FIELD, []), plan.pack_info],
            },
            fields={n: base.fields.get(n, 0) + fields.get(n, 0) for n in {*base.fields, *fields}},
        )
    out = plan.out
    try:
        write_manifest(manifest, plan.job)
    except OSError as exc:
        raise write_error(out, exc, MANIFEST_NAME) from None
    try:
        path = publish(out, plan.job, [e.path for e in entries], MANIFEST_NAME, remove=replaced)
    except OSError as exc:
        if interrupted_commit(out) is not None:
            raise OutputError(
                f"cannot finish the commit in {out!r}: {exc.strerror or exc}; packing into it "
                "again completes it"
            ) from None
        raise write_error(out, exc, f"the commit journal {JOURNAL_NAME}") from None
    remove_other_jobs(out)
    return CommitResult(path, manifest, task_skipped)


def check_cluster_lock(out: str, mounts: str = "/proc/self/mounts") -> None:
    """Refuse an ``out`` on a FUSE mount (s3fs, gcsfuse ...) for a pack on several machines:
    its ``flock`` (one writer per output) holds on one machine only, so two drivers could
    commit into it at once. ``mounts``: the mount table to read (Linux's)."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            table = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return
    real = os.path.realpath(out)
    best, fstype = "", ""
    for point, kind in table:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, fstype = point, kind
    if fstype.startswith("fuse"):
        raise OutputError(
            f"output {out!r} is on a {fstype} mount ({best}), whose file lock holds on this "
            "machine only; an engine across machines needs a filesystem with cluster-wide "
            "flock (NFSv4, Lustre with -o flock), or leave out --engine"
        )


# --- plan files: batch schedulers ---------------------------------------------------------------

PLAN_FORMAT = "shardkit-pack-plan"


def save_tasks(tasks: Sequence[ShardTask], path: str, command: str) -> None:
    """Write ``tasks`` as a JSON plan file (atomically); ``command`` commits once they are done."""
    doc = {
        "format": PLAN_FORMAT,
        "version": 1,
        "commit": command,
        "tasks": [t.to_dict() for t in tasks],
    }
    try:
        atomic_write_bytes(path, json.dumps(doc).encode())
    except OSError as exc:
        raise write_error(os.path.dirname(path) or ".", exc, os.path.basename(path)) from None


def load_task(path: str, index: int) -> tuple[ShardTask, int]:
    """Task ``index`` of the plan file at ``path``, and how many tasks it holds."""
    try:
        with open_regular(path) as f:
            doc = json.load(f)
        if doc.get("format") != PLAN_FORMAT or doc.get("version") != 1:
            raise ValueError("not a shardkit plan file")
        tasks = doc["tasks"]
        if not 0 <= index < len(tasks):
            raise InputError(f"{path}: no task {index}; it holds tasks 0..{len(tasks) - 1}")
        task = ShardTask.from_dict(tasks[index])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(
            f"{path}: not a readable shardkit plan ({exc}); make one with `shardkit pack SRC OUT "
            "--plan-only PLAN`"
        ) from None
    why = _outside(task)
    if why is not None:
        raise InputError(
            f"{path}: task {index} {why}, which a plan shardkit wrote never does (the file was "
            "edited); nothing was read or written: make the plan again with `shardkit pack SRC "
            "OUT --plan-only PLAN`"
        )
    return task, len(tasks)


def _outside(task: ShardTask) -> str | None:
    """What in ``task`` would read outside its source root or write outside its job folder."""
    name = os.path.basename(task.job)
    if (
        not os.path.isabs(task.job)
        or os.path.normpath(task.job) != task.job
        or not os.path.isdir(os.path.dirname(task.job))  # OUT, made by --plan-only
        or not os.path.isabs(task.root)
        or not re.fullmatch(re.escape(JOB_PREFIX) + "[0-9a-f]{16}", name)
        or "\x00" in task.job + task.root
    ):
        return f"writes into {task.job!r}, not a job folder OUT/{JOB_PREFIX}<hex>"
    if (
        task.first < 0
        or not task.starts
        or task.starts[0] != 0
        or list(task.starts) != sorted(task.starts)
        or task.starts[-1] > len(task.files)
    ):
        return "numbers its shards or samples out of order"
    for rel, side in itertools.zip_longest(task.files, task.sidecars, fillvalue=""):
        if _climbs(rel) or "\x00" in side:  # field files: suffixes of rel, in its folder
            return f"reads {rel!r}, outside its source root {task.root!r}"
    return None


def _climbs(rel: str) -> bool:
    return not rel or rel.startswith("/") or "\x00" in rel or ".." in rel.split("/")


def remove_other_jobs(out: str, keep: str = "") -> None:
    """Job folders of other plans in ``out`` (their receipts can never be used): removed.
    The caller holds ``out``'s lock, so no job is running there."""
    for name in os.listdir(out):
        if name.startswith(JOB_PREFIX) and name != keep:
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
