"""The dataset's key file, ``manifest.keys`` (FORMAT.md, "Key file"): every sample's key hash
(the split hash, ``sample_index.key_hashes``), sorted, with the position of the shard holding
it. Growth (``pack --append``, ``merge``) reads it to find the keys a dataset already holds,
in place of every old shard's index.

It is a short list of sorted runs: the base file, ``manifest.keys``, and one file a growth step
since (``manifest.keys.<k>``), each listed with its sha256 by the manifest (``Manifest.keys``).
A growth step writes a run of its new keys only, then merges the newest runs while a run is at
least a quarter of the one before it (``grow_key_file``): the runs' sizes fall by more than 4x
from the base, so there are at most ``log4(N) + 1`` of them, and a key is rewritten at most
``log1.25(N)`` times over all the steps that follow (each merge it is part of leaves its run
1.25x larger or more): O(log N) bytes written a key, amortized. The worst single step merges
every run into a new base: 12 bytes a sample, once in about ``N / 4`` appended keys.

Looking up new keys touches only what they need, and checks all of it: each run is searched
by its block table (``key_file.checked_find``: the table, 16 bytes a block of 512 samples,
checked by the manifest's ``blocks_sha256``; then each block a new hash falls in, 6 KB, checked
by its digest before it answers), so a step that merges nothing reads O(new) bytes of the key
file and trusts none unchecked: a hash or shard edited in place (bit rot, an edit) is found by
the read of its block, the one a search for the key it hid reads. A run written before the
table is read whole and checked by its sha256 before it is searched. A run merged is read
whole, and its sha256 checked first. A key file that is missing, damaged, edited or another
dataset's, or a run whose table or block fails its check (``RunUnchecked``: the runs' shared
``state`` remembers it, ``_served``), serves not at all: growth then reads every shard's index
as before (``built``), with a warning naming it, and writes one base file anew. A dataset made
before the key file has none, and is read the old way once; a key file of one run is the file
older shardkit wrote and reads.

A hash is never a key: a stored hash that one of the new keys' matches is confirmed on the
key itself, read from the one shard the file names (``held_in``, ``shared_keys``).

Every run written (the base file, a growth run, a merge's) ends with its block table and, where
large enough, its count table (``key_file.CountTable``: each shard's count below a few grid
points of hash space, what a split's counts read instead of the val prefix), both computed as
the sorted columns are written, never by a second pass over the file.

Memory: the runs are searched by ``pread`` (each run's block table held: 1/32 byte a
sample) or memory-mapped, never read into the heap; the new keys' hashes; and while runs are
merged, pieces of ``CHUNK`` samples (``_two_way``).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..formats.key_file import (
    BLOCK,
    HEAD,
    KEYS_NAME,
    MAGIC,
    BlockTable,
    CountTable,
    RunUnchecked,
    block_table,
    checked_find,
    key_file_sha256,
    key_runs,
    mapped,
    run_count,
    run_head,
    run_name,
    run_size,
    runs_problem,
    search,
    shard_column,
)
from ..formats.key_file import file_digest as _digest
from ..formats.sample_index import key_hashes
from ..manifest import Manifest, ShardEntry
from .keys import shard_hashes, shard_table

__all__ = [
    "HEAD",
    "KEYS_NAME",
    "KeyColumns",
    "KeyFileWarning",
    "built",
    "columns_of",
    "dataset_columns",
    "grow_key_file",
    "held_in",
    "new_columns",
    "read_key_file",
    "read_whole",
    "shared_keys",
    "write_key_file",
]

#: Samples a piece while a key file is merged and written, or read to check it.
CHUNK = 1 << 18
#: A growth step merges its run into the one before while it is at least 1/RATIO of it.
RATIO = 4


class KeyFileWarning(UserWarning):
    """A key file the manifest lists that does not serve: growth reads every shard's index."""


