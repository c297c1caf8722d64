"""``shardkit pack``: images (a class-per-folder tree, or Python samples) into shards + manifest.

The pipeline, one stage each below, composed in ``pack``:

    scan SRC (shardkit.scan: sorted classes, sorted files, labels, keys)
    -> order: shuffle once (numpy permutation of the sorted list: same input + seed = same bytes)
    -> read + validate (+ resize) in reader threads, consumed in that order
    -> ShardWriter (shardkit.write.writer): shards within shard_size, published with the
       manifest last.

A Python source (a list or iterator of ``(image, label)``, or a map-style torch Dataset) takes
the place of the scan; its images are encoded once if they are not already (shardkit.write.samples).
What is left after any interruption is the writer's business: nothing under a final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from ..errors import InputError, ShardkitError, check_choice
from ..formats import get_format
from ..fsutil import DirLock, interrupted_commit
from ..images.checks import check_image_bytes, decode_error
from ..images.decode import RESIZE_QUALITY, resize_short_side
from ..manifest import MANIFEST_NAME, SkippedFile, read_manifest
from ..scan import SourceScan, check_source_dir, scan_source
from ..sizes import parse_size
from ..urls import is_url
from . import samples as _samples
from .writer import DEFAULT_SHARD_SIZE, ShardWriter

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "FINGERPRINT_FIELD",
    "PackReport",
    "PackWarning",
    "SourceScan",
    "pack",
    "scan_source",
]

#: Files each reader-thread task reads: amortises the thread hand-off over several files.
READ_BATCH = 32
#: Bytes from the start of each upcoming file that the kernel is asked to read ahead
#: (``POSIX_FADV_WILLNEED``); bounded so one huge file cannot flood the page cache.
PREFETCH_BYTES = 2 << 20
#: Tasks in flight per reader thread: enough to keep every thread busy, bounded for memory.
READ_AHEAD = 4

_VALIDATE = ("header", "decode", "none")
#: ``"fail"`` is the former name of ``"raise"``, kept as an alias.
_ON_ERROR = ("skip", "raise", "fail")

#: A loaded sample: (position, key, bytes or None, ext, reason it is unusable or None, label,
#: extra fields as ``{name: bytes}`` or None).
Loaded = tuple[int, str, "bytes | None", str, "str | None", int, "dict[str, bytes] | None"]


class PackWarning(UserWarning):
    """Something to look at that did not stop the pack (skipped files, empty classes)."""


# --- read + validate ---------------------------------------------------------------------------


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _read_file(path: str, fd: int | None = None) -> tuple[bytes, os.stat_result]:
    """Whole file in one read, and its ``fstat``; O_NONBLOCK so a FIFO swapped in after the scan
    cannot hang us.

    ``fd``: the file already opened (by the read-ahead hint); it is closed here either way."""
    if fd is None:
        fd = os.open(path, _OPEN_FLAGS)
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


class _Ahead:
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


def _check(data: bytes, ext: str, validate: str, resize_short: int | None):
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


def _folder_loader(scan: SourceScan, validate: str, resize_short: int | None):
    """The reader-thread task for a folder: read, check and maybe resize a batch of files.

    A task is ``(batch, ahead, hint_own)``: it first hints ``ahead`` (the batch this thread will
    most likely read next) to the kernel, so those reads overlap this batch's. Each file's size
    and mtime as read land in ``load.stats`` (for the source fingerprint), from the ``fstat``
    the read makes anyway: no second metadata walk.
    """
    root = os.path.abspath(scan.root)
    files, exts, keys, labels = scan.files, scan.exts, scan.keys, scan.labels

    def load(task: tuple) -> list[Loaded]:
        batch, ahead, hint_own = task
        if hint_own:
            load.ahead.hint(root, files, batch)
        load.ahead.hint(root, files, ahead)
        out = []
        for i in batch:
            ext, key, label = exts[i], keys[i], int(labels[i])
            path = os.path.join(root, files[i])
            try:
                data, st = _read_file(path, load.ahead.take(i))
            except OSError as exc:
                load.stats[i] = _stat_pair(path)
                out.append((i, key, None, ext, f"unreadable: {exc.strerror or exc}", label, None))
                continue
            load.stats[i] = (st.st_size, st.st_mtime_ns)
            checked = _check(data, ext, validate, resize_short)
            fields, why = _read_fields(root, scan.fields_of(i), validate, load.side_stats, i)
            if fields is not None or why is None:
                fields = {**(fields or {}), **scan.inline_fields(i)} or None
            if why is not None and checked[2] is None:
                checked = (None, ext, why)
            out.append((i, key, *checked, label, fields))
        return out

    load.ahead = _Ahead()
    load.stats = np.full((len(files), 2), -1, dtype=np.int64)
    load.side_stats = {}  # position -> (size, mtime_ns) of each sidecar, for the fingerprint
    return load


def _read_fields(root: str, named, validate: str, side_stats: dict, i: int):
    """``({field: bytes} or None, reason or None)``: a sample's sidecar files, read whole.

    A field named ``json``/``*.json`` must parse (unless ``validate="none"``): a caption set with
    one broken file fails here, naming it, not in the middle of training."""
    if not named:
        return None, None
    fields, stats = {}, []
    for name, rel in named:
        path = os.path.join(root, rel)
        try:
            data, st = _read_file(path)
        except OSError as exc:
            stats.append(_stat_pair(path))
            side_stats[i] = stats
            return None, f"field file {rel}: unreadable: {exc.strerror or exc}"
        stats.append((st.st_size, st.st_mtime_ns))
        if validate != "none" and (name == "json" or name.endswith(".json")):
            try:
                json.loads(data)
            except ValueError as exc:
                side_stats[i] = stats
                return None, f"field file {rel}: not valid JSON ({exc})"
        fields[name] = data
    side_stats[i] = stats
    return fields, None


def _folder_tasks(order: np.ndarray, workers: int) -> Iterator[tuple]:
    """Batches in pack order; task k also hints batch k + workers, which its thread reads next.

    Sliced from the numpy order as they are needed: no Python list of every sample."""
    nb = (len(order) + READ_BATCH - 1) // READ_BATCH
    for k in range(nb):
        yield (
            order[k * READ_BATCH : (k + 1) * READ_BATCH].tolist(),
            order[(k + workers) * READ_BATCH : (k + workers + 1) * READ_BATCH].tolist(),
            k < workers,
        )


def _ordered_map(fn: Callable, items: Iterable, workers: int, window: int) -> Iterator:
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


@dataclass
class PackReport:
    """What ``pack`` did; ``summary()`` is the paragraph the CLI prints."""

    out: str
    manifest_path: str
    format: str
    shards: int
    samples: int
    classes: int
    bytes: int
    seconds: float
    skipped: list[SkippedFile]
    errors: int
    not_images: int
    empty_classes: list[str]
    #: True when OUT already held this pack (same source files and options): nothing was written.
    up_to_date: bool = False

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        s = "s" if self.shards != 1 else ""
        if self.up_to_date:
            return (
                f"{self.out} is up to date: {self.samples} samples of {self.classes} classes in "
                f"{self.shards} {self.format} shard{s} ({self.bytes / 1e6:.1f} MB), packed from "
                "the same files with the same options; nothing to do (--overwrite repacks). "
                f"Manifest: {self.manifest_path}"
            )
        text = (
            f"Packed {self.samples} samples of {self.classes} classes into {self.shards} "
            f"{self.format} shard{s} ({self.bytes / 1e6:.1f} MB) in {self.out} "
            f"in {self.seconds:.1f} s ({self.mb_per_s:.1f} MB/s, "
            f"{self.samples / max(self.seconds, 1e-9):.0f} samples/s). "
            f"Skipped {self.errors} bad or unreadable image(s) and {self.not_images} non-image "
            f"file(s)"
        )
        if self.empty_classes:
            text += f"; {len(self.empty_classes)} empty class folder(s)"
        return text + f". Manifest: {self.manifest_path}"


def _pack_version() -> str:
    try:
        from importlib.metadata import version

        return version("shardkit")
    except Exception:
        return "unknown"


# --- up to date: OUT already holds this pack ----------------------------------------------------

#: The key in the manifest's ``pack`` object holding the source fingerprint (FORMAT.md).
FINGERPRINT_FIELD = "source_fingerprint"


def _stat_pair(path: str) -> tuple[int, int]:
    """``(size, mtime_ns)`` of ``path`` (symlinks followed, as a read follows them); -1s if gone."""
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_size, st.st_mtime_ns)


def _options(format, shard_size, shuffle, seed, validate, resize_short, on_error) -> dict:
    """The options that decide a pack's bytes (not ``workers``: threads give the same bytes)."""
    return {
        "format": get_format(format).name,
        "shard_size": parse_size(shard_size),
        "shuffle": bool(shuffle),
        "seed": int(seed),
        "validate": validate,
        "resize_short": resize_short,
        "on_error": on_error,
    }


