"""What a ``ShardView`` keeps to answer ``view[i]`` and ``get(key)``, in bounded memory.

A long-lived view (an eval server, a notebook) is asked for any number of samples. Held whole,
every shard index it touched (~110 bytes a sample) and a table of every key hash (12 bytes a
sample, built in memory on the second lookup: 1.4 s at 1.28M samples) grow without bound: ~50 GB
at LAION-400M. Here:

- ``ViewCache``: the knobs, a small frozen value ``ShardView(cache=...)`` takes: ``indexes``,
  the bytes of shard indexes held (least recently used let go first, and the shard's open file
  with it).
- ``IndexCache``: the shard indexes held, within ``indexes`` bytes.
- ``DatasetKeys``: the dataset's own key file, ``manifest.keys`` (FORMAT.md, "Key file"),
  which pack, append and merge write beside the manifest that vouches for it: every key hash
  sorted with its shard, in a few sorted runs (the base file and the growth runs after it).
  A lookup reads each run's block table once (16 bytes a block of 512 samples, checked by the
  manifest's ``blocks_sha256``, then held: 1/32 byte a sample, 40 KB at 1.28M) and the one
  block of 512 its hash falls in (6 KB by ``os.pread``, checked by its digest before any byte
  of it answers: not mapped, so no page of it stays in the view's resident memory), so the
  first lookup of a view costs what every other does and nothing is built. It names candidate
  shards only: the view finds the key in that shard's index and confirms it on the real key,
  so a stale or forged file can cost a search, never a wrong sample; an answer it is missing
  comes from checked bytes (a run written before the table: trusted once its whole sha256 is
  the manifest's, as before), and a block that fails its digest makes the file not serve.
- ``split_counts``: each shard's count of a split's "val" samples, from each run's count
  table (the counts a shard below each of a few grid points in hash space: one vector of
  ``4 * shards`` bytes, then the checked blocks between it and the threshold), so a process
  reads O(shards) bytes of the key file whatever the val fraction and the dataset's size:
  what a split's epoch is partitioned by across ranks and workers, so each reads only the
  indexes of the shards it reads.
- ``key_shards``: the shards that hold each of a list of key hashes, through the same checked
  blocks (one binary search of the block table and one block a hash: O(keys x log N) bytes):
  what a subset by keys counts its members a shard by, so a rank reads only the indexes of the
  shards it reads, and each key is confirmed in its shard's own index there.
- A URL dataset's key file is read the same way through ranged GETs
  (``remote.ranged.RangedFile``, a reader a run; ``open_run``): each run's head checked when
  the view first looks a key up, then its block table and one block a lookup, so a view's
  first lookup GETs the key file's head, table and block and the one shard's index, not
  every shard's index.
- ``KeyFile``: where a dataset has no key file (packed before it existed, shards without a
  manifest), every key hash sorted with its position, built at the first lookup into
  a private, unlinked temporary file of this view's (gone when the view is). Nothing is written
  anywhere else: shardkit reads and writes only the paths it is given.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..formats.key_file import (
    HEAD,
    BlockTable,
    RunUnchecked,
    checked_find,
    counts_below,
    head_problem,
    key_runs,
    listed_size,
    read_at,
    run_count,
    runs_problem,
    search,
    shard_column,
    shard_counts,
)
from ..sizes import parse_size

__all__ = ["DatasetKeys", "IndexCache", "KeyFile", "ViewCache", "key_shards", "split_counts"]

_MAGIC = b"SKKEYS01"
_HEAD = 32  # magic, samples, block, fences: 8 bytes each
_BLOCK = 512  # hashes a fence covers: one 4 KB read a lookup


@dataclass(frozen=True)
class ViewCache:
    """What a view holds to answer lookups. ``indexes``: bytes of shard indexes held (an int
    or a size string such as "64MB"; least recently used let go first; 0 holds none beyond the
    one being read): the default, 64 MiB, is about 590,000 samples' indexes."""

    indexes: int | str = 64 << 20

    def __post_init__(self):
        object.__setattr__(self, "indexes", parse_size(self.indexes, "indexes", minimum=0))


class _ByPread:
    """A file read by ``os.pread`` through one descriptor per process (``pread`` moves no
    shared offset; a forked worker opens its own, and only the opener closes it); pickled
    without the descriptor, opened again where it is read."""

    path: str
    _fd: int | None
    _pid: int

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fd"] = None
        return state


