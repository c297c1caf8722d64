"""``shardkit merge``: datasets whose formats and class lists agree, joined into one.

Shards are never rewritten: each is hard-linked (copied across filesystems) into the output
under the next free ``shard-NNNNNN`` name, and one manifest lists them all, published with the
commit journal like a pack (all or nothing, manifest last). Merged into the first dataset
itself (OUT is A), A's shards stay where they are and only the others' are added.

Labels are stored inside the shards, so the class lists must agree: each dataset's class ``i``
must be the merged list's class ``i`` (a later dataset may add classes after the others). Two
lists that disagree are refused; the fix is to pack the other source folder into A with
``shardkit pack SRC A --append``, which maps its classes by name.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InputError, OutputError
from ..formats.sample_index import ensure_indexes, index_path
from ..fsutil import STAGING_PREFIX, publish, staging_name, write_error
from ..manifest import MANIFEST_NAME, Manifest, ShardEntry, read_manifest, write_manifest
from ..urls import is_url
from .keyfile import (
    KEYS_NAME,
    KeyColumns,
    dataset_columns,
    grow_key_file,
    read_whole,
    shared_keys,
    write_key_file,
)
from .keys import identity
from .writer import _within, next_shard_number, open_local_output, shard_name

__all__ = ["MERGED_FIELD", "MergeReport", "merge"]

#: The manifest's ``pack`` key listing the datasets merged in (path and their ``pack``).
MERGED_FIELD = "merged_from"


@dataclass
class MergeReport:
    out: str
    manifest_path: str
    shards: int
    samples: int
    added_shards: int
    linked: int
    #: True when ``out`` already held this merge: nothing was written.
    up_to_date: bool = False

    def summary(self) -> str:
        if self.up_to_date:
            return (
                f"{self.out} is up to date: {self.samples} samples in {self.shards} shards, "
                "these datasets merged already; nothing to do. "
                f"Manifest: {self.manifest_path}"
            )
        return (
            f"Merged into {self.out}: {self.samples} samples in {self.shards} shards "
            f"({self.added_shards} added, {self.linked} of them hard-linked, the rest copied). "
            f"Manifest: {self.manifest_path}"
        )


def _classes(manifests: Sequence[tuple[str, Manifest]]) -> list[str]:
    """The merged class list; an ``InputError`` naming both datasets where two disagree."""
    first, merged = manifests[0][0], list(manifests[0][1].classes)
    for path, m in manifests[1:]:
        for i, name in enumerate(m.classes):
            if i < len(merged) and merged[i] != name:
                raise InputError(
                    f"{path}: class {i} is {name!r} there and {merged[i]!r} in {first}; labels "
                    "are stored in the shards, so these datasets cannot be joined as they are: "
                    f"pack that dataset's source folder into {first} with `shardkit pack SRC "
                    f"{first} --append`, which maps classes by name"
                )
            if i >= len(merged):
                if name in merged:
                    raise InputError(
                        f"{path}: class {name!r} is label {i} there and {merged.index(name)} in "
                        f"{first}; pack its source folder with `shardkit pack SRC {first} "
                        "--append`, which maps classes by name"
                    )
                merged.append(name)
    return merged


def _place(src: str, dst: str) -> bool:
    """Hard-link ``src`` at ``dst`` (shards are immutable), or copy it; True when linked."""
    try:
        os.link(src, dst)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    shutil.copyfile(src, dst)
    return False


def merge(
    datasets: Sequence[str | os.PathLike], out: str | os.PathLike, *, allow_duplicates: bool = False
) -> MergeReport:
    """Join ``datasets`` (local dataset folders) into ``out``: a new folder, or the first
    dataset itself to merge in place. See the module docstring.

    The same command again (after it finished, or was killed at any point) finishes or
    recognises its merge: a dataset whose shards ``out`` already merged in is not added twice.
    The same dataset twice (a path, a link to it, a copy of its shards) is refused; so are
    datasets sharing a key, unless ``allow_duplicates``."""
    paths = [os.fspath(d) for d in datasets]
    out = os.fspath(out)
    if len(paths) < 2:
        raise InputError("merge needs at least two datasets")
    if is_url(out):
        raise InputError(
            f"output {out}: merge joins into a local (or shared) folder, not a URL; merge into "
            "a local copy of the dataset, then upload its new shards and its manifest.json last "
            "(docs/remote.md, Growing a dataset in a bucket)"
        )
    for p in paths:
        if is_url(p):
            raise InputError(f"{p}: merge joins local (or shared) folders, not URLs")
    _check_distinct(paths)
    in_place = os.path.isdir(out) and _same_folder(out, paths[0])
    for p in paths[1 if in_place else 0 :]:
        if _same_folder(p, out) or _within(out, p):
            raise InputError(f"output {out!r} is inside the dataset {p!r}; choose another output")
    for p in paths[1:]:
        if _within(p, out) and not in_place:
            raise InputError(f"dataset {p!r} is inside the output {out!r}; choose another output")
    # finishes a commit killed after its point; the old files are kept (replaced is empty)
    lock, _ = open_local_output(out, True, None, replacing=False)
    staging = os.path.join(out, staging_name())
    try:
        manifests = [(p, read_manifest(p)) for p in paths]
        _check_formats(manifests)
        done = _already_merged(out, manifests, in_place)
        if done is not None:
            return done
        classes = _classes(manifests)
        os.mkdir(staging)
        return _merge(manifests, out, staging, classes, in_place, allow_duplicates)
    except OSError as exc:
        raise write_error(out, exc, "shards") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        lock.release()


def _same_folder(a: str, b: str) -> bool:
    """One folder under two names (a symbolic link, a bind mount, ``..`` detours)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _check_distinct(paths: list[str]) -> None:
    for i, p in enumerate(paths):
        for q in paths[:i]:
            if _same_folder(p, q):
                raise InputError(
                    f"{p} and {q} are the same dataset; merging it twice would hold every "
                    "sample twice: name each dataset once"
                )