def _fingerprint(
    scan: SourceScan, stats: np.ndarray, options: dict, side_stats: dict | None = None
) -> str:
    """sha256 over the options and the source listing, as ``make`` would compare it: every
    image's relative path, size and mtime (``stats``: one ``(size, mtime_ns)`` row per file of
    ``scan.files``), the class folders, and what the scan listed as unreadable or ignored."""
    head = {
        "options": options,
        "classes": list(scan.classes),
        "errors": [(e.path, e.reason) for e in scan.errors],
        "ignored": [(e.path, e.reason) for e in scan.ignored],
        "non_image_exts": dict(sorted(scan.non_image_exts.items())),
    }
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    h.update(scan.files.offsets.astype("<i8").tobytes())
    h.update(scan.files.blob.tobytes())
    h.update(np.ascontiguousarray(stats, dtype="<i8").tobytes())
    if scan.inline.blob.size:  # a table's captions and columns
        h.update(scan.inline.offsets.astype("<i8").tobytes())
        h.update(scan.inline.blob.tobytes())
        h.update(np.ascontiguousarray(scan.labels, dtype="<i8").tobytes())
    if side_stats is not None and scan.sidecars.blob.size:  # without fields: as before
        h.update(scan.sidecars.offsets.astype("<i8").tobytes())
        h.update(scan.sidecars.blob.tobytes())
        for i in range(len(scan.files)):
            h.update(np.asarray(side_stats.get(i, ()), dtype="<i8").tobytes())
    return "sha256:" + h.hexdigest()