@dataclass(frozen=True)
class KeyColumns:
    """One sorted run of key hashes (``uint64``, ascending) and each one's shard's position in
    the manifest (``uint32``; equal hashes by shard): a run file memory-mapped (``entry``:
    what the manifest lists of it, ``path`` the file), or built in memory."""

    hashes: np.ndarray
    shards: np.ndarray
    #: Added to ``shards`` where these columns are written into a larger dataset's (a merge).
    offset: int = 0
    #: The run's file and its manifest listing ``{"path", "sha256", "bytes"}``; "" and None
    #: where built in memory.
    path: str = ""
    entry: dict | None = None
    #: Shared by one dataset's runs (``read_key_file``): each run's checked block table, its
    #: sha256 once checked, and ``why`` once one of them did not serve (``RunUnchecked``):
    #: from then on the dataset's columns are ``built`` from its shards (``_served``).
    state: dict = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.hashes)

    def at(self, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``i .. j`` as written: their hashes, and their shards plus ``offset``."""
        shards = np.asarray(self.shards[i:j])
        if self.offset:
            shards = shards + np.uint32(self.offset)
        return np.asarray(self.hashes[i:j]), shards

    def find(self, want: np.ndarray) -> dict[int, list[int]]:
        """``shard -> positions in want`` of each of ``want`` (ascending hashes) this run holds,
        by the shards holding it (plus ``offset``): a file run searched by its checked blocks
        (``_searched``: only the blocks the hashes fall in), a built one in memory."""
        if self.path:
            try:
                hit, got = self._searched(np.asarray(want, np.uint64))
            except RunUnchecked as exc:
                self.state["why"] = str(exc)
                raise
        else:
            lo = np.searchsorted(self.hashes, want, side="left")
            hi = np.searchsorted(self.hashes, want, side="right")
            hit = np.flatnonzero(hi > lo).tolist()
            got = [self.shards[lo[q] : hi[q]] for q in hit]
        by: dict[int, list[int]] = {}
        for q, shards in zip(hit, got, strict=True):
            for s in sorted(set(np.asarray(shards).tolist())):
                by.setdefault(s + self.offset, []).append(q)
        return by

    def _searched(self, want: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
        """The file run searched for ``want``: by its block table (each block read checked by
        its digest, the table by the manifest's ``blocks_sha256``), or, a run written before
        the table, by ``os.pread`` once its whole sha256 is the manifest's (``whole``): no
        byte of it trusted unchecked."""
        n, blocks = len(self), self.entry.get("blocks_sha256")
        if blocks is None and not self.whole():
            raise RunUnchecked(self.path, "its sha256 is not the manifest's")
        with open(self.path, "rb", buffering=0) as f:
            fd = f.fileno()
            if blocks is None:
                lo, hi = search(fd, n, want)
                hit = np.flatnonzero(hi > lo).tolist()
                return hit, [shard_column(fd, n, int(lo[q]), int(hi[q])) for q in hit]
            table = self.state.get(("table", self.path))
            if table is None:
                table = self.state[("table", self.path)] = BlockTable(fd, self.path, n, blocks)
            return checked_find(fd, table, want)

    def whole(self) -> bool:
        """A file run read whole (merged): its sha256 the manifest's, checked once here."""
        if not self.path:
            return True
        done = self.state.get(("whole", self.path))
        if done is None:
            done = key_file_sha256(self.path, len(self)) == self.entry["sha256"]
            self.state[("whole", self.path)] = done
        return done


def read_key_file(folder: str, manifest: Manifest) -> list[KeyColumns] | None:
    """The runs of the key file the manifest lists, oldest first, each memory-mapped (nothing
    read yet) once their counts, sizes and heads are the manifest's (``key_file.runs_problem``
    without their sha256: checked where a run is read whole); None where it lists none, or
    (with a ``KeyFileWarning``) where they do not serve. A dataset's hashes are all the runs'
    together: a count below a hash is the sum of each run's."""
    listed = manifest.keys
    if not listed:
        return None
    shards = manifest.shards
    why = runs_problem(folder, listed, manifest.num_samples, shards, whole=False, identity=True)
    if why:
        path = os.path.join(folder, listed["path"])
        warnings.warn(
            f"{path}: {why}; growth reads every shard's index instead, and writes the key file "
            "anew",
            KeyFileWarning,
            stacklevel=4,
        )
        return None
    runs, state = [], {}
    for r in key_runs(listed):
        path = os.path.join(folder, r["path"])
        runs.append(KeyColumns(*mapped(path, run_count(r)), path=path, entry=r, state=state))
    return runs


def built(folder: str, manifest: Manifest) -> KeyColumns:
    """The key columns of the dataset from each shard's index (its stored hashes, checked by
    its keys: ``keys.shard_hashes``), or its keys: what a dataset without a key file costs."""
    return new_columns(folder, manifest.shard_format, manifest.shards, 0)


def new_columns(root: str, fmt: str, entries: Sequence[ShardEntry], first: int) -> KeyColumns:
    """The key columns of the shards ``entries`` in ``root``, numbered from ``first``."""
    return columns_of([shard_hashes(root, fmt, entry) for entry in entries], first)


def columns_of(parts: Sequence[np.ndarray], first: int) -> KeyColumns:
    """The key columns of shards whose key hashes are ``parts`` (one array a shard, in
    order), numbered from ``first``: sorted by hash, equal hashes by shard."""
    where = [np.full(len(p), k, np.uint32) for k, p in enumerate(parts, start=first)]
    if not parts:
        return KeyColumns(np.empty(0, np.uint64), np.empty(0, np.uint32))
    hashes, shards = np.concatenate(parts), np.concatenate(where)
    order = np.lexsort((shards, hashes))
    return KeyColumns(hashes[order], shards[order])


def _starts(manifest: Manifest) -> np.ndarray:
    """Each shard's first sample's position in the dataset."""
    shards = manifest.shards
    counts = shards.samples if hasattr(shards, "samples") else [s.samples for s in shards]
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])


