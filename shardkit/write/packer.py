"""``shardkit pack``: images (a class-per-folder tree, or Python samples) into shards + manifest.

A folder is packed in three steps (``shardkit.write.plan``, ``task``, ``commit``), on one machine
or on an engine:

    plan: scan SRC (shardkit.scan), shuffle once (numpy permutation of the sorted list), and fix
          every shard's samples and name from file sizes
    -> run: read + validate (+ resize) in reader threads, shards written under temporary names
       in the job folder, renamed when complete, a receipt each
    -> commit: the manifest, published with the shards all or nothing, manifest last.

``pack`` runs the whole plan in this process; ``runner`` (``shardkit.write.engines``, or an
integration such as Ray) runs it as many tasks: the same plan, so the same bytes.

A folder packed into a URL runs the same plan here, and ``ShardWriter`` (shardkit.write.writer)
uploads each shard as it completes, the manifest last. A Python source (a list or iterator of
``(image, label)``, or a map-style torch Dataset) goes through ``ShardWriter`` alone; its images
are encoded once if they are not already (shardkit.write.samples). Nothing is ever left under a
final name by an interruption.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError, ShardkitError
from ..formats import get_format
from ..fsutil import DirLock, interrupted_commit, recover
from ..images.decode import RESIZE_QUALITY
from ..manifest import MANIFEST_NAME, SkippedFile, read_manifest
from ..scan import SourceScan, check_source_dir, scan_source
from ..urls import is_remote, is_url
from . import samples as _samples
from .commit import check_cluster_lock, commit_pack
from .keyfile import dataset_columns, held_in
from .options import PackOptions, Runner
from .plan import APPENDED_FIELD, PackPlan, plan_pack
from .planfile import save_tasks
from .read import (
    FINGERPRINT_FIELD,
    READ_AHEAD,
    READ_BATCH,
    PackWarning,
    check_sample,
    fingerprint,
    ordered_map,
    pack_options,
    pack_version,
    source_stats,
    stat_pair,
)
from .task import done_receipt, run_task
from .writer import DEFAULT_SHARD_SIZE, ShardWriter, open_local_output, shard_number

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "FINGERPRINT_FIELD",
    "PackOptions",
    "PackReport",
    "PackWarning",
    "Runner",
    "SourceScan",
    "pack",
    "scan_source",
]


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
    #: With ``append=True``: the samples OUT held before (the counts above are what was added).
    appended_to: int | None = None
    #: Samples not packed because OUT already holds their key (``append=True``), or a table
    #: listed their image on an earlier row; ``allow_duplicates=True`` packs them.
    duplicates: int = 0
    #: img2dataset rows whose download had failed (``status`` not ``success``): no image.
    failed_downloads: int = 0

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
        if self.appended_to is not None and not self.samples:
            return (
                f"Nothing appended to {self.out}: all {self.duplicates} samples of the source "
                "are already in it (the same keys); --allow-duplicates adds them again. "
                f"Manifest: {self.manifest_path}"
            )
        verb, into = "Packed", f"into {self.shards}"
        if self.appended_to is not None:
            verb = "Appended"
            into = f"after the {self.appended_to} already there, as {self.shards} new"
        text = (
            f"{verb} {self.samples} samples of {self.classes} classes {into} "
            f"{self.format} shard{s} ({self.bytes / 1e6:.1f} MB) in {self.out} "
            f"in {self.seconds:.1f} s ({self.mb_per_s:.1f} MB/s, "
            f"{self.samples / max(self.seconds, 1e-9):.0f} samples/s). "
            f"Skipped {self.errors} bad or unreadable image(s) and {self.not_images} non-image "
            f"file(s)"
        )
        if self.failed_downloads:
            text += (
                f"; {self.failed_downloads} failed download(s) (img2dataset status not "
                "success: no image, listed under skipped)"
            )
        if self.empty_classes:
            text += f"; {len(self.empty_classes)} empty class folder(s)"
        if self.duplicates:
            text += (
                f"; left out {self.duplicates} duplicate(s) (key already there, or listed twice)"
            )
        return text + f". Manifest: {self.manifest_path}"


# --- up to date: OUT already holds this pack ----------------------------------------------------


@dataclass
class _Base:
    """The manifest of the dataset in a local OUT as last read, and the file's identity
    (device, inode, size, mtime) when it was: an append's up-to-date check and its plan both
    want it, and at scale it is O(shards) to read (~1.7 KB a shard); read again only where the
    file is no longer the one read (another writer, or a killed commit finished, between the
    check and the pack's lock)."""

    manifest: Any = None
    identity: tuple | None = None

    def read(self, out: str):
        try:
            st = os.stat(os.path.join(out, MANIFEST_NAME))
            now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            now = None  # read_manifest names what is wrong
        if self.manifest is None or now is None or now != self.identity:
            self.manifest, self.identity = read_manifest(out), now
        return self.manifest


def _already_packed(src: str, out: str, o: PackOptions, seen: _Base) -> PackReport | None:
    """The report of ``out`` if it holds this very pack (its manifest's fingerprint equals the
    source's now, with the options ``o``, and every shard it lists is there at its size), else
    None.

    Costs a scan and one ``stat`` per file (on ``engine``, as ``plan_pack``'s), no reads; for a
    URL, the manifest's GET and one listing of the prefix instead of the stats. Manifests
    without a fingerprint (older packs, Python sources) are never up to date: the caller goes
    on as before.
    """
    options, progress, engine = pack_options(o), o.progress, o.runner
    if is_remote(out):
        if o.append:
            return None
        return _already_packed_url(src, out, o)
    if is_url(out) or not (
        os.path.isfile(os.path.join(out, MANIFEST_NAME)) or interrupted_commit(out)
    ):
        return None
    started = time.perf_counter()
    with DirLock(out):  # another writer into OUT: refused at once, as the pack would be
        recover(out)  # a commit killed after its commit point is finished: then compare
        try:
            manifest = seen.read(out)
        except ShardkitError:
            return None
        recorded = manifest.pack.get(FINGERPRINT_FIELD)
        if o.append:  # up to date when this folder, as it is now, was appended with these options
            added = manifest.pack.get(APPENDED_FIELD)
            recorded = (
                [a.get(FINGERPRINT_FIELD) for a in added if isinstance(a, dict)]
                if isinstance(added, list)
                else []
            )
        else:
            recorded = [recorded]
        recorded = [r for r in recorded if isinstance(r, str)]
        if not recorded or any(
            stat_pair(os.path.join(out, s.path))[0] != s.bytes for s in manifest.shards
        ):
            return None
        scan = scan_source(
            src, progress=progress, root=options.get("root"), engine=engine, work=out
        )
        if fingerprint(scan, source_stats(scan, engine), options) not in recorded:
            return None
    return _up_to_date(out, os.path.join(out, MANIFEST_NAME), manifest, scan, started)


def _already_packed_url(src: str, out: str, o: PackOptions) -> PackReport | None:
    """``_already_packed`` for a URL: the same fingerprint, each shard's size from one listing
    of the prefix. Anything unreadable (no manifest, no bucket yet) is "not up to date": the
    pack goes on and meets it there, with its own message."""
    from ..remote.fs import filesystem, protocol_of, strip
    from ..remote.upload import join_url

    options, engine, storage_options = pack_options(o), o.runner, o.storage_options
    started = time.perf_counter()
    try:
        manifest = read_manifest(out, storage_options=dict(storage_options or {}))
        recorded = manifest.pack.get(FINGERPRINT_FIELD)
        if not isinstance(recorded, str):
            return None
        fs = filesystem(protocol_of(out), storage_options)
        prefix = strip(fs, out).rstrip("/")
        fs.invalidate_cache(prefix)
        sizes = {
            e["name"].rstrip("/")[len(prefix) + 1 :]: e.get("size")
            for e in fs.ls(prefix, detail=True)
        }
    except (ShardkitError, OSError):
        return None
    except Exception:  # a driver's own error while listing: the pack reports it
        return None
    if any(sizes.get(s.path) != s.bytes for s in manifest.shards):
        return None
    scan = scan_source(src, progress=o.progress, root=options.get("root"), engine=engine)
    if fingerprint(scan, source_stats(scan, engine), options) != recorded:
        return None
    return _up_to_date(out, join_url(out, MANIFEST_NAME), manifest, scan, started)


def _up_to_date(out: str, manifest_path: str, manifest, scan, started: float) -> PackReport:
    return PackReport(
        out=out,
        manifest_path=manifest_path,
        format=manifest.shard_format,
        shards=len(manifest.shards),
        samples=manifest.num_samples,
        classes=len(manifest.classes),
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - started,
        skipped=sorted(manifest.skipped, key=lambda s: s.path),
        errors=max(0, len(manifest.skipped) - len(scan.ignored)),
        not_images=scan.not_images,
        failed_downloads=scan.failed_downloads,
        empty_classes=list(scan.empty_classes),
        up_to_date=True,
    )


# --- pack ------------------------------------------------------------------------------------


def _session(runner):
    """``runner``, closed when the pack is done with it (``RayRunner.close`` stops a cluster
    started for the plan's stats), if it can be."""
    return contextlib.closing(runner) if hasattr(runner, "close") else contextlib.nullcontext()


def pack(
    src: str | os.PathLike | Iterable[Any],
    out: str | os.PathLike,
    options: PackOptions | None = None,
    **keywords: Any,
) -> PackReport:
    """Pack ``src`` into shards in ``out``; see the module docstring. ``options``: a
    ``PackOptions``; ``keywords`` (``shard_size="64MB"``, ``format="lmdb"`` ...) set its fields.

    ``src`` may also be a table (``.csv``, ``.tsv``, ``.jsonl``, ``.parquet`` with the
    ``parquet`` extra; ``shardkit.scan.scan_table``):
    one row per image, its caption as field ``txt``, other columns as ``json``; image paths are
    relative to ``root`` (default: the table's folder), and nothing outside it is read. Files
    beside a folder's images that share their key (``x.txt``, ``x.json``, ``x.seg.png``) are
    packed as their fields (``shardkit.scan``).

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
    writes). ``on_shard(path)`` is called as each shard is complete.

    ``runner`` runs a folder's plan as tasks of ``shards_per_task`` shards each elsewhere
    (``shardkit.write.engines.LocalRunner``, ``shardkit.integrations.ray``); the output is
    byte-identical to the default in-process run. A failed or killed run leaves its finished
    shards in OUT's job folder and the same command resumes from them (in-process: only a
    killed run; an error or Ctrl-C cleans up).

    ``plan_only="pack.plan"`` writes the plan's tasks (``shards_per_task`` shards each) to that
    file (arrays, ``write.planfile``) and stops: run each with ``shardkit pack-task pack.plan
    --task I`` (a SLURM array,
    any scheduler), then this same call without ``plan_only`` commits (every shard done is kept).
    The report then counts planned shards and samples, nothing written.

    ``append=True`` adds a folder's images to the dataset already in the local ``out`` as new
    shards (numbered after its last), under one new manifest written atomically; nothing already
    packed is rewritten, new class names are added after the old ones, and the formats must
    agree. Appending the same folder with the same options again is up to date. A sample whose
    key the dataset already holds is left out (counted in the report), as is a table row naming
    an image an earlier row named; ``allow_duplicates=True`` packs them all the same.

    Like ``make``: a folder packed into a local ``out`` that already holds the same pack (the
    manifest's ``pack.source_fingerprint``: the same files with the same sizes and mtimes, the
    same options) is left as it is; the report then has ``up_to_date=True``. Anything else in a
    non-empty ``out`` needs ``overwrite=True``.
    Raises InputError / OutputError for unusable arguments.
    """
    started = time.perf_counter()
    o = PackOptions.of(options, keywords)
    on_error = o.on_error_mode
    from_folder = isinstance(src, (str, os.PathLike))
    if from_folder:
        src = os.fspath(src)
        check_source_dir(src)
        out = os.fspath(out)
        if o.append:
            _check_append(out, o.overwrite)
        with _session(o.runner):  # a cluster started for the stats serves the tasks
            seen = _Base()  # OUT's manifest, read once where both steps want it
            if not o.overwrite and o.plan_only is None:
                current = _already_packed(src, out, o, seen)
                if current is not None:
                    return current
            if not is_url(out) or out.startswith("file://"):
                out = out.removeprefix("file://")
                return _pack_planned(src, out, o, started, seen)
        if o.runner is not None:
            raise InputError(
                f"output {out} is a URL; an engine packs into a local or shared folder (mounted "
                "on every worker); pack into one, then upload it, or leave out the engine"
            )
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
        o.format,
        o.shard_size,
        classes=o.classes,
        overwrite=o.overwrite,
        on_shard=o.on_shard,
        storage_options=o.storage_options,
        work_dir=o.work_dir,
        upload_concurrency=o.upload_concurrency,
        _forbid_inside=src if from_folder else None,
    )
    if from_folder:
        with writer:
            return _pack_to_url(src, writer, o, started)
    with writer:
        run = _samples_run(src, writer, o)
        errors = _write(run, writer, o)
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
            "seed": int(o.seed),
            "validate": o.validate,
            "resize_short": o.resize_short,
            "resize_quality": RESIZE_QUALITY if o.resize_short else None,
            "format": writer.format.name,
            "on_error": on_error,
            "shardkit_version": pack_version(),
            "keys": "position in the source, 9 digits",
        }
    done = writer.report
    _warn_skipped(skipped, run.total, done.manifest_path, from_folder)
    return _written_report(done, writer, skipped, run, started)


