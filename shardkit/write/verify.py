"""``shardkit verify``: check every shard against its manifest entry.

Per shard: size, sha256, the number of samples actually readable, labels within the class list
(or -1, "no label": a dataset may hold labelled and unlabelled samples, FORMAT.md), the sample
index beside a tar shard (present where the manifest lists its sha256, that sha256, and equal to
what the shard's headers give; an older manifest's sparse offsets, where it lists them, against
those headers), and with ``decode`` every image through PIL. ``verify_shard``
takes one local file and one entry; for a URL dataset each shard is fetched to a temporary file
first, the loop is the same. Then the dataset's key file, ``manifest.keys``, where its
manifest lists one (``key_file_problem``; a URL dataset's fetched first): ``get(key)``, growth
and a split's counts trust it once its size, sha256 and head (or block table) are the
manifest's, so it is checked against what the shards' keys give too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, ShardFormatError
from ..formats import ShardFormat, get_format
from ..formats.key_file import blocks_problem, key_runs, mapped, run_count, runs_problem
from ..formats.lmdb import LmdbSampleReader
from ..formats.lmdb.index import LmdbIndex, LmdbIndexError
from ..formats.sample_index import (
    INDEX_SUFFIX,
    SampleIndexError,
    build_index,
    decode_index,
    index_digests,
    index_path,
    key_hashes,
    read_local,
)
from ..formats.tar.tally import tally_tar
from ..fsutil import HashingReader, open_regular
from ..images.checks import decode_error
from ..manifest import INDEX_EVERY, MANIFEST_NAME, Manifest, ShardEntry, read_manifest
from ..paths import check_dataset_path
from ..records import ShardInfo
from ..stream.storage import LocalStorage
from ..urls import is_remote, join_url, url_parent

__all__ = [
    "KeyTally",
    "ShardProblem",
    "VerifyReport",
    "dataset_info",
    "key_columns_problem",
    "key_file_problem",
    "verify",
    "verify_shard",
]

_CHUNK = 1 << 20


@dataclass
class ShardProblem:
    """One bad shard and everything wrong with it."""

    path: str
    problems: list[str]

    def __str__(self) -> str:
        return f"{self.path}: {'; '.join(self.problems)}"


@dataclass
class VerifyReport:
    out: str
    shards: int
    samples: int
    bytes: int
    decoded: int
    bad: list[ShardProblem]
    #: The key file (``manifest.keys``) and what is wrong with it; None where it is good or
    #: not listed (or the dataset is a URL: its readers never use one).
    key_file: ShardProblem | None = None

    @property
    def ok(self) -> bool:
        return not self.bad and self.key_file is None

    def summary(self) -> str:
        checks = "size, sha256, sample count" + (", decoded every image" if self.decoded else "")
        if self.ok:
            return (
                f"OK: {self.shards} shard{'s' if self.shards != 1 else ''}, {self.samples} "
                f"samples, {self.bytes / 1e6:.1f} MB "
                f"in {self.out} ({checks})"
            )
        said = []
        if self.bad:
            said.append(
                f"{len(self.bad)} of {self.shards} shards in {self.out} failed verification: "
                + ", ".join(b.path for b in self.bad)
            )
        if self.key_file is not None:
            said.append(f"the key file {self.key_file.path} of {self.out} failed verification")
        return "; ".join(said)


def _sha256_and_size(path: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open_regular(path, buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return digest.hexdigest(), size


def verify_shard(
    path: str,
    entry: ShardEntry,
    shard_format: ShardFormat,
    *,
    decode: bool = False,
    num_classes: int | None = None,
    keys: list[str] | None = None,
) -> tuple[list[str], int]:
    """Problems found in the local shard file ``path`` (empty when it is good), and images decoded.

    Never raises for a damaged shard: every failure becomes a problem string, so one bad shard
    does not hide the others. ``keys``: each sample's key is appended to it as it is read (what
    the key file is checked against).
    """
    if shard_format.maps_file:  # memory-mapped (LMDB): hash first, then open
        try:
            sha, size = _sha256_and_size(path)
        except FileNotFoundError:
            return ["missing"], 0
        except OSError as exc:
            return [f"unreadable ({exc.strerror})"], 0
        digest = _digest_problems(sha, size, entry)
        if digest:
            # A memory-mapped format trusts the bytes it maps: a damaged file can kill the
            # process (SIGBUS) instead of raising. A shard whose size or checksum failed is not
            # opened.
            if size < entry.bytes:
                digest.append("truncated; not opened (mapping it would crash the reader)")
            return digest, 0
        shard = ShardInfo(path, entry.samples, entry.bytes, entry.sha256, entry.index)
        index, problems = _index_record(path, entry)
        records = _keys_match(shard_format.records(LocalStorage(), shard), index, problems)
        found, decoded = _check_records(records, entry, decode, num_classes, keys)
        return problems + found, decoded
    # A stream format (tar) is hashed while it is parsed: one read of the shard, not two.
    try:
        raw = open_regular(path, buffering=0)
    except FileNotFoundError:
        return ["missing"], 0
    except OSError as exc:
        return [f"unreadable ({exc.strerror})"], 0
    with raw:
        hashing = HashingReader(raw)
        records = shard_format.iter_records(hashing, shard=entry.path)
        problems, decoded = _check_records(records, entry, decode, num_classes, keys)
        try:
            hashing.drain()
        except OSError as exc:
            return [f"unreadable ({exc.strerror})"], decoded
    return _digest_problems(hashing.sha.hexdigest(), hashing.bytes, entry) + problems, decoded


def _index_record(path: str, entry: ShardEntry) -> tuple[LmdbIndex | None, list[str]]:
    """An LMDB shard's index record, its split hashes recomputed from its keys; a problem
    where it is damaged (none where there is none: packed before it existed), or where the
    sha256 of its columns is not the manifest's ``columns_sha256``."""
    from ..formats.lmdb.index import lmdb_columns_sha256
    from ..formats.sample_index import key_hashes

    try:
        reader = LmdbSampleReader(path, entry.path, walk=False)
        try:
            index = reader.index(strict=True)
            front = reader.index_front(entry.samples) if index and entry.columns_sha256 else b""
        finally:
            reader.close()
    except LmdbIndexError as exc:
        return None, [f"index record: {exc}"]
    except ShardFormatError:
        return None, []  # the shard itself is unreadable: reading its samples says how
    if index is not None and not np.array_equal(index.hashes, key_hashes(index.keys())):
        return None, ["index record: its split hashes are not its keys'; re-pack the shard"]
    if front and lmdb_columns_sha256(front) != entry.columns_sha256:
        return index, [
            "index record: the sha256 of its columns differs from the manifest's "
            "columns_sha256; re-pack the shard"
        ]
    return index, []


