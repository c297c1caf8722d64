"""``shardkit index``: a manifest for tar shards written elsewhere, without rewriting them.

Tars made by webdataset, GNU tar or any WebDataset-convention tool stream without a manifest,
but then ``len()`` needs a header pass at construction, nothing can be checked, and a worker
starting mid-shard reads the whole prefix. One pass over each tar here (headers parsed, every
byte hashed) records what a pack would have: sample counts, sizes, sha256, the sparse offset
index, and classes from ``cls`` members. The manifest goes beside the shards it lists (one per
directory), written atomically, and an existing one is only replaced on request.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import InputError, OutputError
from ..formats import format_for_path, is_shard_name
from ..formats.sample_index import encode_tally, index_digests, index_path, write_index_file
from ..formats.tar import is_gzip_name, tally_tar, warn_imageless
from ..fsutil import HashingReader, open_regular, write_error
from ..manifest import (
    INDEX_EVERY,
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    read_manifest,
    write_manifest,
)

__all__ = ["IndexResult", "index_shards"]

#: Labels at or above this are not taken as class indices (a list that long is not a class list).
MAX_CLASSES = 1 << 20


@dataclass
class IndexResult:
    """One manifest written: where, and what it lists."""

    manifest_path: str
    manifest: Manifest
    #: Records without an image member, passed over (not samples).
    imageless: int
    #: The manifest was shardkit's and kept: only the sample indexes were written.
    kept: bool = False
    #: ``append=True``: the shards added to the manifest (0: it listed every shard given).
    added: int | None = None
    #: ``rehash=True``: the shards whose sample index was written anew (0: none needed it).
    rehashed: int | None = None

    def summary(self) -> str:
        m = self.manifest
        if self.rehashed is not None:
            if not self.rehashed:
                return (
                    f"every sample index beside {self.manifest_path} holds per-sample digests "
                    "already: nothing to rewrite"
                )
            n = self.rehashed
            return (
                f"rewrote {n} sample index{'es' if n != 1 else ''} beside {self.manifest_path} "
                f"with per-sample digests ({len(m.shards)} shards, {m.num_samples} samples); "
                "the manifest lists their checksums"
            )
        n = self.imageless
        extra = f", {n} record{'s' if n != 1 else ''} without an image passed over" if n else ""
        if self.added is not None:
            if not self.added:
                return f"{self.manifest_path} lists every shard given: nothing new to index"
            return (
                f"added {self.added} shard{'s' if self.added != 1 else ''} to "
                f"{self.manifest_path}: {len(m.shards)} shards, {m.num_samples} samples now"
                f"{extra}"
            )
        if self.kept:
            return (
                f"wrote the sample indexes of {len(m.shards)} shards ({m.num_samples} samples) "
                f"beside {self.manifest_path}, which is kept"
            )
        return (
            f"indexed {len(m.shards)} shard{'s' if len(m.shards) != 1 else ''}: "
            f"{m.num_samples} samples, {m.total_bytes / 1e6:.1f} MB, {len(m.classes)} classes"
            f"{extra} -> {self.manifest_path}"
        )


def _expand(paths: Sequence[str]) -> list[str]:
    """Shard files as given; a directory stands for the tar shards in it, sorted by name."""
    out: list[str] = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            found = sorted(
                os.path.join(p, n)
                for n in os.listdir(p)
                if is_shard_name(n) and not n.startswith(".")
            )
            if not found:
                raise InputError(f"{p}: no .tar, .tar.gz or .tgz files in this directory")
            out.extend(found)
        elif not os.path.isfile(p):
            what = "not a regular file" if os.path.exists(p) else "no such shard file"
            raise InputError(f"{p}: {what}; check the path")
        else:
            out.append(p)
    if not out:
        raise InputError("no shards given: pass tar files or a directory of them")
    return out


def index_shards(
    paths: Sequence[str | os.PathLike],
    *,
    overwrite: bool = False,
    append: bool = False,
    rehash: bool = False,
    progress: bool = False,
) -> list[IndexResult]:
    """Write ``manifest.json`` beside the given tar shards (one per directory), reading each once.

    ``paths``: tar shards (``.tar``, ``.tar.gz``, ``.tgz``) or directories of them; the manifest
    lists them in the order given (a directory's in name order). Classes are ``"0" .. "K-1"``
    when ``cls``/``label`` members hold integers up to K-1, else empty (labels -1). Compressed
    shards get counts and checksums but no offset index (they cannot seek). Raises OutputError
    if a manifest already exists there, unless ``overwrite=True`` (``--overwrite``: every shard
    read again) or ``append=True`` (``--append``: only the shards it does not list are read and
    added after the others, O(the new shards); ``append_shards``). ``rehash=True``
    (``--rehash``): a dataset made before sample digests gets them: each tar shard whose index
    is missing or of an older version is read once, checked against its manifest entry, and its
    index written anew; then the manifest's ``index_sha256``/``columns_sha256`` (``rehash``).
    """
    from ..progress import track

    if sum((overwrite, append, rehash)) > 1:
        raise InputError("pass one of append=True, overwrite=True and rehash=True")
    if rehash:  # whole datasets: each directory given, or each shard's
        dirs = [p if os.path.isdir(p) else os.path.dirname(p) or "." for p in map(os.fspath, paths)]
        return [rehash_indexes(os.path.abspath(d), progress) for d in dict.fromkeys(dirs)]
    files = _expand([os.fspath(p) for p in paths])
    by_dir = _by_dir(files)
    grown: list[IndexResult] = []
    if append:  # directories with a manifest grow; any other is indexed as without append
        grown = [
            append_shards(d, m, by_dir.pop(d), progress) for d, m in _manifests(by_dir).items()
        ]
        files = [p for p in files if os.path.dirname(os.path.abspath(p)) in by_dir]
        if not files:
            return grown
    packed = _packed(by_dir, overwrite)
    if packed:  # shardkit's own datasets: add the sample indexes, keep the manifests
        return [_index_packed(d, m, progress) for d, m in packed.items()]

    indexes: list[tuple[str, bytes]] = []  # written once every shard was read
    entries: dict[str, list[ShardEntry]] = {d: [] for d in by_dir}
    labels: set[int] = set()
    imageless: dict[str, int] = dict.fromkeys(by_dir, 0)
    fields: dict[str, dict[str, int]] = {d: {} for d in by_dir}
    for p in track(files, "index", "shard", enabled=progress):
        d = os.path.dirname(os.path.abspath(p))
        tally, size, sha, sample_index = _read_tar(p)
        if sample_index:
            indexes.append((p, sample_index))
        labels |= tally.labels
        imageless[d] += tally.imageless
        for name, n in tally.fields.items():
            fields[d][name] = fields[d].get(name, 0) + n
        index = () if is_gzip_name(p) else tuple(tally.index[::INDEX_EVERY])
        digests = index_digests(sample_index, tally.samples) if sample_index else {}
        entries[d].append(
            ShardEntry(os.path.basename(p), tally.samples, size, sha, index, **digests)
        )
    classes = _classes(labels)
    results = []
    for d, shard_entries in entries.items():
        manifest = Manifest(
            "tar",
            classes,
            shard_entries,
            pack={"indexed_by": "shardkit index", "records_without_image": imageless[d]},
            fields=dict(sorted(fields[d].items())),
        )
        if imageless[d]:
            warn_imageless(d, imageless[d])
        mine = [(p, data) for p, data in indexes if os.path.dirname(os.path.abspath(p)) == d]
        path = _publish(d, manifest, mine)
        results.append(IndexResult(path, manifest, imageless[d]))
    return grown + results


def _by_dir(files: list[str]) -> dict[str, list[str]]:
    """The tar shards given, by directory; each named once."""
    by_dir: dict[str, list[str]] = {}
    seen: set[str] = set()
    for p in files:
        real = os.path.realpath(p)
        if real in seen:
            raise InputError(f"{p}: listed twice; each shard must appear once")
        seen.add(real)
        if format_for_path(p).name != "tar":
            raise InputError(
                f"{p}: shardkit index reads tar shards (.tar, .tar.gz, .tgz); LMDB shards are "
                "only written by `shardkit pack`, which writes their manifest"
            )
        by_dir.setdefault(os.path.dirname(os.path.abspath(p)), []).append(p)
    return by_dir


def _publish(d: str, manifest: Manifest, indexes: list[tuple[str, bytes]]) -> str:
    """The sample indexes, then the manifest listing their sha256 (last: its presence means
    complete); a failed write leaves neither (a disk full, a read-only folder: one line)."""
    what = "sample indexes"
    try:
        for p, data in indexes:
            write_index_file(p, data)
        what = MANIFEST_NAME
        return write_manifest(manifest, d)
    except OSError as exc:
        for p, _ in indexes:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(index_path(p))
        raise write_error(d, exc, what) from None


def _classes(labels: set[int]) -> list[str]:
    """``"0" .. "K-1"`` for integer labels 0..K-1 (a foreign tar has no class names); -1 is
    "no label" (FORMAT.md), as for a sample without a label member."""
    labels = labels - {-1}
    if not labels:
        return []
    low, high = min(labels), max(labels)
    if low < 0 or high >= MAX_CLASSES:
        warnings.warn(
            f"labels range over {low}..{high}: not class indices, so the manifest lists no "
            "classes (labels are still read as stored)",
            RuntimeWarning,
            stacklevel=3,
        )
        return []
    return [str(i) for i in range(high + 1)]


def _packed(by_dir: dict[str, list[str]], overwrite: bool) -> dict[str, Manifest]:
    """The directories whose manifest a pack wrote (they get sample indexes, nothing else)."""
    packed = {}
    for d in by_dir:
        target = os.path.join(d, MANIFEST_NAME)
        if os.path.lexists(target) and not overwrite:
            packed[d] = _listed(target, by_dir[d])
            if packed[d].pack.get("indexed_by"):  # ours from a tar: replaced only on request
                raise OutputError(
                    f"{target} already exists and lists every shard given: nothing new to "
                    "index (a tar added to the folder later is added by append=True; "
                    "overwrite=True reads every shard again)"
                )
    return packed


def _read_tar(p: str):
    """One pass over a tar: its tally (labels, fields, keys, offsets), size, sha256 and the
    bytes of its sample index (None for a compressed or empty shard)."""
    try:
        raw = open_regular(p, buffering=0)
    except OSError as exc:
        raise InputError(f"{p}: cannot read ({exc.strerror}); pass tar files") from None
    with raw:
        hashing = HashingReader(raw)
        tally = tally_tar(
            hashing, shard=p, labels=True, fields=True, every=1, keys=True, members=True
        )
        hashing.drain()
    sha = hashing.sha.hexdigest()
    data = None
    if not is_gzip_name(p) and tally.samples:
        data = encode_tally(tally, hashing.bytes, sha, p)
    return tally, hashing.bytes, sha, data


def _listed(target: str, files: list[str]) -> Manifest:
    """The manifest already beside ``files``: shardkit's, listing each of them (a pack's
    dataset gets its sample indexes); else the manifest is someone else's to replace."""
    manifest = read_manifest(target)
    listed = {e.path for e in manifest.shards}
    new = [f for f in files if os.path.basename(f) not in listed]
    if new:
        raise OutputError(
            f"{target} already exists and does not list {os.path.basename(new[0])}"
            f"{f' and {len(new) - 1} more' if len(new) > 1 else ''}: append=True adds the "
            "shards it does not list (reading only those); overwrite=True replaces it"
        )
    return manifest


