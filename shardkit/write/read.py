"""Reading a source for a pack: each file in one read, checked (and maybe resized), on threads.

Shared by ``packer`` (Python sample sources), ``plan`` (the fingerprint, file sizes) and
``task`` (folder shard tasks, on any engine), with the options and source fingerprint that
decide a pack's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from ..formats import get_format
from ..images.checks import check_image_bytes, decode_error
from ..images.decode import resize_short_side
from ..scan import SourceScan, field_files, member_of, member_stat, read_member
from ..scan.strings import forget
from ..sizes import parse_size

if TYPE_CHECKING:
    from .options import PackOptions

__all__ = [
    "FINGERPRINT_FIELD",
    "PREFETCH_BYTES",
    "READ_AHEAD",
    "READ_BATCH",
    "Loaded",
    "SourceStats",
    "file_stats",
    "fingerprint",
    "pack_options",
    "read_fields",
    "pack_version",
    "read_file",
    "check_sample",
    "ordered_map",
    "source_stats",
    "span_stats",
    "stat_pair",
    "Ahead",
    "PackWarning",
]


class PackWarning(UserWarning):
    """Something to look at that did not stop the pack (skipped files, empty classes)."""


#: Files each reader-thread task reads: amortises the thread hand-off over several files.
READ_BATCH = 32
#: Bytes from the start of each upcoming file that the kernel is asked to read ahead
#: (``POSIX_FADV_WILLNEED``); bounded so one huge file cannot flood the page cache.
PREFETCH_BYTES = 2 << 20
#: Tasks in flight per reader thread: enough to keep every thread busy, bounded for memory.
READ_AHEAD = 4

#: A loaded sample: (position, key, bytes or None, ext, reason it is unusable or None, label,
#: extra fields as ``{name: bytes}`` or None).
Loaded = tuple[int, str, "bytes | None", str, "str | None", int, "dict[str, bytes] | None"]

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def read_file(path: str, fd: int | None = None) -> tuple[bytes, os.stat_result]:
    """Whole file in one read, and its ``fstat``; O_NONBLOCK so a FIFO swapped in after the scan
    cannot hang us.

    ``fd``: the file already opened (by the read-ahead hint); it is closed here either way.
    A member of a tar (``DIR/00000.tar/000000407.jpg``: img2dataset's images) is read in place,
    with the tar's ``stat``."""
    if fd is None:
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            if member_of(path) is None:
                raise
            return read_member(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file (FIFO, socket or device)")
        data = os.read(fd, st.st_size) if st.st_size else b""
        if len(data) < st.st_size:  # short read: keep going until EOF
            parts = [data]
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            data = b"".join(parts)
        return data, st
    finally:
        os.close(fd)


class Ahead:
    """Start the kernel reading upcoming files now, asynchronously, and keep them open.

    Reading small files one after another waits on the disk once per file (queue depth 1, as tar
    does); hinting the next batch keeps dozens of reads in flight from a single reader thread,
    which is what makes a cold-cache pack faster than tar. The hinted file's descriptor is kept
    and handed to its read, so each file is opened once (at 1.28M files a second open per file
    was a second metadata walk). Advice only: a file that cannot be opened here is opened (and
    its error reported) by the read; at most ``limit`` descriptors are held.
    """

    def __init__(self, limit: int = 512):
        self.fds: dict[int, int] = {}  # sample position -> open fd (dict ops are atomic)
        self.limit = limit
        self.advise = hasattr(os, "posix_fadvise")

    def hint(self, root: str, files, batch) -> None:
        for i in batch:
            if len(self.fds) >= self.limit:
                return
            try:
                fd = os.open(os.path.join(root, files[i]), _OPEN_FLAGS)
            except OSError:
                continue
            if self.advise:
                try:
                    os.posix_fadvise(fd, 0, PREFETCH_BYTES, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
            old = self.fds.setdefault(i, fd)
            if old != fd:
                os.close(fd)

    def take(self, i: int) -> int | None:
        return self.fds.pop(i, None)

    def close(self) -> None:
        """Close what was hinted but never read (an aborted pack, or a read that won a race)."""
        while self.fds:
            try:
                os.close(self.fds.popitem()[1])
            except (KeyError, OSError):
                pass


def check_sample(data: bytes, ext: str, validate: str, resize_short: int | None):
    """``(bytes, ext, None)`` ready to store, or ``(None, ext, reason)``: validate, maybe resize."""
    reason = None
    if validate == "header":
        reason = check_image_bytes(data)
        if reason is not None and decode_error(data) is None:
            reason = None  # odd but whole (e.g. trailer after EOI): the decoder decides
    elif validate == "decode":
        reason = check_image_bytes(data) if not data else decode_error(data)
    if reason is None and resize_short is not None:
        try:
            small = resize_short_side(data, resize_short)
        except Exception as exc:
            reason = f"cannot decode: {exc}"
        else:
            if small is not None:
                data, ext = small, "jpg"
    return (None, ext, reason) if reason else (data, ext, None)


def ordered_map(fn: Callable, items: Iterable, workers: int, window: int) -> Iterator:
    """``map(fn, items)`` on ``workers`` threads, at most ``window`` tasks ahead, in input order.

    File reads and PIL release the GIL, so threads overlap I/O (and decoding) with the writing
    done by the consumer. On early exit (error, Ctrl-C) queued tasks are cancelled.
    """
    it = iter(items)
    with ThreadPoolExecutor(workers, thread_name_prefix="shardkit-read") as pool:
        pending = deque(pool.submit(fn, x) for x in islice(it, window))
        try:
            while pending:
                result = pending.popleft().result()
                for x in islice(it, 1):
                    pending.append(pool.submit(fn, x))
                yield result
        finally:
            for f in pending:
                f.cancel()


def pack_version() -> str:
    try:
        from importlib.metadata import version

        return version("shardkit")
    except Exception:
        return "unknown"


#: The key in the manifest's ``pack`` object holding the source fingerprint (FORMAT.md).
FINGERPRINT_FIELD = "source_fingerprint"


def stat_pair(path: str) -> tuple[int, int]:
    """``(size, mtime_ns)`` of ``path`` (symlinks followed, as a read follows them); -1s if gone."""
    try:
        st = os.stat(path)
    except OSError:
        try:  # a member of a tar (img2dataset's images): its size, the tar's mtime
            return member_stat(path) or (-1, -1)
        except OSError:
            return (-1, -1)
    return (st.st_size, st.st_mtime_ns)


#: Files ``stat``-ed per block: the tuples of one block live at a time.
STAT_BLOCK = 1 << 14


def file_stats(root: str, files) -> np.ndarray:
    """``(size, mtime_ns)`` of each of ``files`` under ``root`` (``stat_pair``), an (n, 2) int64
    array filled a block at a time: no Python tuple per file outlives its block."""
    out = np.empty((len(files), 2), dtype=np.int64)
    block: list[tuple[int, int]] = []
    at = 0
    for rel in files:
        block.append(stat_pair(os.path.join(root, rel)))
        if len(block) == STAT_BLOCK:
            out[at : at + len(block)] = block
            at += len(block)
            block.clear()
    if block:
        out[at : at + len(block)] = block
    return out


def pack_options(o: PackOptions) -> dict:
    """The options of ``o`` that decide a pack's bytes, as the fingerprint and the plan read
    them (not ``workers``: threads give the same bytes)."""
    options = {
        "format": get_format(o.format).name,
        "shard_size": parse_size(o.shard_size),
        "shuffle": bool(o.shuffle),
        "seed": int(o.seed),
        "validate": o.validate,
        "resize_short": o.resize_short,
        "on_error": o.on_error_mode,
    }
    if o.root is not None:  # a table's root; folder packs keep their fingerprints
        options["root"] = os.path.abspath(o.root)
    if o.allow_duplicates:  # other packs keep their fingerprints
        options["allow_duplicates"] = True
    return options


def fingerprint(scan: SourceScan, stats: SourceStats, options: dict) -> str:
    """sha256 over the options and the source listing, as ``make`` would compare it: every
    image's relative path, size and mtime (``stats.files``), the class folders, and what the
    scan listed as unreadable or ignored; with fields, also their names, each field file's size
    and mtime (``stats.fields``) and a table's own fields and labels."""
    head = {
        "options": options,
        "classes": list(scan.classes),
        "errors": [(e.path, e.reason) for e in scan.errors],
        "ignored": [(e.path, e.reason) for e in scan.ignored],
        "non_image_exts": dict(sorted(scan.non_image_exts.items())),
    }
    if scan.keyed:  # img2dataset's keys: packs made when keys were paths differ
        head["keys"] = "key column"
    if scan.failed_downloads:
        head["failed_downloads"] = scan.failed_downloads
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    parts = [scan.files.offsets, scan.files.blob, stats.files]
    if len(scan.inline):  # a table (one entry per row): its captions, columns and labels
        parts += [scan.inline.offsets, scan.inline.blob, scan.labels]
    for part in parts:  # hashed in place: no copy of a table's text
        _hash_blocks(h, part)
    if scan.sidecars.blob.size:  # without fields: as before
        h.update(_le_bytes(scan.sidecars.offsets))
        h.update(_le_bytes(scan.sidecars.blob))
        h.update(_le_bytes(stats.fields))  # each sample's field rows, in sample order
    return "sha256:" + h.hexdigest()


#: Rows of a column hashed at a time (a column on disk: one block's pages held at a time).
HASH_BLOCK = 1 << 20


def _hash_blocks(h, a: np.ndarray) -> None:
    """``h.update`` with ``_le_bytes(a)``, ``HASH_BLOCK`` rows at a time (the same digest)."""
    for lo in range(0, max(len(a), 1), HASH_BLOCK):
        h.update(_le_bytes(a[lo : lo + HASH_BLOCK]))
        forget(a)


def _le_bytes(a: np.ndarray) -> memoryview:
    """The bytes of ``a`` as little-endian int64 (uint8 stays bytes), without a copy where the
    array already is that."""
    a = np.ascontiguousarray(a, dtype=np.uint8 if a.dtype == np.uint8 else "<i8")
    return memoryview(a).cast("B")


@dataclass(frozen=True)
class SourceStats:
    """The plan's per-file ``(size, mtime_ns)`` (``stat_pair``) as int64 arrays: ``files`` one
    row per sample's image; ``fields`` one per field file, sample ``i``'s rows
    ``fields[field_offsets[i]:field_offsets[i + 1]]`` (in ``SourceScan.fields_of`` order).
    Without field files ``field_offsets`` is ``[0]``: no 8 bytes per sample for nothing."""

    files: np.ndarray
    field_offsets: np.ndarray
    fields: np.ndarray

    def of_fields(self, i: int) -> list[tuple[int, int]]:
        if len(self.field_offsets) == 1:
            return []
        a, b = self.field_offsets[i : i + 2].tolist()
        return [(int(x), int(y)) for x, y in self.fields[a:b].tolist()]

    @classmethod
    def gather(cls, n: int, parts: Iterable[SourceStats]) -> SourceStats:
        """The stats of ``n`` samples from ``parts`` (consecutive spans, taken one at a time:
        the images' rows go straight into one array)."""
        files = np.empty((n, 2), dtype=np.int64)
        offsets, fields, at, base = [np.zeros(1, dtype=np.int64)], [], 0, 0
        for p in parts:
            files[at : at + len(p.files)] = p.files
            at += len(p.files)
            if len(p.field_offsets) > 1:
                offsets.append(p.field_offsets[1:] + base)
                base += int(p.field_offsets[-1])
            fields.append(p.fields)
        if at != n:  # a runner's map_chunks that lost or repeated a chunk
            raise ValueError(f"the plan's stats cover {at} files of {n}")
        empty = np.empty((0, 2), dtype=np.int64)
        return cls(files, np.concatenate(offsets), np.concatenate(fields) if fields else empty)


def span_stats(root: str, files: Sequence[str], sidecars: Sequence[str]) -> SourceStats:
    """``SourceStats`` of ``files`` under ``root`` and of their field files (``sidecars``:
    ``SourceScan.sidecars`` form, or empty for none): one planning chunk, on any machine."""
    counts = np.zeros(len(files) + 1 if len(sidecars) else 1, dtype=np.int64)
    pairs: list[tuple[int, int]] = []
    if len(sidecars):
        for i, (rel, side) in enumerate(zip(files, sidecars, strict=True)):
            named = field_files(rel, side)
            counts[i + 1] = len(named)
            pairs += [stat_pair(os.path.join(root, p)) for _, p in named]
    fields = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return SourceStats(file_stats(root, files), np.cumsum(counts), fields)


def source_stats(scan: SourceScan, engine=None) -> SourceStats:
    """The plan's stats of ``scan``, ``STAT_BLOCK`` samples at a time; on ``engine`` (a runner
    with ``map_chunks``, ``plan_chunk`` samples a call) where it offers, else here. Either way
    the same arrays: only where the ``stat`` calls run differs. Here, without field files, a
    folder's images keep the ``stat`` its walk took (``SourceScan.stats``), and a table's
    rows theirs on any engine (its scan ran there)."""
    root = os.path.abspath(scan.root)
    sidecars = scan.sidecars if scan.sidecars.blob.size else None
    mapper = getattr(engine, "map_chunks", None)
    if sidecars is None and scan.stats is not None and (mapper is None or scan.from_table):
        # the walk's own stat of each image (the same call): no second stat per file; a
        # table's rows were stat-ed where they were scanned (on the engine, given one)
        return SourceStats(scan.stats, np.zeros(1, dtype=np.int64), np.empty((0, 2), np.int64))
    step = int(engine.plan_chunk) if mapper is not None else STAT_BLOCK
    n = len(scan.files)
    chunks = (
        (
            root,
            scan.files.span(a, min(a + step, n)),
            sidecars.span(a, min(a + step, n)) if sidecars is not None else (),
        )
        for a in range(0, n, step)
    )
    if mapper is not None:
        return SourceStats.gather(n, mapper(span_stats, list(chunks)))
    return SourceStats.gather(n, (span_stats(*c) for c in chunks))


def read_fields(root: str, named, validate: str) -> tuple[dict | None, str | None]:
    """``({field: bytes} or None, reason or None)``: a sample's field files, read whole.

    A field named ``json``/``*.json`` must parse (unless ``validate="none"``): a caption set with
    one broken file fails here, naming it, not in the middle of training."""
    if not named:
        return None, None
    fields = {}
    for name, rel in named:
        try:
            data, _ = read_file(os.path.join(root, rel))
        except OSError as exc:
            return None, f"field file {rel}: unreadable: {exc.strerror or exc}"
        if validate != "none" and (name == "json" or name.endswith(".json")):
            try:
                json.loads(data)
            except ValueError as exc:
                return None, f"field file {rel}: not valid JSON ({exc})"
        fields[name] = data
    return fields, None