def dataset_columns(folder: str, manifest: Manifest) -> list[KeyColumns]:
    """The dataset's key runs: its key file's where it serves, else one ``built`` from its
    shards."""
    cols = read_key_file(folder, manifest)
    return cols if cols is not None else [built(folder, manifest)]


def read_whole(folder: str, manifest: Manifest, runs: Sequence[KeyColumns]) -> list[KeyColumns]:
    """``runs`` to be read whole (written into another key file): each file run's sha256
    checked first (``KeyColumns.whole``); where one is not the manifest's, a
    ``KeyFileWarning`` and the dataset's columns ``built`` from its shards instead."""
    if runs and "why" in runs[0].state:  # a run failed its check already (and was named)
        return _served(folder, manifest, runs)
    if all(r.whole() for r in runs):
        return list(runs)
    warnings.warn(
        f"{os.path.join(folder, manifest.keys['path'])}: a run's sha256 is not the manifest's; "
        "its shards' indexes are read instead",
        KeyFileWarning,
        stacklevel=3,
    )
    return [built(folder, manifest)]


def _served(folder: str, manifest: Manifest, runs: Sequence[KeyColumns]) -> list[KeyColumns]:
    """``runs``, or where one of them failed its check (``state["why"]``), the dataset's
    columns ``built`` from its shards (once, kept in the shared state)."""
    if not runs or "why" not in runs[0].state:
        return list(runs)
    if "built" not in runs[0].state:
        runs[0].state["built"] = built(folder, manifest)
    return [runs[0].state["built"]]


def _unserved(exc: RunUnchecked) -> None:
    warnings.warn(
        f"{exc}; growth reads every shard's index instead, and writes the key file anew",
        KeyFileWarning,
        stacklevel=4,
    )


def _searched(folder: str, manifest: Manifest, runs, hashes: np.ndarray) -> dict[int, list[int]]:
    """``_candidates`` in the runs that serve: where a block read fails its check, a warning
    naming the run, and the dataset's columns from its shards (``_served``) instead."""
    try:
        return _candidates(_served(folder, manifest, runs), hashes)
    except RunUnchecked as exc:
        _unserved(exc)
        return _candidates(_served(folder, manifest, runs), hashes)


def _candidates(runs: Sequence[KeyColumns], hashes: np.ndarray) -> dict[int, list[int]]:
    """``shard -> positions in hashes`` of each of ``hashes`` (any order) the runs hold, by
    the shards holding it."""
    order = np.argsort(hashes, kind="stable")
    by: dict[int, set[int]] = {}
    for run in runs:
        for s, qs in run.find(np.asarray(hashes)[order]).items():
            by.setdefault(s, set()).update(order[qs].tolist())
    return {s: sorted(qs) for s, qs in by.items()}


def held_in(
    folder: str, manifest: Manifest, cols: Sequence[KeyColumns]
) -> Callable[[Sequence[str]], np.ndarray]:
    """``keys -> a bool each``: which of them the dataset holds (``plan_pack``'s ``existing``).
    Their hashes are looked up in each run of ``cols``; a match is confirmed on the keys of the
    one shard holding that hash (its index's key table), so a collision never leaves a key out."""
    fmt = manifest.shard_format

    def held(keys: Sequence[str]) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for s, qs in sorted(_searched(folder, manifest, cols, key_hashes(keys)).items()):
            there = set(shard_table(folder, fmt, manifest.shards[s]).keys())
            for q in qs:
                found[q] |= keys[q] in there
        return found

    return held


def _keys_with(folder: str, manifest: Manifest, cols, common: np.ndarray):
    """``{key: its first position in the dataset}`` of the samples whose hash is in ``common``
    (sorted): only the shards ``cols`` names for them are read."""
    fmt = manifest.shard_format
    starts = _starts(manifest)
    out: dict[str, int] = {}
    for s in sorted(_searched(folder, manifest, cols, common)):
        keys = list(shard_table(folder, fmt, manifest.shards[s]).keys())
        hashes = key_hashes(keys)
        for p in np.flatnonzero(np.isin(hashes, common)).tolist():
            out.setdefault(keys[p], int(starts[s]) + p)
    return out