def _keys_match(records, index: LmdbIndex | None, problems: list[str]):
    """``records``, noting in ``problems`` the first whose key is not the index record's."""
    for i, rec in enumerate(records):
        if index is not None and (i >= index.samples or index.key(i) != rec.key):
            listed = index.key(i) if i < index.samples else "nothing"
            problems.append(
                f"index record: sample {i} is {rec.key!r}, the record lists {listed!r}; "
                "re-pack the shard"
            )
            index = None  # the first is named
        yield rec


def _digest_problems(sha: str, size: int, entry: ShardEntry) -> list[str]:
    problems = []
    if size != entry.bytes:
        problems.append(f"size {size} bytes, manifest says {entry.bytes}")
    if sha != entry.sha256:
        problems.append("sha256 differs from the manifest")
    return problems


def _check_records(records, entry, decode, num_classes, keys=None) -> tuple[list[str], int]:
    """Problems in ``records`` (an iterator over one shard), and the images decoded; each
    record's key appended to ``keys`` (where given)."""
    problems: list[str] = []
    count = decoded = 0
    bad_labels = 0
    first_bad_image = None
    try:
        for rec in records:
            count += 1
            if keys is not None:
                keys.append(rec.key)
            if num_classes is not None and not -1 <= rec.label < num_classes:
                bad_labels += 1
            if decode:
                reason = decode_error(rec.data)
                decoded += 1
                if reason and first_bad_image is None:
                    first_bad_image = f"sample {rec.key!r}: {reason}"
    except Exception as exc:
        problems.append(f"unreadable after {count} samples ({exc})")
    else:
        if count != entry.samples:
            problems.append(f"{count} samples, manifest says {entry.samples}")
    if bad_labels:
        problems.append(f"{bad_labels} labels outside 0..{num_classes - 1} (and -1: no label)")
    if first_bad_image:
        problems.append(f"image does not decode ({first_bad_image})")
    return problems, decoded