def _already_packed(src: str, out: str, options: dict, progress: bool) -> PackReport | None:
    """The report of ``out`` if it holds this very pack (its manifest's fingerprint equals the
    source's now, and every shard it lists is there at its size), else None.

    Costs a scan and one ``stat`` per file, no reads. Manifests without a fingerprint (older
    packs, Python sources, URLs) are never up to date: the caller goes on as before.
    """
    if is_url(out) or not os.path.isfile(os.path.join(out, MANIFEST_NAME)):
        return None
    started = time.perf_counter()
    with DirLock(out):  # another writer into OUT: refused at once, as the pack would be
        if interrupted_commit(out):
            return None
        try:
            manifest = read_manifest(out)
        except ShardkitError:
            return None
        recorded = manifest.pack.get(FINGERPRINT_FIELD)
        if not isinstance(recorded, str) or any(
            _stat_pair(os.path.join(out, s.path))[0] != s.bytes for s in manifest.shards
        ):
            return None
        scan = scan_source(src, progress=progress, root=options.get("root"))
        root = os.path.abspath(scan.root)
        stats = np.array(
            [_stat_pair(os.path.join(root, f)) for f in scan.files], dtype=np.int64
        ).reshape(-1, 2)
        side = {
            i: [_stat_pair(os.path.join(root, rel)) for _, rel in scan.fields_of(i)]
            for i in (range(len(scan.files)) if scan.sidecars.blob.size else ())
            if scan.sidecars[i]
        }
        if _fingerprint(scan, stats, options, side) != recorded:
            return None
    return PackReport(
        out=out,
        manifest_path=os.path.join(out, MANIFEST_NAME),
        format=manifest.shard_format,
        shards=len(manifest.shards),
        samples=manifest.num_samples,
        classes=len(manifest.classes),
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - started,
        skipped=sorted(manifest.skipped, key=lambda s: s.path),
        errors=max(0, len(manifest.skipped) - len(scan.ignored)),
        not_images=scan.not_images,
        empty_classes=list(scan.empty_classes),
        up_to_date=True,
    )