def _written_report(done, writer: ShardWriter, skipped: list, scan, started: float) -> PackReport:
    """The report of a pack that ``writer`` wrote (``done``: its close's report); ``scan``: what
    the source listing found (files that are not images, empty class folders)."""
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
        not_images=scan.not_images,
        failed_downloads=getattr(scan, "failed_downloads", 0),  # a Python source has none
        empty_classes=list(scan.empty_classes),
    )


def _warn_skipped(
    skipped: list, total: int, manifest_path: str, from_folder: bool, stacklevel: int = 3
) -> None:
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} bad or unreadable image(s) of {total}; their "
            f"{'paths' if from_folder else 'keys'} and reasons are in {manifest_path} under "
            "'skipped'",
            PackWarning,
            stacklevel=stacklevel,
        )


def _warn_duplicates(plan: PackPlan, src: str, out: str) -> None:
    """Say what ``plan_pack`` left out as duplicates (keys are unique within a dataset)."""
    parts = []
    if plan.already_there:
        parts.append(f"{plan.already_there} whose key {out} already holds")
    if plan.repeated:
        parts.append(f"{len(plan.repeated)} listed again on a later row of {src}")
    if parts:
        warnings.warn(
            f"left out {' and '.join(parts)} (keys are unique within a dataset); "
            "allow_duplicates=True (--allow-duplicates) packs them all the same",
            PackWarning,
            stacklevel=5,
        )