class _Run(_ByPread):
    """One run of a key file (its base file, or a growth run), read by ``os.pread``; a URL
    dataset's through ``reader`` (``remote.ranged.RangedFile``: ranged GETs), whose ``url``
    names it."""

    def __init__(self, path: str, n: int, blocks: str | None = None, reader=None):
        self.path, self.n, self.blocks = getattr(reader, "url", path), int(n), blocks
        self._fd: int | None = None
        self._pid = os.getpid()
        self._reader = reader  # None: a local file, opened by its path
        self._table: BlockTable | None = None  # read and checked at the first lookup

    def _file(self):
        return self._reader if self._reader is not None else super()._file()

    def shards(self, want: np.uint64) -> list[int]:
        """A run with a block table: its checked block (``_checked``). One written before the
        table: growth's binary search of the sorted hashes by ``os.pread``
        (``key_file.search``), then the shards of the matches."""
        if self.blocks is not None:
            return self._checked(want)
        fd = self._file()
        lo, hi = search(fd, self.n, np.asarray([want], np.uint64))
        if lo[0] == hi[0]:
            return []
        return shard_column(fd, self.n, int(lo[0]), int(hi[0])).tolist()

    def _checked(self, want: np.uint64) -> list[int]:
        """A run with a block table: the table read once (16 bytes a block of 512 samples,
        checked by the manifest's ``blocks_sha256``, then held: 1/32 byte a sample), then the
        one block that may hold ``want`` (two, where equal hashes cross a fence), checked by
        its digest before any byte of it answers: a miss is as checked as a hit."""
        fd = self._file()
        if self._table is None:
            self._table = BlockTable(fd, self.path, self.n, self.blocks)
        _, shards = checked_find(fd, self._table, np.asarray([want], np.uint64))
        return shards[0].tolist() if shards else []


class DatasetKeys:
    """The key file a local manifest lists, ``manifest.keys`` and its growth runs (see the
    module docstring). ``open`` finds it served (its runs' counts, sizes and heads: one stat
    and one read of 56 bytes a run); ``shards(h)``: the positions of the shards holding a key
    whose hash is ``h``, ascending, from every run's checked blocks (``RunUnchecked`` where
    one fails its check); ``vouched()``: each run's head names the view's shards (the shard
    list hashed, once: checked when an answer is missing), and a run without a block table
    has the manifest's sha256 (12 bytes a sample read, once)."""

    def __init__(self, folder: str, listed: dict, n: int, shards=None, readers=None):
        self.folder, self.listed, self.n = folder, dict(listed), int(n)
        self._shards = shards  # the view's table (held by the view anyway)
        runs = key_runs(listed)
        self.runs = [
            _Run(os.path.join(folder, r["path"]), run_count(r), r.get("blocks_sha256"), f)
            for r, f in zip(runs, readers or [None] * len(runs), strict=True)
        ]
        self.path = self.runs[0].path  # the base file: what names it
        #: read through readers (a URL's): every head checked when opened, every run tabled
        self.remote = bool(readers)
        self._vouched: bool | None = True if self.remote else None

    @classmethod
    def open(
        cls, folder: str, listed: dict, n: int, shards, open_run=None
    ) -> tuple[DatasetKeys | None, str]:
        """The key file the manifest in ``folder`` lists and "", or None and why it does not
        serve. ``open_run``: as ``split_counts`` takes it (a URL dataset's runs, by ranged
        GETs): each run's listed size and head (one GET, 56 bytes and the window after them)
        checked here, naming the shards by their identity, and each must have its block
        table, so every answer after comes from checked bytes."""
        if open_run is None:
            why = runs_problem(folder, listed, n, shards, whole=False)
            return (None, why) if why else (cls(folder, listed, n, shards), "")
        readers = []
        try:
            for run, path, _, f in _opened(folder, listed, n, shards, open_run):
                if run.get("blocks_sha256") is None:
                    return None, _written_before(path)
                readers.append(f)
        except _Refused as exc:
            return None, exc.why
        except (OSError, ValueError) as exc:
            return None, f"unreadable ({exc})"
        return cls(folder, listed, n, shards, readers), ""

    def shards(self, want: int) -> list[int]:
        """Each run searched (``_Run.shards``): nothing mapped, only each run's checked block
        table held (1/32 byte a sample), so the view's memory is the same after the first
        lookup as after any number of them."""
        want = np.uint64(want)
        return sorted({s for run in self.runs for s in run.shards(want)})

    def checked(self) -> bool:
        """Every run has a block table: a hash none of them holds was looked for in checked
        bytes, and the hashes were their keys' when written (from the shards' keys), so a key
        none holds is not in the dataset (trusted as far as the manifest vouches for the
        runs, as growth trusts them)."""
        return all(run.blocks is not None for run in self.runs)

    def close(self) -> None:
        for run in self.runs:
            run.close()

    def vouched(self) -> bool:
        if self._vouched is None:  # (a URL's: its heads' identity checked when opened)
            # runs with block tables answered from checked bytes: only their heads' identity
            # of the shards is left (no read); an older run's sha256 is read whole
            whole = not all(run.blocks is not None for run in self.runs)
            try:
                self._vouched = not runs_problem(
                    self.folder, self.listed, self.n, self._shards, whole, identity=True
                )
            except OSError:
                self._vouched = False
        return self._vouched