def rehash_indexes(d: str, progress: bool = False) -> IndexResult:
    """``shardkit index --rehash D``: give the dataset in ``d`` (a pack's, or one ``shardkit
    index`` made) sample digests without rewriting a shard. Each tar shard whose index is not
    the current version with the manifest's ``index_sha256`` (missing, older, or another) is
    read once and checked against its manifest entry (size, sha256, count), and its index
    written anew (a temporary name, then a rename); then the manifest, atomically, with each
    index's ``index_sha256`` and ``columns_sha256``. Interrupted anywhere, readers meet either
    the old manifest (an index it does not list is read around, with a warning) or the new
    one; running it again finishes the job and gives the same bytes. LMDB shards hold their
    digests inside: they are packed again instead (``shardkit pack``). A folder of tars
    without a manifest is indexed as ``shardkit index D`` indexes it."""
    path = os.path.join(d, MANIFEST_NAME)
    if not os.path.lexists(path):  # foreign tars: indexed as without --rehash, digests and all
        (result,) = index_shards([d], progress=progress)
        return replace(result, rehashed=len(result.manifest.shards))
    manifest = read_manifest(path)
    if manifest.shard_format != "tar":
        raise InputError(
            f"{d}: holds {manifest.shard_format} shards, whose sample digests live inside each "
            "shard: pack the dataset again (`shardkit pack`) to add them"
        )
    kept = [e.path for e in manifest.shards if _is_current(os.path.join(d, e.path), e)]
    result = _index_packed(d, manifest, progress, current=_is_current)
    tars = [e for e in manifest.shards if e.path.endswith(".tar")]
    return replace(result, rehashed=len(tars) - len(kept))