def _check_append(out: str, overwrite: bool) -> None:
    if overwrite:
        raise InputError(
            "append=True adds to the dataset in out; overwrite=True replaces it: pick one"
        )
    if is_remote(out):
        raise InputError(
            f"output {out}: append=True adds to a local (or shared) folder, not a URL; append "
            "into a local copy of the dataset, then upload its new shards and its manifest.json "
            "last (docs/remote.md, Growing a dataset in a bucket)"
        )
    if is_url(out):
        raise InputError(f"output {out}: append=True adds to a local (or shared) folder, not a URL")
    if not os.path.isfile(os.path.join(out, MANIFEST_NAME)) and not interrupted_commit(out):
        raise InputError(
            f"output {out!r} holds no dataset ({MANIFEST_NAME}) to append to; pack into it "
            "without append=True"
        )


def _plan(src: str, out: str, o: PackOptions, **how) -> PackPlan:
    """``plan_pack`` of a folder or table with the options ``o`` (``how``: ``existing``,
    ``engine``)."""
    return plan_pack(src, out, o, **how)


def _pack_planned(src, out, o: PackOptions, started: float, seen: _Base) -> PackReport:
    """Plan, run (here on reader threads, or as tasks on ``o.runner``), commit."""
    from ..progress import Progress

    overwrite, workers, on_shard, runner = o.overwrite, o.workers, o.on_shard, o.runner
    shards_per_task, append, plan_only = o.shards_per_task, o.append, o.plan_only

    if getattr(runner, "cluster", False):
        check_cluster_lock(out)
    lock, replaced = open_local_output(out, overwrite or append, src, replacing=not append)
    plan: PackPlan | None = None
    old_keys = None  # an append's: the old dataset's key columns
    try:
        if append:
            base = seen.read(out)  # the up-to-date check's, where the file is still that one
            if base.shard_format != get_format(o.format).name:
                raise InputError(
                    f"{out} holds {base.shard_format} shards; append with format="
                    f'"{base.shard_format}"'
                )
            old_keys = dataset_columns(out, base)  # its key file, else every shard's index
            existing = None if o.allow_duplicates else held_in(out, base, old_keys)
            plan = _plan(src, out, o, existing=existing, engine=runner).appending(base)
            if not len(plan.order):
                _warn_duplicates(plan, src, out)
                return _nothing_to_append(plan, out, started)
        else:
            plan = _plan(src, out, o, engine=runner)
        if plan_only is not None:
            save_tasks(plan.tasks(shards_per_task), plan_only, "the same pack without plan_only")
            return _planned_report(plan, out, started)
        if runner is None:
            bar = Progress(len(plan.order), "pack", "img", enabled=o.progress)
            try:
                receipts = run_task(plan.whole(), workers, on_shard=on_shard, progress=bar.update)
            finally:
                bar.close()
        else:
            tasks = plan.tasks(shards_per_task)
            receipts = list(runner(tasks))
            if on_shard is not None:
                for r in sorted(receipts, key=lambda r: r.shard):
                    if r.samples:
                        on_shard(os.path.join(plan.job, r.path))
        result = commit_pack(plan, receipts, replaced=replaced, old_keys=old_keys)
    except BaseException:
        if plan is not None and runner is None and not interrupted_commit(out):
            shutil.rmtree(plan.job, ignore_errors=True)  # in-process: an error leaves nothing
        raise
    finally:
        lock.release()
    scan, manifest = plan.scan, result.manifest
    skipped = list(scan.errors) + result.task_skipped
    total = len(scan.files) + len(scan.errors)
    _warn_skipped(skipped, total, result.manifest_path, True, stacklevel=4)
    _warn_duplicates(plan, src, out)
    old = len(plan.base.shards) if plan.base is not None else 0
    added = manifest.shards[old:]
    return PackReport(
        out=out,
        manifest_path=result.manifest_path,
        format=manifest.shard_format,
        shards=len(added),
        samples=sum(e.samples for e in added),
        classes=len(manifest.classes),
        bytes=sum(e.bytes for e in added),
        seconds=time.perf_counter() - started,
        skipped=list(manifest.skipped),
        errors=len(skipped),
        not_images=scan.not_images,
        failed_downloads=scan.failed_downloads,
        empty_classes=list(scan.empty_classes),
        appended_to=plan.base.num_samples if plan.base is not None else None,
        duplicates=plan.already_there + len(plan.repeated),
    )


