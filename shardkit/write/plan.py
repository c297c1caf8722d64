"""Plan, run, commit: a folder pack as shard tasks that any engine runs, byte-identical to one.

- ``plan_pack`` (the driver, this module) lists SRC, shuffles, and fixes every shard's samples
  and final name from file sizes alone, before any image is read: the writers roll by size only
  (``ShardFormat.sizer``), so the plan is a function of the listing, the options and the seed.
- ``run_task`` (``write.task``; any process on any machine that sees SRC and OUT) writes its
  planned shards under temporary names in the job folder, renames each when complete and
  returns a ``ShardReceipt`` (also written beside it). Run twice, it writes the same bytes under
  the same names: a retried, duplicated or speculative task is harmless.
- ``commit_pack`` (``write.commit``; the driver) refuses unless the receipts cover every shard
  exactly once, builds the manifest ``pack`` writes and publishes it with the commit journal,
  manifest last.

This module holds the types the three share (``ShardTask``, ``ShardReceipt``, ``PackPlan``), and
the planner (the plan files batch schedulers run tasks from: ``write.planfile``). ``pack`` on one
machine runs the whole plan as one task in-process (reader threads), and ``--engine`` runs it as
many tasks elsewhere: same planner, same bytes, by construction. A skipped (bad) file keeps its
slot in the plan, so its shard ends a little smaller; with ``resize_short`` the plan budgets each
image at its source size (``shard_size`` is then a budget on source bytes). The job folder
``OUT/.partial-job-<plan>/`` holds finished shards and their receipts (``shard-NNNNNN.json``): a
re-run of the same plan skips shards whose receipt and file size agree, so a killed job resumes;
another plan (other files, other options) never reads them, and its commit removes them. Nothing
here imports an engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from ..formats import get_format
from ..fsutil import JOB_MARK, STAGING_PREFIX
from ..images.decode import RESIZE_QUALITY
from ..manifest import Manifest, ShardEntry, SkippedFile
from ..scan import SourceScan, StrTable, check_source_dir, repeats, scan_source
from ..scan.pieces import pick, take
from ..scan.source import inline_fields
from ..scan.strings import forget
from ..urls import is_url
from .options import PackOptions
from .read import (
    FINGERPRINT_FIELD,
    PackWarning,
    SourceStats,
    fingerprint,
    pack_options,
    pack_version,
    source_stats,
)
from .writer import ShardSizeWarning, next_shard_number

__all__ = [
    "APPENDED_FIELD",
    "JOB_PREFIX",
    "PackPlan",
    "PlanTasks",
    "ShardReceipt",
    "ShardTask",
    "plan_pack",
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
    #: An LMDB shard's ``columns_sha256`` (its index record's front; "": none, a receipt
    #: written before it: the split then hashes that shard's keys).
    columns_sha256: str = ""

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
        if self.columns_sha256:
            doc["columns_sha256"] = self.columns_sha256
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
            str(d.get("columns_sha256", "")),
        )

    def entry(self):
        """This shard's manifest entry."""
        return ShardEntry(
            self.path,
            self.samples,
            self.bytes,
            self.sha256,
            self.index,
            self.index_sha256,
            self.columns_sha256,
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
        """Plain JSON, a row per list item: a task of the first plan-file version (still read;
        ``write.planfile`` writes arrays now)."""
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
        labels = self.scan.labels if rows is None else pick(self.scan.labels, rows)
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
            files, keys, exts = (take(t, pos) for t in (scan.files, scan.keys, scan.exts))
            sidecars = sidecars.take(pos) if len(sidecars) else ()
            inline = take(inline, pos) if len(inline) else ()
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
    o: PackOptions,
    *,
    existing: Callable[[Sequence[str]], np.ndarray] | None = None,
    engine=None,
) -> PackPlan:
    """Scan ``src``, shuffle, ``stat`` each file, and roll shards by the format's size rule.

    ``o``: the pack's options, whole (what decides the bytes: ``write.read.pack_options``;
    ``progress`` too). ``o.root``: a table source's root (``shardkit.scan.scan_table``). Unless
    ``o.allow_duplicates``, samples whose key the dataset an append adds to holds (``existing``:
    a bool per key given, ``keyfile.held_in``) and table rows naming an image an earlier row
    named are left out.
    ``engine``: a runner whose ``map_chunks`` runs the ``stat`` calls (``source_stats``) and
    a table's scan (``scan.table.scan_tables``), in spans of its rows, each span's arrays
    written into OUT and joined there (``scan.pieces``): this process maps the table's
    columns, it does not hold them."""
    if not isinstance(o, PackOptions):
        raise InputError(f"plan_pack: options={o!r}; give a shardkit.write.PackOptions")
    check_source_dir(src)
    options = pack_options(o)
    root, on_error, shuffle = options.get("root"), options["on_error"], options["shuffle"]
    work = None
    if getattr(engine, "map_chunks", None) is not None and not is_url(out):  # a table's pieces
        os.makedirs(out, exist_ok=True)
        work = out
    scan = scan_source(src, progress=o.progress, root=root, engine=engine, work=work)
    if scan.errors and on_error == "raise":
        bad = scan.errors[0]
        where = bad.path if scan.from_table else os.path.join(src, bad.path)  # rows: the table
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
    order = np.random.default_rng(options["seed"]).permutation(n) if shuffle else np.arange(n)
    repeated, already, dropped = [], 0, None
    if not o.allow_duplicates:
        repeated, already, dropped = _duplicates(src, scan, existing)
    if dropped is not None:
        order = order[~dropped[order]]
    starts = _roll(scan, stats, order, options["format"], options["shard_size"], work)
    fp = fingerprint(scan, stats, options)
    scan.stats = stats = None  # rolled and fingerprinted: 16 bytes a row not held for the tasks
    info = {
        "source": src,
        "shard_size": options["shard_size"],
        "shuffle": shuffle,
        "seed": options["seed"],
        "validate": options["validate"],
        "resize_short": options["resize_short"],
        "resize_quality": RESIZE_QUALITY if options["resize_short"] else None,
        "format": options["format"],
        "on_error": on_error,
        "shardkit_version": pack_version(),
        "non_image_files": dict(sorted(scan.non_image_exts.items())),
        "links_outside_source": scan.outside_links,
        **({"failed_downloads": scan.failed_downloads} if scan.failed_downloads else {}),
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
    if scan.again is not None:  # a key column: a key listed again
        dropped = scan.again.copy()
    elif scan.keyed or not scan.from_table:
        dropped = np.zeros(len(scan.files), dtype=bool)
    else:
        dropped = repeats(scan.files)
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
#: Fields a row's roll record holds (a table row has at most two: ``txt`` and ``json``).
RECORD_FIELDS = 2
#: Rows a scan on disk is rolled at a time (``_inputs_on_disk``): its Python objects are the
#: plan's working set, whatever the table's length.
RECORD_BLOCK = 1 << 12


def _roll(
    scan: SourceScan,
    stats: SourceStats,
    order: np.ndarray,
    fmt: str,
    limit: int,
    work: str | None = None,
):
    """Shard starts in ``order``: a shard closes when the next sample would pass ``limit``
    (a sample bigger than ``limit`` gets a shard of its own), as ``ShardWriter`` rolls; fields
    count with their names and sizes (``stats.fields``). ``PLAN_BLOCK`` samples at a time: only
    one block's sizes are ever Python objects. A scan whose columns are on disk
    (``scan.pieces``) is rolled from one record a row, in a file under ``work``, read where it
    lies (``_inputs_on_disk``), not through its maps."""
    new = get_format(fmt).sizer
    starts, sizer, single = [0], new(), 0
    blocks = None
    if isinstance(scan.keys.offsets, np.memmap):
        blocks = _inputs_on_disk(scan, stats, order, work)
    if blocks is None:
        blocks = _inputs_here(scan, stats, order)
    for lo, inputs in blocks:
        for j, (k, e, b, extra) in enumerate(inputs):
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


def _inputs_here(scan: SourceScan, stats: SourceStats, order: np.ndarray):
    """``(position, [(key bytes, extension bytes, image bytes, fields' sizes) of each sample
    of the block]`` of each ``PLAN_BLOCK`` of ``order``, from the scan's arrays in memory."""
    ko, eo = scan.keys.offsets, scan.exts.offsets  # lengths taken a block at a time
    sizes = stats.files[:, 0]
    for lo in range(0, len(order), PLAN_BLOCK):
        block = order[lo : lo + PLAN_BLOCK]
        extras = _field_sizes(scan, stats, block.tolist())
        klen, elen = (ko[block + 1] - ko[block]).tolist(), (eo[block + 1] - eo[block]).tolist()
        nbytes = np.maximum(sizes[block], 0).tolist()
        yield lo, zip(klen, elen, nbytes, extras, strict=True)


def _inputs_on_disk(scan: SourceScan, stats: SourceStats, order: np.ndarray, work):
    """``_inputs_here`` of a scan on disk: one pass in row order writes each row's inputs as a
    record of int64s (key, extension and image bytes, then ``RECORD_FIELDS`` fields' name and
    value bytes) into an unnamed file beside the columns, and each sample's record is read
    back in ``order`` with ``pread``: the columns are read in order, a block's pages at a time
    (a map faults whole folios in: random reads through it held the columns), and what is
    held is a block's records. None: a row with more fields than a record holds."""
    if scan.sidecars.blob.size:  # field files (a folder's): not a table's scan
        return None
    width = 4 + 2 * RECORD_FIELDS
    f = tempfile.TemporaryFile(dir=work)  # unnamed: gone with this process, however it ends
    n = len(scan.keys)
    ko, eo, sizes = scan.keys.offsets, scan.exts.offsets, stats.files
    inline = scan.inline if scan.inline.blob.size else None
    for lo in range(0, n, RECORD_BLOCK):
        hi = min(lo + RECORD_BLOCK, n)
        rec = np.zeros((hi - lo, width), dtype="<i8")
        rec[:, 0] = np.diff(ko[lo : hi + 1])
        rec[:, 1] = np.diff(eo[lo : hi + 1])
        rec[:, 2] = np.maximum(sizes[lo:hi, 0], 0)
        if inline is not None:  # as _field_sizes counts a row's fields, the block in order
            part = inline.span(lo, hi)
            here = StrTable()
            here.blob, here.offsets = np.array(part.blob), np.array(part.offsets)
            extras = []
            for text in here:
                pairs = [x for k, v in inline_fields(text).items() for x in (len(k), len(v))]
                if len(pairs) > 2 * RECORD_FIELDS:
                    f.close()
                    return None
                extras.append([len(pairs) // 2, *pairs] + [0] * (2 * RECORD_FIELDS - len(pairs)))
            rec[:, 3:] = np.array(extras, dtype=np.int64).reshape(hi - lo, width - 3)
        f.write(memoryview(rec).cast("B"))
        forget(ko, eo, sizes, scan.inline)
    f.flush()
    return _records(f, order, width)


def _records(f, order: np.ndarray, width: int):
    fd, size = f.fileno(), 8 * width
    try:
        for lo in range(0, len(order), RECORD_BLOCK):
            rows = order[lo : lo + RECORD_BLOCK].tolist()
            raw = b"".join([os.pread(fd, size, r * size) for r in rows])
            block = np.frombuffer(raw, dtype="<i8").reshape(-1, width).tolist()
            yield (
                lo,
                (
                    (k, e, b, tuple((r[2 * x], r[2 * x + 1]) for x in range(nf)))
                    for k, e, b, nf, *r in block
                ),
            )
    finally:
        f.close()


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