def _check_formats(manifests) -> None:
    """One shard format; and no dataset twice under two folders (a copy of its shards)."""
    first, fmt = manifests[0][0], manifests[0][1].shard_format
    ids: dict[str, str] = {}
    for p, m in manifests:
        twin = ids.setdefault(identity(m), p)
        if twin != p:
            raise InputError(
                f"{p} and {twin} hold the same shards (a copy of one dataset); merging both "
                "would hold every sample twice: name it once"
            )
    for p, m in manifests[1:]:
        if m.shard_format != fmt:
            raise InputError(
                f"{p} holds {m.shard_format} shards and {first} {fmt}; merge datasets of one format"
            )


def _merged_ids(manifest: Manifest) -> list:
    return [d.get("identity") for d in manifest.pack.get(MERGED_FIELD, []) if isinstance(d, dict)]


def _already_merged(out: str, manifests, in_place: bool) -> MergeReport | None:
    """The report of a merge ``out`` already holds (this command, run before); None to merge.

    A new ``out`` must be empty, or hold exactly this merge; merged in place, the datasets whose
    shards the first one already took in are left out (if all are: nothing to do)."""
    ids = [identity(m) for _, m in manifests]
    if in_place:
        base = manifests[0][1]
        recorded = set(_merged_ids(base))
        if not all(i in recorded for i in ids[1:]):
            return None
        current = base
    else:
        current = None
        if os.path.isfile(os.path.join(out, MANIFEST_NAME)):
            current = read_manifest(out)
            if _merged_ids(current) != ids:
                current = None
        if current is None:
            leftovers = [n for n in os.listdir(out) if not n.startswith(STAGING_PREFIX)]
            if not leftovers:
                return None
            raise OutputError(
                f"output directory {out!r} is not empty and holds no merge of these datasets; "
                "merge into an empty (or new) folder, or into the first dataset itself"
            )
    path = os.path.join(out, MANIFEST_NAME)
    n = len(current.shards)
    return MergeReport(out, path, n, current.num_samples, 0, 0, up_to_date=True)