# --- pack ------------------------------------------------------------------------------------


def _check_options(validate, on_error, workers, resize_short, seed) -> str:
    check_choice("validate", validate, _VALIDATE)
    check_choice("on_error", on_error, _ON_ERROR)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"invalid workers={workers!r}; use 1 or more reader threads")
    if resize_short is not None and (not isinstance(resize_short, int) or resize_short < 1):
        raise InputError(f"invalid resize_short={resize_short!r}; use a positive number of pixels")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"invalid seed {seed!r}; use an integer >= 0")
    return "raise" if on_error == "fail" else on_error


def pack(
    src: str | os.PathLike | Iterable[Any],
    out: str | os.PathLike,
    *,
    shard_size: str | int = DEFAULT_SHARD_SIZE,
    format: str = "tar",
    shuffle: bool = True,
    seed: int = 0,
    workers: int = 1,
    on_error: str = "skip",
    overwrite: bool = False,
    resize_short: int | None = None,
    validate: str = "header",
    progress: bool = True,
    on_shard: Callable[[str], None] | None = None,
    classes: Sequence[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    work_dir: str | None = None,
    upload_concurrency: int = 4,
    root: str | os.PathLike | None = None,
) -> PackReport:
    """Pack ``src`` into shards in ``out``; see the module docstring.

    ``src`` may also be a table (``.csv``, ``.tsv``, ``.jsonl``; ``shardkit.scan.scan_table``):
    one row per image, its caption as field ``txt``, other columns as ``json``; image paths are
    relative to ``root`` (default: the table's folder), and nothing outside it is read.

    ``src`` is a class-per-folder tree, or from Python a list/iterable of ``(image, label)`` or
    a map-style torch Dataset (image: encoded bytes, a PIL image, a uint8 HWC array or CHW
    tensor; keys are positions, ``shardkit.write.samples``). Shuffling needs random access: an
    iterator is packed in its own order. ``classes`` names labels of a Python source (default:
    the Dataset's ``.classes``, else ``"0"``, ``"1"`` ...). ``out`` may be a URL
    (``s3://bucket/prefix/``): shards upload as they complete, the manifest last.

    ``on_error="skip"`` is the default because real datasets carry a few bad files and a long
    pack should not die on file 900,000 of a million: each one is listed with its reason in the
    manifest's ``skipped`` and a ``PackWarning`` gives the count. ``on_error="raise"`` stops at
    the first one, naming it. ``workers`` is the number of reader threads (the calling thread
    writes). ``on_shard(path)`` is called as each shard is complete (under its staging name).

    Like ``make``: a folder packed into a local ``out`` that already holds the same pack (the
    manifest's ``pack.source_fingerprint``: the same files with the same sizes and mtimes, the
    same options) is left as it is; the report then has ``up_to_date=True``. Anything else in a
    non-empty ``out`` needs ``overwrite=True``.
    Raises InputError / OutputError for unusable arguments.
    """
    started = time.perf_counter()
    on_error = _check_options(validate, on_error, workers, resize_short, seed)
    from_folder = isinstance(src, (str, os.PathLike))
    options = None
    if from_folder:
        src = os.fspath(src)
        check_source_dir(src)
        options = _options(format, shard_size, shuffle, seed, validate, resize_short, on_error)
        if root is not None:  # a table's root; folder packs keep their fingerprints
            options["root"] = os.path.abspath(root)
        if not overwrite:
            current = _already_packed(src, os.fspath(out), options, progress)
            if current is not None:
                return current
    elif (
        isinstance(src, (bytes, Mapping))
        or not isinstance(src, Iterable)
        and not hasattr(src, "__getitem__")
    ):
        raise InputError(
            f"src is a {type(src).__name__}; pass a folder path, a list/iterable of (image, "
            "label) samples, or a map-style torch Dataset"
        )
    writer = ShardWriter(
        out,
        format,
        shard_size,
        classes=classes,
        overwrite=overwrite,
        on_shard=on_shard,
        storage_options=storage_options,
        work_dir=work_dir,
        upload_concurrency=upload_concurrency,
        _forbid_inside=src if from_folder else None,
    )
    with writer:
        if from_folder:
            run = _folder_run(
                src, writer, shuffle, seed, workers, validate, resize_short, on_error, progress,
                options.get("root"),
            )  # fmt: skip
        else:
            run = _samples_run(
                src, writer, shuffle, seed, workers, validate, resize_short, on_error
            )
        errors = _write(run, writer, on_error, workers, progress)
        skipped = run.errors + errors
        if not writer.samples:
            first = skipped[0] if skipped else SkippedFile("-", "the source is empty")
            raise InputError(
                f"source {run.name}: none of its {run.total} images could be packed "
                f"(first: {first.path}: {first.reason}); see validate= and on_error="
            )
        writer.skipped = skipped + run.ignored
        writer.pack_info = {
            "source": run.name,
            "shard_size": writer.limit,
            "shuffle": run.shuffled,
            "seed": int(seed),
            "validate": validate,
            "resize_short": resize_short,
            "resize_quality": RESIZE_QUALITY if resize_short else None,
            "format": writer.format.name,
            "on_error": on_error,
            "shardkit_version": _pack_version(),
            **run.extra,
        }
        if run.scan is not None:
            writer.pack_info[FINGERPRINT_FIELD] = _fingerprint(
                run.scan, run.load.stats, options, run.load.side_stats
            )
    done = writer.report
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} bad or unreadable image(s) of {run.total}; their "
            f"{'paths' if from_folder else 'keys'} and reasons are in {done.manifest_path} under "
            "'skipped'",
            PackWarning,
            stacklevel=2,
        )
    return PackReport(
        out=done.out,
        manifest_path=done.manifest_path,
        format=done.format,
        shards=done.shards,
        samples=done.samples,
        classes=done.classes,
        bytes=done.bytes,
        seconds=time.perf_counter() - started,
        skipped=sorted(writer.skipped, key=lambda s: s.path),
        errors=len(skipped),
        not_images=run.not_images,
        empty_classes=list(run.empty_classes),
    )