def shared_keys(
    mine: tuple[str, Manifest, Sequence[KeyColumns]],
    theirs: tuple[str, Manifest, Sequence[KeyColumns]],
) -> list[tuple[int, str]]:
    """``(position in mine, key)`` of each of ``mine``'s keys that ``theirs`` holds too: the
    hashes both hold (the smaller dataset's runs read a ``CHUNK`` at a time and searched in
    each of the larger's runs), each confirmed on the real keys of the shards holding it on
    both sides."""
    while True:  # again where a run failed its check: that dataset's columns built instead
        try:
            return _shared(mine, theirs)
        except RunUnchecked as exc:
            _unserved(exc)


def _shared(mine, theirs) -> list[tuple[int, str]]:
    a, b = _served(*mine), _served(*theirs)
    small, large = (a, b) if sum(map(len, a)) <= sum(map(len, b)) else (b, a)
    common = []
    for run in small:
        for i in range(0, len(run), CHUNK):
            piece = np.unique(np.asarray(run.hashes[i : i + CHUNK]))
            for other in large:
                held = sorted({q for qs in other.find(piece).values() for q in qs})
                common.append(piece[held])
    common = np.unique(np.concatenate(common)) if common else np.empty(0, np.uint64)
    if not len(common):
        return []
    there = _keys_with(theirs[0], theirs[1], b, common)
    here = _keys_with(mine[0], mine[1], a, common)
    return sorted((p, k) for k, p in here.items() if k in there)