def _dataset(out: str, storage_options, work_dir):
    """(manifest, manifest path/URL, display name, entry -> context manager of a local path).

    The one difference between a local and a remote dataset: a remote shard is first fetched
    whole into a temporary file (deleted after), so one shard at a time is on disk.
    """
    if is_remote(out):
        from ..remote.fetch import MissingObjectError
        from ..remote.inspect import local_copy, read_manifest_url

        manifest, manifest_url = read_manifest_url(out, storage_options)
        base = url_parent(manifest_url)  # the query (a token) stays last in derived URLs

        @contextlib.contextmanager
        def local(entry: ShardEntry):
            try:
                with local_copy(join_url(base, entry.path), storage_options, dir=work_dir) as p:
                    yield p
            except MissingObjectError:
                yield None

        return manifest, manifest_url, join_url(base, ""), local
    out = out[len("file://") :] if out.startswith("file://") else out
    check_dataset_path(out)
    manifest = read_manifest(out)
    base = out if os.path.isdir(out) else os.path.dirname(out)
    path = os.path.join(out, MANIFEST_NAME) if os.path.isdir(out) else out
    return manifest, path, out, lambda e: contextlib.nullcontext(os.path.join(base, e.path))


def _index_reader(out: str, manifest_path: str, storage_options):
    """entry -> the bytes of its sample index (None: there is none), local or remote."""
    if is_remote(out):
        from ..remote.storage import RemoteStorage
        from ..stream.indexes import remote_bytes

        base = url_parent(manifest_path)
        storage = RemoteStorage(storage_options, prefetch=0)  # the retries a shard's fetch has
        return lambda e: remote_bytes(join_url(base, index_path(e.path)), storage)
    base = os.path.dirname(manifest_path)
    return lambda e: read_local(index_path(os.path.join(base, e.path)))


def _same_index(data: bytes, built: bytes, where: str) -> bool:
    """Whether the index ``data`` says what ``built`` (from the shard) says: the same bytes,
    or for an index of an older version (packs made before members, or before sample digests,
    were listed) the same samples, as far as its version says."""
    if data == built:
        return True
    try:
        got, want = decode_index(data, where), decode_index(built, where)
    except SampleIndexError:
        return False
    if got.digests is not None:
        return False  # the current version: only the same bytes will do
    same = [(got.offsets, want.offsets), (got.hashes, want.hashes), (got.ends, want.ends)]
    if got.members is not None:
        m, w = got.members, want.members
        same += [(m.labels, w.labels), (m.starts, w.starts), (m.offsets, w.offsets),
                 (m.sizes, w.sizes), (m.ids, w.ids)]  # fmt: skip
        if m.names != w.names:
            return False
    heads = (got.samples, got.shard_bytes, got.sha256, got.table)
    if heads != (want.samples, want.shard_bytes, want.sha256, want.table):
        return False
    return all(np.array_equal(a, b) for a, b in same)


def _index_fix(out: str, manifest: Manifest, manifest_path: str) -> str:
    """How to rebuild a sample index: ``shardkit index`` (which keeps a pack's manifest;
    ``--overwrite`` for the one it wrote from foreign tars itself)."""
    if is_remote(out):
        return "pack again, or run `shardkit index` on a local copy and upload it"
    over = "--overwrite " if manifest.pack.get("indexed_by") else ""
    return f"rebuild it with `shardkit index {over}{os.path.dirname(manifest_path)}`"


