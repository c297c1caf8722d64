"""What a ``ShardView`` keeps to answer ``view[i]`` and ``get(key)``, in bounded memory.

A long-lived view (an eval server, a notebook) is asked for any number of samples. Held whole,
every shard index it touched (~110 bytes a sample) and a table of every key hash (12 bytes a
sample, built in memory on the second lookup: 1.4 s at 1.28M samples) grow without bound: ~50 GB
at LAION-400M. Here:

- ``ViewCache``: the knobs, a small frozen value ``ShardView(cache=...)`` takes: ``indexes``,
  the bytes of shard indexes held (least recently used let go first, and the shard's open file
  with it); ``key_dir``, where key tables are kept.
- ``IndexCache``: the shard indexes held, within ``indexes`` bytes.
- ``KeyFile``: every key hash of a dataset sorted, with each one's position, in one file on
  disk named by a digest of the shard table (each shard's URL, count and checksums: an append
  or a merge changes the manifest, and so the name). Only the fences (every 512th hash, 1/64
  byte a sample) are held; a lookup reads one 4 KB block of hashes and the positions of its
  matches (``os.pread``: nothing mapped, nothing kept), so the first lookup of a view costs
  what every other does. The file is built once per dataset version, at the first lookup that
  finds none (every shard's hash column read, 16 bytes a sample held while it is sorted), and
  shared by every view and process after. A key table answers candidates only: the view
  confirms each on the real key, so a stale or damaged file can cost a search, never a wrong
  sample.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..records import ShardTable
from ..sizes import parse_size

__all__ = ["IndexCache", "KeyFile", "ViewCache", "key_dir", "table_digest"]

#: The variable naming the directory shardkit keeps caches in (key tables in ``keys/``).
CACHE_ENV = "SHARDKIT_CACHE"

_MAGIC = b"SKKEYS01"
_HEAD = 32  # magic, samples, block, fences: 8 bytes each
_BLOCK = 512  # hashes a fence covers: one 4 KB read a lookup


@dataclass(frozen=True)
class ViewCache:
    """What a view holds to answer lookups. ``indexes``: bytes of shard indexes held (an int
    or a size string such as "64MB"; least recently used let go first; 0 holds none beyond the
    one being read): the default, 64 MiB, is about 590,000 samples' indexes. ``key_dir``: where
    the key tables ``get(key)`` searches are written (one a dataset version, 16 bytes a
    sample); None: ``$SHARDKIT_CACHE/keys``, else ``$XDG_CACHE_HOME/shardkit/keys``, else
    ``~/.cache/shardkit/keys``. A directory that cannot be written is fallen back from to a
    private temporary file, built again by each view."""

    indexes: int | str = 64 << 20
    key_dir: str | os.PathLike | None = None

    def __post_init__(self):
        object.__setattr__(self, "indexes", parse_size(self.indexes, "indexes", minimum=0))
        if self.key_dir is not None and not isinstance(self.key_dir, (str, os.PathLike)):
            raise InputError(f"ViewCache(key_dir={self.key_dir!r}): give a directory path")


def key_dir(cache: ViewCache) -> str:
    """The directory ``cache``'s key tables are kept in."""
    if cache.key_dir is not None:
        return os.fspath(cache.key_dir)
    if os.environ.get(CACHE_ENV):
        return os.path.join(os.environ[CACHE_ENV], "keys")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardkit", "keys")


def table_digest(fmt: str, shards: ShardTable, counts) -> str | None:
    """A name for the dataset version ``shards`` are: each shard's count and the checksum that
    vouches for its keys' hashes and places (the manifest's ``index_sha256``, whose index names
    the shard's ``sha256``; else the shard's ``sha256``: an LMDB shard holds its index), in
    order, wherever the files now lie; None where a shard has neither (no manifest vouches for
    it: its key table is not shared). O(shards): ~0.1 us a shard."""
    column = shards.index_sha256
    if not all(column):
        column = shards.sha256 if all(shards.sha256) else [
            i or s for s, i in zip(shards.sha256, shards.index_sha256, strict=True)
        ]  # fmt: skip
        if not all(column):
            return None
    h = hashlib.sha256(f"{fmt}\n".encode())
    h.update(np.asarray(counts, np.int64).tobytes())
    text = "".join(column)  # 64 hex digits each: hashed as their bytes
    try:
        h.update(bytes.fromhex(text))
    except ValueError:  # not hex: hashed as written
        h.update("\n".join(column).encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:32]


class KeyFile:
    """A dataset's key hashes sorted, with their positions, on disk (see the module docstring).
    ``candidates(h)``: the positions whose stored hash is ``h``, ascending.

    The file (a private cache, little-endian): ``SKKEYS01``; the samples, the block (512) and
    the number of fences, uint64 each; the fences (every block-th hash, from the first); the
    hashes, ascending, uint64; each one's position in packed order, uint64 (equal hashes in
    position order)."""

    def __init__(self, path: str, fd: int | None = None):
        self.path, self._fd, self._pid = path, fd, os.getpid()
        #: an unlinked file of this view's alone (read by its descriptor; not pickled)
        self.private = fd is not None
        head = os.pread(self._file(), _HEAD, 0)
        if len(head) != _HEAD or head[:8] != _MAGIC:
            raise OSError(f"{path}: not a key table")
        self.samples, self.block, nf = (int(x) for x in np.frombuffer(head[8:], "<u8"))
        self.fences = np.frombuffer(os.pread(self._file(), 8 * nf, _HEAD), "<u8")
        if len(self.fences) != nf or nf != -(-self.samples // self.block):
            raise OSError(f"{path}: a key table cut short")
        self._hashes_at = _HEAD + 8 * nf
        self._positions_at = self._hashes_at + 8 * self.samples

    @classmethod
    def build(cls, directory: str, digest: str | None, parts: Iterable[np.ndarray], n: int):
        """Write the key table of ``parts`` (each shard's hashes, in shard order: ``n`` in all)
        as ``directory/<digest>.keys`` (atomically: concurrent builders each write their own
        and one wins), or, without a digest or a writable ``directory``, a private file."""
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
        if digest is not None:
            try:
                os.makedirs(directory, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=directory, prefix=".keys-")
                try:
                    _write(fd, body)
                finally:
                    os.close(fd)
                path = os.path.join(directory, f"{digest}.keys")
                os.replace(tmp, path)
                return cls(path)
            except OSError:
                pass  # read-only or full: a private file below
        fd, tmp = tempfile.mkstemp(prefix="shardkit-keys-")
        os.unlink(tmp)  # gone when the view is: nobody else may trust it
        _write(fd, body)
        return cls(tmp, fd)

    @classmethod
    def find(cls, directory: str, digest: str | None) -> KeyFile | None:
        if digest is None:
            return None
        try:
            return cls(os.path.join(directory, f"{digest}.keys"))
        except OSError:
            return None  # none yet, or not one: built again

    def _file(self) -> int:
        if self.private:  # unlinked: its descriptor, inherited by a forked worker, is all
            return self._fd  # there is (``pread`` moves no shared offset)
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

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
        block = np.frombuffer(os.pread(fd, 8 * (hi - lo), self._hashes_at + 8 * lo), "<u8")
        a = int(np.searchsorted(block, want, side="left"))
        b = int(np.searchsorted(block, want, side="right"))
        if a == b:
            return np.empty(0, np.int64)
        raw = os.pread(fd, 8 * (b - a), self._positions_at + 8 * (lo + a))
        return np.sort(np.frombuffer(raw, "<u8").astype(np.int64))

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fd"] = None  # opened again where it is read (a private file: not at all)
        return state


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
