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
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InputError, OutputError
from ..fsutil import publish, staging_name, write_error
from ..manifest import MANIFEST_NAME, Manifest, ShardEntry, read_manifest, write_manifest
from ..urls import is_url
from .writer import _within, open_local_output, shard_name

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

    def summary(self) -> str:
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


def merge(datasets: Sequence[str | os.PathLike], out: str | os.PathLike) -> MergeReport:
    """Join ``datasets`` (local dataset folders) into ``out``: a new folder, or the first
    dataset itself to merge in place. See the module docstring."""
    paths = [os.fspath(d) for d in datasets]
    out = os.fspath(out)
    if len(paths) < 2:
        raise InputError("merge needs at least two datasets")
    for p in [*paths, out]:
        if is_url(p):
            raise InputError(f"{p}: merge joins local (or shared) folders, not URLs")
    manifests = [(p, read_manifest(p)) for p in paths]
    fmt = manifests[0][1].shard_format
    for p, m in manifests[1:]:
        if m.shard_format != fmt:
            raise InputError(
                f"{p} holds {m.shard_format} shards and {paths[0]} {fmt}; merge "
                "datasets of one format"
            )
    classes = _classes(manifests)
    in_place = os.path.realpath(out) == os.path.realpath(paths[0])
    for p in paths[1 if in_place else 0 :]:
        if os.path.realpath(p) == os.path.realpath(out) or _within(out, p):
            raise InputError(f"output {out!r} is inside the dataset {p!r}; choose another output")
    lock, replaced = open_local_output(out, in_place, None)
    staging = os.path.join(out, staging_name())
    try:
        os.mkdir(staging)
        return _merge(manifests, out, staging, fmt, classes, in_place, replaced)
    except OSError as exc:
        raise write_error(out, exc, "shards") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        lock.release()


def _merge(manifests, out, staging, fmt, classes, in_place, replaced) -> MergeReport:
    entries: list[ShardEntry] = []
    added, linked = [], 0
    skipped = []
    if in_place:
        base = manifests[0][1]
        entries = list(base.shards)
        todo = manifests[1:]
        pack = dict(base.pack)
        replaced = []  # nothing of A is touched
    else:
        todo = manifests
        pack = {}
    merged = list(pack.get(MERGED_FIELD, []))
    number = max((_number(e.path) for e in entries), default=-1) + 1
    for path, m in todo:
        for s in m.shards:
            src = os.path.join(path, s.path)
            if not os.path.isfile(src) or os.path.getsize(src) != s.bytes:
                raise OutputError(
                    f"{src}: missing or not the {s.bytes} bytes its manifest says; "
                    f"`shardkit verify {path}` says more"
                )
            name = shard_name(number, "") + _suffix(s.path)
            number += 1
            linked += _place(src, os.path.join(staging, name))
            entries.append(ShardEntry(name, s.samples, s.bytes, s.sha256, s.index))
            added.append(name)
        skipped += m.skipped
        merged.append({"dataset": os.path.abspath(path), "pack": m.pack})
    if in_place:
        skipped = list(manifests[0][1].skipped) + skipped
    pack[MERGED_FIELD] = merged
    fields: dict[str, int] = {}
    for m in [manifests[0][1]] * in_place + [m for _, m in todo]:  # every dataset merged
        for name, count in m.fields.items():
            fields[name] = fields.get(name, 0) + count
    manifest = Manifest(fmt, classes, entries, skipped, pack, fields=fields)
    write_manifest(manifest, staging)
    path = publish(out, staging, added, MANIFEST_NAME, remove=replaced)
    return MergeReport(out, path, len(entries), manifest.num_samples, len(added), linked)


def _number(path: str) -> int:
    digits = os.path.basename(path).removeprefix("shard-").split(".", 1)[0]
    return int(digits) if digits.isdigit() else -1


def _suffix(path: str) -> str:
    """``.tar``, ``.lmdb``, ``.tar.gz``: a shard's name ending, kept as it was."""
    name = os.path.basename(path)
    return name[name.index(".") :] if "." in name else ""