def index_problems(path: str, entry: ShardEntry, data: bytes | None, fix: str) -> list[str]:
    """What is wrong with the sample index ``data`` of the local tar shard ``path`` (already
    found equal to ``entry``): missing where the manifest lists it, another sha256 than the
    manifest's, or other bytes than the shard's headers give (one more pass, over headers
    only). ``fix``: the command that rebuilds it."""
    if data is None:
        return (
            [f"sample index {entry.path}{INDEX_SUFFIX} missing; {fix}"]
            if entry.index_sha256
            else []
        )
    problems = []
    if entry.index_sha256 and hashlib.sha256(data).hexdigest() != entry.index_sha256:
        problems.append(
            f"sample index {entry.path}{INDEX_SUFFIX}: sha256 differs from the manifest"
        )
    elif (
        entry.index_sha256
        and entry.columns_sha256
        and (  # a tar's is used beside it only
            index_digests(data, entry.samples)["columns_sha256"] != entry.columns_sha256
        )
    ):
        problems.append(
            f"sample index {entry.path}{INDEX_SUFFIX}: the sha256 of its columns differs from "
            "the manifest's columns_sha256"
        )
    if not _same_index(data, build_index(path, entry.bytes, entry.sha256), path):
        problems.append(
            f"sample index {entry.path}{INDEX_SUFFIX} is damaged or stale (it is not what the "
            "shard's headers give)"
        )
    return [f"{'; '.join(problems)}; {fix}"] if problems else []


def offset_problems(path: str, entry: ShardEntry, fix: str) -> list[str]:
    """Where an older manifest's sparse offsets (``index``, read only where the entry has no
    ``index_sha256``) are not the byte offsets of those samples' first headers in the local
    tar shard ``path`` (one more pass, over headers only): a reader starting mid-shard seeks
    there, and would start at another sample."""
    if not entry.index:
        return []
    got = tally_tar(path, shard=entry.path).index  # as many as the manifest's (it checks)
    wrong = [k for k, (a, b) in enumerate(zip(entry.index, got, strict=False)) if a != b]
    if not wrong:
        return []
    k = wrong[0]
    return [
        f"offset index: entry {k} (sample {k * INDEX_EVERY}) is not where that sample starts "
        f"in the shard; {fix}"
    ]