def _merge(manifests, out, staging, classes, in_place, allow_duplicates) -> MergeReport:
    entries: list[ShardEntry] = []
    added, linked = [], 0
    unchecked = set()  # shards whose index is checked (or built) before publishing
    skipped = []
    base = manifests[0][1]
    if in_place:
        entries = list(base.shards)
        recorded = set(_merged_ids(base))
        todo = [(p, m) for p, m in manifests[1:] if identity(m) not in recorded]
        pack = dict(base.pack)
    else:
        todo = manifests
        pack = {}
    datasets = [(out, base), *todo] if in_place else list(todo)
    # each one's key file, else its shards' indexes (each hash column checked by its keys)
    columns = [dataset_columns(p, m) for p, m in datasets]
    if not allow_duplicates:
        _check_keys(datasets, columns)
    merged = list(pack.get(MERGED_FIELD, []))
    number = next_shard_number(out, [e.path for e in entries])
    for path, m in todo:
        for s in m.shards:
            src = os.path.join(path, s.path)
            if _file_size(src) != s.bytes:
                raise OutputError(
                    f"{src}: missing or not the {s.bytes} bytes its manifest says; "
                    f"`shardkit verify {path}` says more"
                )
            name = shard_name(number, "") + _suffix(s.path)
            number += 1
            linked += _place(src, os.path.join(staging, name))
            index_sha256 = ""
            # an LMDB shard's index record is inside it: the same bytes, the same columns
            columns_sha256 = s.columns_sha256 if not s.index_sha256 else ""
            if os.path.isfile(index_path(src)):
                _place(index_path(src), index_path(os.path.join(staging, name)))
                # the same bytes: checked wherever they are read
                index_sha256, columns_sha256 = s.index_sha256, s.columns_sha256
            entries.append(
                ShardEntry(
                    name, s.samples, s.bytes, s.sha256, s.index, index_sha256, columns_sha256
                )
            )
            if not index_sha256:  # an older pack's, or none
                unchecked.add(name)
            added.append(name)
        skipped += m.skipped
        merged.append({"dataset": os.path.abspath(path), "identity": identity(m), "pack": m.pack})
    if in_place:
        skipped = list(base.skipped) + skipped
    pack[MERGED_FIELD] = merged
    fields: dict[str, int] = {}
    for m in [base] * in_place + [m for _, m in todo]:  # every dataset merged
        for name, count in m.fields.items():
            fields[name] = fields.get(name, 0) + count
    # their indexes checked (or built): the manifest lists their sha256; the others' index files
    # are the bytes their own manifest lists (linked or copied), as every reader checks them
    checked = iter(ensure_indexes(staging, [e for e in entries if e.path in unchecked]))
    entries = [next(checked) if e.path in unchecked else e for e in entries]
    manifest = Manifest(base.shard_format, classes, entries, skipped, pack, fields=fields)
    # the datasets merged in are read whole (their runs' sha256 checked); the one merged into
    # in place keeps its runs, and gains one of the others' keys (``grow_key_file``)
    offsets = np.cumsum([0, *(len(m.shards) for _, m in datasets)]).tolist()
    parts = [
        [replace(c, offset=o) for c in (cols if in_place and not i else read_whole(d, m, cols))]
        for i, ((d, m), cols, o) in enumerate(zip(datasets, columns, offsets[:-1], strict=True))
    ]
    if in_place:
        others = [c for cols in parts[1:] for c in cols]
        manifest.keys, written, gone = grow_key_file(
            staging, (out, base), parts[0], others, entries
        )
    else:
        flat = [c for cols in parts for c in cols]
        manifest.keys, written, gone = (
            write_key_file(staging, flat, entries),
            [KEYS_NAME],
            [KEYS_NAME],
        )
    write_manifest(manifest, staging)
    path = publish(out, staging, [*added, *written], MANIFEST_NAME, remove=gone)
    return MergeReport(out, path, len(entries), manifest.num_samples, len(added), linked)


def _check_keys(datasets: list[tuple[str, Manifest]], columns: list[list[KeyColumns]]) -> None:
    """Refuse datasets sharing a key (with the first one merged into, or with each other): by
    their key files (``keyfile.shared_keys``; each hash both hold confirmed on the real keys of
    the one shard on each side holding it), no shard's bytes read."""
    for i in range(1, len(datasets)):
        found: dict[int, str] = {}  # position in dataset i -> its key another one holds
        for j in range(i):
            mine, theirs = (*datasets[i], columns[i]), (*datasets[j], columns[j])
            for p, key in shared_keys(mine, theirs):
                found.setdefault(p, key)
        if found:
            raise InputError(
                f"{datasets[i][0]}: {len(found)} of its keys are in another dataset of this "
                f"merge too (first: {found[min(found)]!r}); keys are unique within a dataset: "
                "leave it out, or pass allow_duplicates=True to keep both copies"
            )


def _file_size(path: str) -> int | None:
    """The size of the regular file at ``path`` (one ``stat``); None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _suffix(path: str) -> str:
    """``.tar``, ``.lmdb``, ``.tar.gz``: a shard's name ending, kept as it was."""
    name = os.path.basename(path)
    return name[name.index(".") :] if "." in name else ""