def split_counts(
    folder: str, listed: dict, n: int, shards, threshold: int, open_run=None
) -> tuple[np.ndarray | None, str]:
    """Each shard's count of key hashes below ``threshold`` from the key file's runs in
    ``folder`` (``listed``: the manifest's ``keys``; ``n``: its samples; ``shards``: its shard
    table), and ""; or None and why the runs do not serve. Read by ``key_file.read_at``, never
    the whole file: each run's head (its size, counts and the shards it names), then a run
    with a count table (``key_file.counts_below``: one vector of ``4 * S`` bytes and the
    blocks between its grid point and ``threshold``, about ``12 n / 2^k`` bytes at most, each
    checked); a run without one, its block table (16 bytes a block of 512, checked by the
    manifest's ``blocks_sha256``) and the blocks below ``threshold`` (12 bytes a val sample),
    each checked by its digest before it is counted, so a count is what the manifest vouches
    for; the runs' counts add up. A run written before the block table: a binary search of
    its hashes (``key_file.search``) and its prefix's shard column, unchecked here. Either way
    each count is checked again against the shard's own index when a reader reaches the shard
    (``indexes.ShardSplit``), and each sample read against its own key.

    ``open_run(run)``: where the runs are not local files (a URL dataset's), what reads the
    run the manifest lists as ``run`` for ``key_file.read_at`` (ranged GETs:
    ``remote.ranged.RangedFile``); each run's size is then the manifest's and its head is
    read through it and checked."""
    counts = np.zeros(len(shards), np.int64)
    try:
        for run, path, m, fd in _opened(folder, listed, n, shards, open_run):
            counts += _counts_below(fd, path, m, run, threshold, len(shards))
    except (_Refused, RunUnchecked) as exc:
        return None, exc.why
    except (OSError, ValueError) as exc:
        return None, f"unreadable ({exc})"
    return counts, ""


