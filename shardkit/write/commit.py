"""Commit a pack's plan: its tasks' receipts checked and published with the manifest, all or
nothing, manifest last.

``commit_pack`` (the driver, holding OUT's lock) refuses unless the receipts cover every planned
shard exactly once (``check_receipts``); ``check_cluster_lock`` refuses an OUT whose file lock
would not hold across machines; ``remove_other_jobs`` clears the job folders of other plans.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import InputError, OutputError
from ..formats.sample_index import ensure_indexes
from ..fsutil import JOURNAL_NAME, interrupted_commit, publish, write_error
from ..manifest import MANIFEST_NAME, Manifest, SkippedFile, write_manifest
from .keyfile import (
    KEYS_NAME,
    KeyColumns,
    dataset_columns,
    grow_key_file,
    new_columns,
    write_key_file,
)
from .plan import APPENDED_FIELD, JOB_PREFIX, PackPlan, ShardReceipt
from .read import stat_pair

__all__ = [
    "CommitResult",
    "check_cluster_lock",
    "check_receipts",
    "commit_pack",
    "remove_other_jobs",
]


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
    plan: PackPlan,
    receipts: Iterable[ShardReceipt],
    *,
    replaced: Sequence[str] = (),
    old_keys: Sequence[KeyColumns] | None = None,
) -> CommitResult:
    """Publish the job's shards, the key file and the manifest ``pack`` writes, all or nothing,
    manifest last.

    The caller holds OUT's lock (``writer.open_local_output``); ``replaced`` are the old
    dataset's shards, deleted by the commit. An append's key file is the old dataset's runs
    (``old_keys``, which its duplicate check searched; else read here) and one run of the new
    shards' keys (``keyfile.grow_key_file``: the newest runs merged into it while it is large
    enough). Other plans' job folders are removed afterwards.
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
        manifest.keys, written, gone = _key_file(plan, manifest, entries, old_keys)
        write_manifest(manifest, plan.job)
    except OSError as exc:
        raise write_error(out, exc, MANIFEST_NAME) from None
    names = [e.path for e in entries] + written
    try:
        path = publish(out, plan.job, names, MANIFEST_NAME, remove=[*replaced, *gone])
    except OSError as exc:
        if interrupted_commit(out) is not None:
            raise OutputError(
                f"cannot finish the commit in {out!r}: {exc.strerror or exc}; packing into it "
                "again completes it"
            ) from None
        raise write_error(out, exc, f"the commit journal {JOURNAL_NAME}") from None
    remove_other_jobs(out)
    return CommitResult(path, manifest, task_skipped)


def _key_file(plan: PackPlan, manifest: Manifest, entries: list, old_keys) -> tuple:
    """The grown (or new) dataset's key file, written into the job folder: the new shards'
    columns (their indexes, just written: O(new)) as one base file, or as a run after the
    old dataset's runs (``old_keys``, else its key file or indexes); ``(keys, names written,
    names removed)``."""
    first = len(plan.base.shards) if plan.base is not None else 0
    new = new_columns(plan.job, manifest.shard_format, entries, first)
    if plan.base is None:
        return write_key_file(plan.job, [new], manifest.shards), [KEYS_NAME], [KEYS_NAME]
    old = old_keys if old_keys is not None else dataset_columns(plan.out, plan.base)
    return grow_key_file(plan.job, (plan.out, plan.base), old, [new], manifest.shards)


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


def remove_other_jobs(out: str, keep: str = "") -> None:
    """Job folders of other plans in ``out`` (their receipts can never be used): removed.
    The caller holds ``out``'s lock, so no job is running there."""
    for name in os.listdir(out):
        if name.startswith(JOB_PREFIX) and name != keep:
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