@dataclass
class _Run:
    """One source made ready for the write loop: the tasks, their loader, and what to report."""

    name: str
    total: int
    tasks: Iterable[Any]
    load: Callable[[Any], list[Loaded]]
    describe: Callable[[int], str]  # position -> what an error names (a path, a sample)
    skip_name: Callable[[int, str], str]  # (position, key) -> its name in 'skipped'
    shuffled: bool
    errors: list[SkippedFile]
    ignored: list[SkippedFile]
    not_images: int = 0
    empty_classes: Sequence[str] = ()
    extra: dict[str, Any] | None = None
    scan: SourceScan | None = None  # a folder's: with ``load.stats``, its fingerprint


def _folder_run(
    src, writer, shuffle, seed, workers, validate, resize_short, on_error, progress=False, root=None
) -> _Run:
    scan = scan_source(src, progress=progress, root=root)
    if scan.errors and on_error == "raise":
        bad = scan.errors[0]
        raise InputError(
            f"{os.path.join(src, bad.path)}: {bad.reason}; remove or fix it, or pass "
            'on_error="skip"'
        )
    for cls in scan.empty_classes:
        warnings.warn(
            f"class folder {os.path.join(src, cls)!r} has no images; it keeps its label so labels "
            "match the sorted folder list",
            PackWarning,
            stacklevel=3,
        )
    if scan.outside_links:
        warnings.warn(
            f"{scan.outside_links} symbolic link(s) under {src!r} lead outside it; their targets "
            "were packed like files of the source (see pack.links_outside_source in the manifest)",
            PackWarning,
            stacklevel=3,
        )
    writer.classes = list(scan.classes)
    n = len(scan.files)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    return _Run(
        name=src,
        total=n + len(scan.errors),
        tasks=_folder_tasks(order, workers),
        load=_folder_loader(scan, validate, resize_short),
        describe=lambda i: os.path.join(scan.root, scan.files[i]),
        skip_name=lambda i, key: scan.files[i],
        shuffled=bool(shuffle),
        errors=list(scan.errors),
        ignored=list(scan.ignored),
        not_images=scan.not_images,
        empty_classes=scan.empty_classes,
        extra={
            "non_image_files": dict(sorted(scan.non_image_exts.items())),
            "links_outside_source": scan.outside_links,
        },
        scan=scan,
    )