def _is_current(p: str, e: ShardEntry) -> bool:
    """Whether the index beside shard ``p`` is the current version and the one ``e`` lists."""
    import hashlib

    from ..formats.sample_index import VERSION, read_local

    data = read_local(index_path(p))
    return (
        data is not None
        and bool(e.index_sha256)
        and len(data) > 12
        and int.from_bytes(data[8:12], "little") == VERSION
        and hashlib.sha256(data).hexdigest() == e.index_sha256
        and e.columns_sha256 == index_digests(data, e.samples)["columns_sha256"]
    )


def _index_packed(d: str, manifest: Manifest, progress: bool, current=None) -> IndexResult:
    """Write the sample index of each plain tar shard ``manifest`` lists (older packs have
    none), reading each shard once and checking it against the manifest's size and sha256;
    then, where the manifest lacks their sha256 (an older pack), replace it atomically by the
    same manifest with them added (interrupted, the old one stays, and a rerun finishes).
    ``current(path, entry)``: where true, the shard's index is kept as it is (not read)."""
    from ..progress import track

    entries = []
    for e in track(manifest.shards, "index", "shard", enabled=progress):
        p = os.path.join(d, e.path)
        if not e.path.endswith(".tar") or (current is not None and current(p, e)):
            entries.append(e)
            continue
        with open_regular(p, buffering=0) as raw:
            hashing = HashingReader(raw)
            tally = tally_tar(hashing, shard=p, every=1, keys=True, members=True)
            hashing.drain()
        if (hashing.bytes, hashing.sha.hexdigest(), tally.samples) != (
            e.bytes,
            e.sha256,
            e.samples,
        ):
            raise InputError(
                f"{p}: is not the shard its manifest lists (size, sha256 or sample count differ); "
                f"`shardkit verify {d}` says more; re-pack it"
            )
        data = encode_tally(tally, e.bytes, e.sha256, p)
        try:
            write_index_file(p, data)
        except OSError as exc:
            raise write_error(d, exc, "sample indexes") from None
        entries.append(replace(e, **index_digests(data, e.samples)))
    path = os.path.join(d, MANIFEST_NAME)
    if entries != manifest.shards:
        manifest = replace(manifest, shards=entries)
        try:
            write_manifest(manifest, d)
        except OSError as exc:
            raise write_error(d, exc, MANIFEST_NAME) from None
    return IndexResult(path, manifest, 0, kept=True)