class _Refused(Exception):
    """The key file's runs do not serve: ``why``, naming the run where it is not the base."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _opened(folder: str, listed: dict, n: int, shards, open_run):
    """Each run the manifest lists (``listed``: its ``keys``), oldest first, as ``(run, its
    path or URL, its samples, what reads it)``, once it serves (``_Refused`` naming it where
    not): local runs all checked first (``runs_problem``: sizes and heads, the shards'
    identity), each then open by its descriptor until the caller moves on; read through
    ``open_run(run)`` (a URL's), their counts against ``n`` and each one's listed size and
    head (``_head_problem``), as it is reached."""
    runs = key_runs(listed)
    if open_run is None:
        why = runs_problem(folder, listed, n, shards, whole=False, identity=True)
    elif sum(run_count(r) for r in runs) != n:
        why = f"its runs hold {sum(run_count(r) for r in runs)} key hashes, not {n}"
    else:
        why = ""
    if why:
        raise _Refused(why)
    for i, run in enumerate(runs):
        path, m = os.path.join(folder, run["path"]), run_count(run)
        fd = os.open(path, os.O_RDONLY) if open_run is None else open_run(run)
        path = getattr(fd, "url", path)  # a reader's own name for the run
        try:
            if open_run is not None:
                why = _head_problem(fd, run, m, shards, i == len(runs) - 1)
                if why:
                    raise _Refused(why if i == 0 else f"its run {path}: {why}")
            yield run, path, m, fd
        finally:
            if isinstance(fd, int):
                os.close(fd)


def _written_before(path: str) -> str:
    return f"{path} was written before its block table"


def _head_problem(f, run: dict, m: int, shards, last: bool) -> str:
    """Why a run read through ``f`` (not a local file) does not serve: its listed size is not
    that of ``m`` samples, or its head (one read of 56 bytes) does not name them and the
    dataset's shards; ``problem``'s checks but the file's own size, which no byte read past
    the manifest's trusts (the block table is checked by its sha256, each block by its digest,
    the count table by its own)."""
    size = listed_size(run, m)
    if int(run["bytes"]) != size:
        return f"not the {size} bytes of {m} samples"
    return head_problem(read_at(f, HEAD, 0), m, shards, last, True, run)


def _counts_below(fd: int, path: str, m: int, run: dict, threshold: int, shards: int):
    """One run's count a shard of its hashes below ``threshold`` (``split_counts``): from its
    count table where it has one, else from its prefix."""
    counts, blocks = np.zeros(shards, np.int64), run.get("blocks_sha256")
    if "counts" in run and m:  # its head's shards: the first of the dataset's
        named = int.from_bytes(read_at(fd, 8, 16), "little")
        counts[:named] += counts_below(fd, path, m, named, run, threshold)
        return counts
    if blocks is not None and m:
        table = BlockTable(fd, path, m, blocks)
        last = int(np.searchsorted(table.fences, np.uint64(threshold), "left"))
        for b in range(last):  # every hash of a block past ``last`` is >= threshold
            h, s = table.block(fd, b)
            counts += shard_counts(s[: int(h.searchsorted(np.uint64(threshold)))], shards)
        return counts
    end = int(search(fd, m, np.asarray([threshold], np.uint64))[0][0])
    for a in range(0, end, _PIECE):
        b = min(end, a + _PIECE)
        raw = read_at(fd, 4 * (b - a), HEAD + 8 * m + 4 * a)
        counts += shard_counts(np.frombuffer(raw, "<u4"), shards)
    return counts


#: Shard column entries ``split_counts`` reads at a time (4 MiB).
_PIECE = 1 << 20


def key_shards(
    folder: str, listed: dict, n: int, shards, hashes: np.ndarray, open_run=None
) -> tuple[list[np.ndarray] | None, str]:
    """The shards holding each of ``hashes`` (uint32 positions in ``shards``, ascending; none
    for a hash no run holds) from the key file's runs in ``folder`` (arguments as
    ``split_counts``), and ""; or None and why the runs do not serve. Every run must have its
    block table: each hash is looked for in the one checked block its fences name (12 x 512
    bytes, checked by its digest before it answers), so a hash none holds is not in the
    dataset, as a view's lookup trusts it; a run written before the table does not serve here
    (its misses would be unchecked). A shard named is a candidate only: the reader confirms
    the key in that shard's own index. ``open_run``: as ``split_counts`` (a URL dataset's
    runs by ranged GETs: a head, the block table and a block a key, not every shard's
    keys)."""
    want = np.asarray(hashes, np.uint64)
    order = np.argsort(want, kind="stable")
    found: list[list[np.ndarray]] = [[] for _ in range(len(want))]
    try:
        for run, path, m, fd in _opened(folder, listed, n, shards, open_run):
            if run.get("blocks_sha256") is None:
                return None, _written_before(path)
            if m:
                table = BlockTable(fd, path, m, run["blocks_sha256"])
                hit, got = checked_find(fd, table, want[order])
                for q, s in zip(hit, got, strict=True):
                    found[int(order[q])].append(s)
    except (_Refused, RunUnchecked) as exc:
        return None, exc.why
    except (OSError, ValueError) as exc:
        return None, f"unreadable ({exc})"
    none = np.empty(0, np.uint32)
    return [np.unique(np.concatenate(f)) if f else none for f in found], ""


class KeyFile(_ByPread):
    """A dataset's key hashes sorted, with their positions, in a private file (see the module
    docstring). ``candidates(h)``: the positions whose stored hash is ``h``, ascending.

    The file (this view's alone, unlinked, little-endian): ``SKKEYS01``; the samples, the
    block (512) and the number of fences, uint64 each; the fences (every block-th hash, from
    the first); the hashes, ascending, uint64; each one's position in packed order, uint64
    (equal hashes in position order). Only the fences are held (1/64 byte a sample); a lookup
    reads one 4 KB block of hashes and the positions of its matches (``os.pread``)."""

    def __init__(self, path: str, fd: int | None = None):
        self.path, self._fd, self._pid = path, fd, os.getpid()
        #: an unlinked file of this view's alone (read by its descriptor; not pickled)
        self.private = fd is not None
        head = read_at(self._file(), _HEAD, 0)
        if head[:8] != _MAGIC:
            raise OSError(f"{path}: not a key table")
        self.samples, self.block, nf = (int(x) for x in np.frombuffer(head[8:], "<u8"))
        self.fences = np.frombuffer(read_at(self._file(), 8 * nf, _HEAD), "<u8")
        if len(self.fences) != nf or nf != -(-self.samples // self.block):
            raise OSError(f"{path}: a key table cut short")
        self._hashes_at = _HEAD + 8 * nf
        self._positions_at = self._hashes_at + 8 * self.samples

    @classmethod
    def build(cls, parts: Iterable[np.ndarray], n: int) -> KeyFile:
        """The key table of ``parts`` (each shard's hashes, in shard order: ``n`` in all), in
        a temporary file unlinked at once: nobody else may trust it, and it is gone when the
        view is (16 bytes a sample held while it is sorted)."""
        hashes = np.empty(n, np.uint64)
        at = 0
        for part in parts:
            hashes[at : at + len(part)] = part
            at += len(part)
        if at != n:
            raise OSError(f"key table: {at} hashes for {n} samples")
        order = np.argsort(hashes, kind="stable")  # ties in position order
        hashes = hashes[order]
        head = _MAGIC + np.asarray([n, _BLOCK, -(-n // _BLOCK)], "<u8").tobytes()
        body = (head, hashes[::_BLOCK].astype("<u8"), hashes.astype("<u8"), order.astype("<u8"))
        del hashes, order
        fd, tmp = tempfile.mkstemp(prefix="shardkit-keys-")
        os.unlink(tmp)
        _write(fd, body)
        return cls(tmp, fd)

    def _file(self) -> int:
        if self.private:  # unlinked: its descriptor, inherited by a forked worker, is all
            return self._fd  # there is (``pread`` moves no shared offset)
        return super()._file()

    def candidates(self, want: int) -> np.ndarray:
        """Positions whose hash is ``want``, ascending: one read of the blocks that can hold it
        (one block, unless equal hashes span a fence) and one of their positions."""
        want = np.uint64(want)
        first = max(int(np.searchsorted(self.fences, want, side="left")) - 1, 0)
        last = int(np.searchsorted(self.fences, want, side="right"))
        lo, hi = first * self.block, min(last * self.block, self.samples)
        if hi <= lo:
            return np.empty(0, np.int64)
        fd = self._file()
        block = np.frombuffer(read_at(fd, 8 * (hi - lo), self._hashes_at + 8 * lo), "<u8")
        a = int(np.searchsorted(block, want, side="left"))
        b = int(np.searchsorted(block, want, side="right"))
        if a == b:
            return np.empty(0, np.int64)
        raw = read_at(fd, 8 * (b - a), self._positions_at + 8 * (lo + a))
        return np.sort(np.frombuffer(raw, "<u8").astype(np.int64))


def _write(fd: int, body: Iterable) -> None:
    for part in body:
        data = memoryview(part if isinstance(part, bytes) else np.ascontiguousarray(part))
        data = data.cast("B")
        while data:
            data = data[os.write(fd, data) :]


class IndexCache:
    """Shard indexes held within ``limit`` bytes, least recently used let go first (and
    ``release(k)`` called for each, to close what the view opened for that shard). The one
    just put is always held, however large."""

    def __init__(self, limit: int, release: Callable[[int], None] | None = None):
        self.limit = int(limit)
        #: weakly: a view holds its cache, and a cycle would keep a dropped view's files open
        self._release = None if release is None else weakref.WeakMethod(release)
        self._held: OrderedDict[int, tuple[object, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, k: int):
        got = self._held.get(k)
        if got is None:
            return None
        self._held.move_to_end(k)
        return got[0]

    def put(self, k: int, table, size: int) -> None:
        old = self._held.pop(k, None)
        if old is not None:
            self.nbytes -= old[1]
        self._held[k] = (table, int(size))
        self.nbytes += int(size)
        while self.nbytes > self.limit and len(self._held) > 1:
            gone, (_, was) = self._held.popitem(last=False)
            self.nbytes -= was
            release = None if self._release is None else self._release()
            if release is not None:
                release(gone)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, k: int) -> bool:
        return k in self._held