def _nothing_to_append(plan: PackPlan, out: str, started: float) -> PackReport:
    """Every sample of the source is in the dataset already: nothing is written."""
    base = plan.base
    return PackReport(
        out=out,
        manifest_path=os.path.join(out, MANIFEST_NAME),
        format=base.shard_format,
        shards=0,
        samples=0,
        classes=len(base.classes),
        bytes=0,
        seconds=time.perf_counter() - started,
        skipped=list(base.skipped),
        errors=0,
        not_images=plan.scan.not_images,
        failed_downloads=plan.scan.failed_downloads,
        empty_classes=list(plan.scan.empty_classes),
        appended_to=base.num_samples,
        duplicates=plan.already_there + len(plan.repeated),
    )


def _planned_report(plan: PackPlan, out: str, started: float) -> PackReport:
    return PackReport(
        out=out,
        manifest_path="",
        format=plan.options["format"],
        shards=plan.num_shards,
        samples=len(plan.order),
        classes=len(plan.classes or plan.scan.classes),
        bytes=0,
        seconds=time.perf_counter() - started,
        skipped=list(plan.scan.errors),
        errors=len(plan.scan.errors),
        not_images=plan.scan.not_images,
        failed_downloads=plan.scan.failed_downloads,
        empty_classes=list(plan.scan.empty_classes),
        up_to_date=False,
    )