def _manifests(by_dir: dict[str, list[str]]) -> dict[str, Manifest]:
    """The manifest already in each directory that has one (``append``: grown, not replaced)."""
    return {
        d: read_manifest(os.path.join(d, MANIFEST_NAME))
        for d in by_dir
        if os.path.lexists(os.path.join(d, MANIFEST_NAME))
    }


def append_shards(d: str, manifest: Manifest, files: list[str], progress: bool) -> IndexResult:
    """Add the tar shards among ``files`` that ``manifest`` (in ``d``) does not list, after the
    ones it does: each new shard is read once (counts, sha256, its sample index), its keys are
    checked against the dataset's by its key file, or the key hashes its indexes store
    (``keyfile.dataset_columns``: no old shard's bytes read) and against each other, then its
    index files and the grown manifest are written (manifest last, atomically; it lists no key
    file: the next ``pack --append`` or ``merge`` reads the indexes and writes one). Labels
    must fit the manifest's classes; a dataset that ``index`` made (classes ``"0" .. "K-1"``)
    grows its list to the new labels."""
    import numpy as np

    from ..progress import track
    from .keyfile import dataset_columns, held_in

    listed = {e.path for e in manifest.shards}
    if manifest.shard_format != "tar":
        raise InputError(f"{d}: holds {manifest.shard_format} shards; index adds tar shards")
    new = [f for f in files if os.path.basename(f) not in listed]
    if not new:
        return IndexResult(os.path.join(d, MANIFEST_NAME), manifest, 0, kept=True, added=0)
    entries, indexes, keys, owner = [], [], [], []
    labels: set[int] = set()
    imageless = 0
    fields = dict(manifest.fields)
    for p in track(new, "index", "shard", enabled=progress):
        tally, size, sha, sample_index = _read_tar(p)
        if sample_index:
            indexes.append((p, sample_index))
        labels |= tally.labels
        imageless += tally.imageless
        for name, n in tally.fields.items():
            fields[name] = fields.get(name, 0) + n
        keys.extend(tally.keys)
        owner.extend([p] * len(tally.keys))
        index = () if is_gzip_name(p) else tuple(tally.index[::INDEX_EVERY])
        digests = index_digests(sample_index, tally.samples) if sample_index else {}
        entries.append(ShardEntry(os.path.basename(p), tally.samples, size, sha, index, **digests))
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        j = seen.setdefault(k, i)
        if j != i:
            raise InputError(
                f"{owner[i]}: key {k!r} is in {owner[j]} too; keys are unique within a "
                "dataset: leave one of them out"
            )
    there = held_in(d, manifest, dataset_columns(d, manifest))(keys)
    if there.any():
        i = int(np.argmax(there))
        raise InputError(
            f"{owner[i]}: {int(there.sum())} of the new shards' keys are in {d} already "
            f"(first: {keys[i]!r}); keys are unique within a dataset: leave that shard out"
        )
    classes = _grown_classes(d, manifest, labels)
    pack = dict(manifest.pack)
    if imageless:
        pack["records_without_image"] = int(pack.get("records_without_image", 0)) + imageless
        warn_imageless(d, imageless)
    grown = replace(
        manifest,
        classes=classes,
        shards=[*manifest.shards, *entries],
        pack=pack,
        fields=dict(sorted(fields.items())),
        keys={},
    )
    path = _publish(d, grown, indexes)
    return IndexResult(path, grown, imageless, added=len(entries))


def _grown_classes(d: str, manifest: Manifest, labels: set[int]) -> list[str]:
    """The class list once shards with ``labels`` are added: a pack's names must cover them;
    ``index``'s ``"0" .. "K-1"`` grows to the largest."""
    old = list(manifest.classes)
    labels = labels - {-1}
    if not labels or max(labels) < len(old):
        if labels and min(labels) < 0:
            raise InputError(f"{d}: the new shards hold label {min(labels)}; labels are >= -1")
        return old
    if old != [str(i) for i in range(len(old))]:
        raise InputError(
            f"{d}: the new shards hold label {max(labels)}, and its manifest names "
            f"{len(old)} classes; pack their images with `shardkit pack SRC {d} --append`, "
            "which maps classes by name"
        )
    return _classes(labels | set(range(len(old))))