def _mixed(hashes: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of each hash (uint64, wrapping): summed a shard, an order-free
    digest of its hashes that two errors in one bit of two hashes do not cancel in."""
    z = np.asarray(hashes, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class KeyTally:
    """Per shard of a dataset, how many key hashes and the sum of their ``_mixed`` (mod 2**64):
    what a key file's columns hold of each shard, order aside, in O(shards) memory. ``known``:
    the shards whose hashes were added (a shard ``verify`` found bad is not compared)."""

    def __init__(self, shards: int):
        self.counts = np.zeros(shards, np.int64)
        self.sums = np.zeros(shards, np.uint64)
        self.known = np.zeros(shards, bool)

    def add(self, shard: int, hashes: np.ndarray) -> None:
        """The hashes of every sample of shard ``shard`` (its position in the manifest)."""
        self.known[shard] = True
        self.counts[shard] += len(hashes)
        self.sums[shard] += _mixed(hashes).sum(dtype=np.uint64)

    def add_columns(self, hashes: np.ndarray, shards: np.ndarray) -> None:
        """Samples as a key file lists them: each one's hash and its shard's position."""
        where = np.asarray(shards, dtype=np.intp)
        self.counts += np.bincount(where, minlength=len(self.counts))
        np.add.at(self.sums, where, _mixed(hashes))


#: Samples a piece while a key file's columns are checked (memory-mapped, never read whole).
_KEY_CHUNK = 1 << 18


def key_columns_problem(
    runs: Sequence[tuple[np.ndarray, np.ndarray]], want: KeyTally, names: Sequence[str]
) -> str:
    """Why a key file's columns are not what the shards' keys give; "" where they are.
    ``runs``: its columns as ``(hashes, shards)`` pairs, each sorted by hash, equal hashes by
    shard (today one pair, the whole file); ``want``: the shards' own hashes (``KeyTally``);
    ``names``: the shards' paths, by position. Each shard's hashes must be its keys' exactly
    (count and digest), in order; a shard ``want`` does not know is not compared."""
    got = KeyTally(len(want.counts))
    for hashes, shards in runs:
        for i in range(0, len(hashes), _KEY_CHUNK):
            lo = max(i - 1, 0)  # one sample back: the order across pieces too
            h = np.asarray(hashes[lo : i + _KEY_CHUNK])
            s = np.asarray(shards[lo : i + _KEY_CHUNK])
            if len(s) and int(s.max()) >= len(names):
                return f"it names shard {int(s.max())}, the manifest lists {len(names)}"
            if np.any((h[1:] < h[:-1]) | ((h[1:] == h[:-1]) & (s[1:] < s[:-1]))):
                return "its hashes are out of order"
            got.add_columns(h[i - lo :], s[i - lo :])
    bad = np.flatnonzero(want.known & ((got.counts != want.counts) | (got.sums != want.sums)))
    if not len(bad):
        return ""
    k = int(bad[0])
    more = len(bad) - 1
    more = f" (and {more} more shard{'s' if more > 1 else ''})" if more else ""
    return (
        f"its hashes of {names[k]} are not that shard's keys' ({int(got.counts[k])} listed, "
        f"the shard holds {int(want.counts[k])}){more}"
    )


def key_file_problem(
    folder: str, manifest: Manifest, want: KeyTally, fix: str = ""
) -> ShardProblem | None:
    """What is wrong with the key file the local dataset's manifest lists (None: nothing, or
    none listed): missing, not the listed size or sha256, a head that does not name the
    manifest's samples and shards (``key_file.problem``), or columns that are not what the
    shards' keys give (``key_columns_problem``). No command rewrites a key file alone: growth
    reads around one that does not serve (a warning) and writes it anew; one whose checksums
    were recomputed over wrong columns serves, so the fix deletes it first. ``fix``: the fix
    named instead (a URL dataset's, whose runs ``folder`` holds copies of)."""
    listed = manifest.keys
    if not listed:
        return None
    name = str(listed.get("path", ""))
    path = os.path.join(folder, name)
    n = manifest.num_samples
    rebuilt = (
        "`get(key)` and growth read every shard's index instead until the next `shardkit pack "
        "--append` or `shardkit merge` of the dataset writes it anew"
    )
    runs = key_runs(listed)
    for run in runs:
        if not os.path.lexists(os.path.join(folder, str(run.get("path", "")))):
            run_name = "" if run is runs[0] else f"its run {run.get('path')}: "
            return ShardProblem(
                name, [f"{run_name}missing (the manifest lists it); {fix or rebuilt}"]
            )
    why = runs_problem(folder, listed, n, manifest.shards)
    if not why:
        try:
            columns = [mapped(os.path.join(folder, r["path"]), run_count(r)) for r in runs]
            why = key_columns_problem(columns, want, [e.path for e in manifest.shards])
            for r in runs if not why else ():
                path_r = os.path.join(folder, r["path"])
                why = blocks_problem(path_r, r, run_count(r))
                if why:
                    why = why if r is runs[0] else f"its run {r['path']}: {why}"
                    break
        except (OSError, ValueError) as exc:
            why = f"unreadable ({getattr(exc, 'strerror', None) or exc})"
    if not why:
        return None
    return ShardProblem(name, [f"{why}; {fix or f'delete it (`rm {path}`): {rebuilt}'}"])


def _key_file(out: str, manifest_path: str, manifest, tally, storage_options, work_dir):
    """What ``verify`` reports of the dataset's key file: None where it lists none."""
    if tally is None:
        return None
    if is_remote(out):
        return _remote_key_file_problem(manifest_path, manifest, tally, storage_options, work_dir)
    return key_file_problem(os.path.dirname(manifest_path), manifest, tally)


def _remote_key_file_problem(
    manifest_url: str, manifest: Manifest, want: KeyTally, storage_options, work_dir
) -> ShardProblem | None:
    """A URL dataset's key file checked as a local one's (``key_file_problem``): each run
    fetched whole, as a shard is, into a temporary folder of ``work_dir`` (gone after); a run
    the store does not hold is named missing. Its fix: the file its pack wrote uploaded again,
    or the dataset packed again (a split reads every shard's index meanwhile)."""
    from ..remote.fetch import MissingObjectError, fetch

    base = url_parent(manifest_url)
    fix = (
        f"upload the key file its pack wrote to {join_url(base, manifest.keys['path'])}, or "
        "pack the dataset again; until then a split reads every shard's index instead"
    )
    with tempfile.TemporaryDirectory(prefix="shardkit-verify-", dir=work_dir) as tmp:
        for run in key_runs(manifest.keys):
            name = os.path.basename(str(run.get("path", "")))
            try:
                with open(os.path.join(tmp, name), "w+b") as out:
                    fetch(join_url(base, name), out, storage_options=storage_options)
            except MissingObjectError:
                os.unlink(os.path.join(tmp, name))
        return key_file_problem(tmp, manifest, want, fix)


def verify(
    out: str,
    *,
    decode: bool = False,
    progress: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    work_dir: str | None = None,
    threads: int | None = None,
) -> VerifyReport:
    """Check every shard of the packed dataset ``out`` (a directory or URL) against its manifest.

    Raises ManifestError when the manifest itself is missing or unreadable; bad shards are
    reported, not raised, so the caller sees all of them. A remote shard is downloaded to a
    temporary file in ``work_dir`` (default: the system's) and deleted after its check.
    ``threads`` shards are checked at once (default: usable CPUs, at most 8): hashing, reads
    and decoding release the GIL.
    """
    from ..progress import progress as progress_bar

    manifest, manifest_path, name, local = _dataset(os.fspath(out), storage_options, work_dir)
    fmt = get_format(manifest.shard_format)
    read_index = _index_reader(os.fspath(out), manifest_path, storage_options)
    fix = _index_fix(os.fspath(out), manifest, manifest_path)
    num_classes = len(manifest.classes) or None  # no classes (foreign tars)
    entries = manifest.shards
    if threads is None:
        threads = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
    if threads < 1:
        raise InputError(f"threads={threads} must be at least 1")
    # the dataset's key file, local or at a URL: checked against the shards' keys
    tally = KeyTally(len(entries)) if manifest.keys else None

    def check(entry: ShardEntry) -> tuple[list[str], int, np.ndarray | None]:
        with local(entry) as path:
            if path is None:
                return ["missing"], 0, None
            keys: list[str] | None = None if tally is None else []
            problems, n = verify_shard(
                path, entry, fmt, decode=decode, num_classes=num_classes, keys=keys
            )
            if not problems and fmt.name == "tar" and entry.path.endswith(".tar"):
                problems = index_problems(path, entry, read_index(entry), fix)
                problems += offset_problems(path, entry, fix)
            return problems, n, None if keys is None or problems else key_hashes(keys)

    bad: list[ShardProblem] = []
    decoded = 0
    with (
        progress_bar(len(entries), "verify", "shard", enabled=progress) as bar,
        ThreadPoolExecutor(max(1, min(threads, len(entries))), "shardkit-verify") as pool,
    ):
        try:
            checked = zip(entries, pool.map(check, entries), strict=True)
            for k, (entry, (problems, n, hashes)) in enumerate(checked):
                bar.update(1)
                decoded += n
                if problems:
                    bad.append(ShardProblem(entry.path, problems))
                if hashes is not None:
                    tally.add(k, hashes)
        except BaseException:  # a store that failed past its retries: no shard more is tried
            pool.shutdown(cancel_futures=True)
            raise
    return VerifyReport(
        out=name,
        shards=len(entries),
        samples=manifest.num_samples,
        bytes=manifest.total_bytes,
        decoded=decoded,
        bad=bad,
        key_file=_key_file(
            os.fspath(out), manifest_path, manifest, tally, storage_options, work_dir
        ),
    )


def dataset_info(out: str, storage_options: Mapping[str, Any] | None = None) -> dict:
    """The facts ``shardkit info`` prints, from the manifest alone (no shard is opened)."""
    manifest, path, _, _ = _dataset(os.fspath(out), storage_options, None)
    return manifest_info(manifest, path)


def manifest_info(m: Manifest, manifest_path: str) -> dict:
    """``shardkit info``'s facts of a manifest, wherever it was read from (disk or URL)."""
    return {
        "manifest": manifest_path,
        "format": m.shard_format,
        "shards": len(m.shards),
        "samples": m.num_samples,
        "bytes": m.total_bytes,
        "num_classes": len(m.classes),
        "classes": list(m.classes),
        "skipped": len(m.skipped),
        "fields": dict(m.fields),
        "pack": m.pack,
    }