@dataclass
class _Run:
    """One source made ready for the write loop: the tasks, their loader, and what to report."""

    name: str
    total: int
    tasks: Iterable[Any]
    load: Callable[[Any], list]
    describe: Callable[[int], str]  # position -> what an error names (a path, a sample)
    skip_name: Callable[[int, str], str]  # (position, key) -> its name in 'skipped'
    shuffled: bool
    errors: list[SkippedFile]
    ignored: list[SkippedFile]
    not_images: int = 0
    empty_classes: Sequence[str] = ()


def _pack_to_url(src, writer: ShardWriter, o: PackOptions, started: float) -> PackReport:
    """A folder into a URL: the same plan and tasks as a local pack, run here into the writer's
    local staging; each shard uploads under its final key as it completes, the manifest last."""
    from ..progress import Progress

    workers, on_shard = o.workers, o.on_shard
    plan = _plan(src, writer.staging, o)  # the job folder: inside the local staging
    writer.classes = list(plan.scan.classes)

    def done(path: str) -> None:  # its receipt is written: its entry, for the key file
        receipt = done_receipt(os.path.dirname(path), shard_number(path))
        writer.upload(path, receipt.entry() if receipt is not None else None)
        if on_shard is not None:
            on_shard(path)

    bar = Progress(len(plan.order), "pack", "img", enabled=o.progress)
    try:
        receipts = run_task(plan.whole(), workers, on_shard=done, progress=bar.update)
    finally:
        bar.close()
    fields: dict[str, int] = {}
    for r in receipts:
        for name, count in r.fields:
            fields[name] = fields.get(name, 0) + count
    writer.add_shards(
        [r.entry() for r in receipts if r.samples],
        fields,
    )
    scan = plan.scan
    task_skipped = [SkippedFile(p, why) for r in receipts for p, why in r.skipped]
    skipped = list(scan.errors) + task_skipped
    total = len(scan.files) + len(scan.errors)
    if not writer.samples:
        first = skipped[0]
        raise InputError(
            f"source {src}: none of its {total} images could be packed (first: {first.path}: "
            f"{first.reason}); see validate= and on_error="
        )
    writer.skipped = skipped + list(scan.ignored)
    writer.pack_info = dict(plan.pack_info)
    done_report = writer.close()
    _warn_skipped(skipped, total, done_report.manifest_path, True, stacklevel=4)
    return _written_report(done_report, writer, skipped, scan, started)