def _samples_run(source, writer, shuffle, seed, workers, validate, resize_short, on_error) -> _Run:
    if writer.classes is None:
        names = getattr(source, "classes", None)
        if isinstance(names, (list, tuple)) and all(isinstance(c, str) for c in names):
            writer.classes = list(names)
    name = f"<{type(source).__name__}>"
    tasks, n, shuffled = _samples.tasks(source, shuffle, seed, READ_BATCH)
    return _Run(
        name=name,
        total=n,
        tasks=tasks,
        load=_samples.loader(source, lambda d, e: _check(d, e, validate, resize_short)),
        describe=lambda i: f"sample {i} of {name}",
        skip_name=lambda i, key: key,
        shuffled=shuffled,
        errors=[],
        ignored=[],
        extra={"keys": "position in the source, 9 digits"},
    )


def _write(run: _Run, writer: ShardWriter, on_error: str, workers: int, progress: bool):
    """The main-thread loop: consume reads in pack order into the writer (which rolls shards)."""
    from ..progress import Progress

    errors: list[SkippedFile] = []
    bar = Progress(run.total if run.total >= 0 else None, "pack", "img", enabled=progress)
    t0 = time.perf_counter()
    done_bytes = seen = 0
    try:
        for results in _ordered_map(run.load, run.tasks, workers, READ_AHEAD * workers):
            for i, key, data, ext, reason, label, fields in results:
                seen += 1
                if data is None:
                    if on_error == "raise":
                        raise InputError(
                            f"{run.describe(i)}: {reason}; remove or fix it, or pass "
                            'on_error="skip"'
                        )
                    errors.append(SkippedFile(run.skip_name(i, key), reason))
                    continue
                writer.add(key, ext, data, label, fields)
                done_bytes += len(data)
            bar.update(len(results))
            if not bar.disable:
                secs = time.perf_counter() - t0
                bar.set_postfix_str(f"{done_bytes / 1e6 / max(secs, 1e-9):.1f} MB/s", refresh=False)
    finally:
        bar.close()
        ahead = getattr(run.load, "ahead", None)
        if ahead is not None:
            ahead.close()
    if run.total < 0:
        run.total = seen
    return errors