def _two_way(a: KeyColumns, b: KeyColumns) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The samples of ``a`` and ``b`` (each in key-file order, ``a``'s shards before ``b``'s)
    in key-file order (hash, then shard), in pieces of about ``CHUNK`` of the larger: cut
    where its hash changes, the smaller's below the cut added (hashes are uniform, so a piece
    of one is about as many of the other, pro rata). Each piece is ``a``'s part then ``b``'s,
    sorted stably by hash: two sorted runs merged, equal hashes left in shard order."""
    x, y = (a, b) if len(a) >= len(b) else (b, a)
    nx, x0, y0 = len(x), 0, 0
    while x0 < nx:
        x1 = min(x0 + CHUNK, nx)
        if x1 < nx:  # never between two equal hashes of x: y's equal ones go with them
            v = x.hashes[x1]
            cut = int(np.searchsorted(x.hashes, v, side="left"))
            x1 = cut if cut > x0 else int(np.searchsorted(x.hashes, v, side="right"))
        y1 = int(np.searchsorted(y.hashes, x.hashes[x1], side="left")) if x1 < nx else len(y)
        pieces = (x.at(x0, x1), y.at(y0, y1))
        (ha, sa), (hb, sb) = pieces if x is a else pieces[::-1]
        h, s = np.concatenate([ha, hb]), np.concatenate([sa, sb])
        order = np.argsort(h, kind="stable")
        yield h[order], s[order]
        x0, y0 = x1, y1
    for i in range(y0, len(y), CHUNK):
        yield y.at(i, i + CHUNK)


def _write(path: str, parts: Sequence[KeyColumns], digest: bytes, shards: int) -> dict:
    """``parts`` (each sorted) merged into one key file at ``path``, its block table and its
    count table after its columns: two at a time, the first ones through a temporary file
    beside it. Returns what the manifest lists of it but its path: ``sha256``, ``bytes``,
    ``blocks_sha256`` and (where it has one) ``counts`` (FORMAT.md), computed as it is
    written, no byte read back."""
    if len(parts) > 2:
        tmp = path + ".part"
        try:
            _write(tmp, parts[:-1], bytes(32), shards)
            n = sum(len(p) for p in parts[:-1])
            joined = KeyColumns(*mapped(tmp, n))
            done = _write(path, [joined, parts[-1]], digest, shards)
            del joined
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return done
    n = sum(len(p) for p in parts)
    if len(parts) == 2:
        pieces = _two_way(*parts)
    else:
        one = parts[0] if parts else KeyColumns(np.empty(0, np.uint64), np.empty(0, np.uint32))
        pieces = (one.at(i, i + CHUNK) for i in range(0, n, CHUNK))
    head = MAGIC + n.to_bytes(8, "little") + shards.to_bytes(8, "little") + digest
    sha_h, sha_s = hashlib.sha256(head), hashlib.sha256()
    table, rest = [], (np.empty(0, np.uint64), np.empty(0, np.uint32))
    counts = CountTable(n, shards)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(run_size(n))
        fd, at = f.fileno(), 0
        for h, s in pieces:  # in order: both columns' bytes digested as they are written
            hb, sb = h.astype("<u8").tobytes(), s.astype("<u4").tobytes()
            os.pwrite(fd, hb, HEAD + 8 * at)
            os.pwrite(fd, sb, HEAD + 8 * n + 4 * at)
            sha_h.update(hb)
            sha_s.update(sb)
            counts.add(h, s)
            at += len(h)
            h, s = np.concatenate([rest[0], h]), np.concatenate([rest[1], s])
            whole = len(h) // BLOCK * BLOCK  # the blocks complete so far; the rest waits
            table.append(block_table(h[:whole], s[:whole]))
            rest = (h[whole:], s[whole:])
        table.append(block_table(*rest))
        blocks = b"".join(table)
        os.pwrite(fd, blocks, HEAD + 12 * n)
        sha_s.update(blocks)
        grid = counts.table(blocks)
        os.pwrite(fd, grid, run_size(n))
        sha_s.update(grid)
        f.flush()
        os.fsync(fd)
    if at != n:  # pragma: no cover - a bug, never a user's
        raise AssertionError(f"{path}: wrote {at} of {n} key hashes")
    entry = {"sha256": _digest(sha_h, sha_s), "bytes": run_size(n) + len(grid)}
    entry["blocks_sha256"] = hashlib.sha256(blocks).hexdigest()
    if counts.k:
        rows = hashlib.sha256(grid[: 16 << counts.k]).hexdigest()
        entry["counts"] = {"k": counts.k, "bytes": len(grid), "sha256": rows}
    return entry


def write_key_file(staging: str, parts: Sequence[KeyColumns], shards: Sequence[ShardEntry]) -> dict:
    """The key file of the dataset whose manifest lists ``shards``, written into ``staging``
    from ``parts`` (each sorted, their shard positions the manifest's); returns what the
    manifest lists of it (``Manifest.keys``)."""
    path = os.path.join(staging, KEYS_NAME)
    return {"path": KEYS_NAME, **_write(path, list(parts), run_head(0, shards)[24:], len(shards))}


def _run_number(name: str) -> int:
    tail = name[len(KEYS_NAME) + 1 :]
    return int(tail) if name.startswith(KEYS_NAME + ".") and tail.isdigit() else 0


def grow_key_file(
    staging: str,
    old: tuple[str, Manifest],
    runs: Sequence[KeyColumns],
    new: Sequence[KeyColumns],
    shards: Sequence[ShardEntry],
) -> tuple[dict, list[str], list[str]]:
    """The key file of the dataset in ``old`` (folder, manifest; its runs ``runs``) grown by
    the columns ``new`` (sorted, their shard positions those of ``shards``, the grown
    manifest's): ``(keys, names, remove)``: what the manifest lists, the files written into
    ``staging`` for the commit to move, the old files it removes.

    One run of the new keys is written; the newest old runs are merged into it while it is at
    least 1/``RATIO`` of the run before it (each read whole, its sha256 checked first); where
    that reaches the base, or the old runs were built from the shards (no key file that
    serves), one base file is written. The new run's name is the next ``manifest.keys.<k>``
    not in the folder: a file there, listed or not, is never replaced."""
    folder, manifest = old
    listed = [r["path"] for r in key_runs(manifest.keys)]
    size, k = sum(len(c) for c in new), len(runs)
    served = all(r.path for r in runs) and not (runs and "why" in runs[0].state)
    while k and (not served or RATIO * size >= len(runs[k - 1])):  # built: all in one
        k -= 1
        size += len(runs[k])
    merged = [*_served(folder, manifest, runs[k:]), *new] if k < len(runs) else [*new]
    if served and not all(r.whole() for r in runs[k:]):
        warnings.warn(
            f"{os.path.join(folder, listed[0])}: a run's sha256 is not the manifest's; growth "
            "reads every shard's index instead, and writes the key file anew",
            KeyFileWarning,
            stacklevel=3,
        )
        served, merged = False, [built(folder, manifest), *new]
    if not served or not k:
        keys = write_key_file(staging, merged, shards)
        return keys, [KEYS_NAME], sorted({KEYS_NAME, *listed})
    number = max((_run_number(n) for n in listed), default=0) + 1
    while os.path.lexists(os.path.join(folder, run_name(number))):
        number += 1
    name = run_name(number)
    head = run_head(size, shards)
    entry = {"path": name, **_write(os.path.join(staging, name), merged, head[24:], len(shards))}
    keys = {**runs[0].entry, "runs": [*(r.entry for r in runs[1:k]), entry]}
    return keys, [name], [r.entry["path"] for r in runs[k:]]