def _samples_run(source, writer, o: PackOptions) -> _Run:
    """A Python source's samples, read in ``o``'s order and checked by its ``validate``."""
    validate, resize_short = o.validate, o.resize_short
    if writer.classes is None:
        names = getattr(source, "classes", None)
        if isinstance(names, (list, tuple)) and all(isinstance(c, str) for c in names):
            writer.classes = list(names)
    name = f"<{type(source).__name__}>"
    tasks, n, shuffled = _samples.tasks(source, o, READ_BATCH)
    return _Run(
        name=name,
        total=n,
        tasks=tasks,
        load=_samples.loader(source, lambda d, e: check_sample(d, e, validate, resize_short)),
        describe=lambda i: f"sample {i} of {name}",
        skip_name=lambda i, key: key,
        shuffled=shuffled,
        errors=[],
        ignored=[],
    )


def _write(run: _Run, writer: ShardWriter, o: PackOptions):
    """The main-thread loop: consume reads in pack order into the writer (which rolls shards),
    on ``o.workers`` reader threads; a bad sample is skipped or raised by ``o.on_error``."""
    from ..progress import Progress

    on_error, workers, progress = o.on_error_mode, o.workers, o.progress

    errors: list[SkippedFile] = []
    bar = Progress(run.total if run.total >= 0 else None, "pack", "img", enabled=progress)
    t0 = time.perf_counter()
    done_bytes = seen = 0
    try:
        for results in ordered_map(run.load, run.tasks, workers, READ_AHEAD * workers):
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
