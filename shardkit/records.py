"""The typed records that flow between the shard readers, the streaming stages and the packer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Record", "ShardInfo", "ShardSlice", "ShardStats", "ShardTable", "UNKNOWN"]

#: A sample count or size that no manifest gives (e.g. tars written by other tools).
UNKNOWN = -1


@dataclass(slots=True)
class Record:
    """One stored sample as read from a shard, before decoding.

    Not frozen on purpose: a frozen dataclass builds through ``object.__setattr__`` (about 4x
    slower), and one Record is built per sample on the hottest path.

    ``ext`` is the image member's extension (``jpg``, ``png`` ...), so decoders and ``decode="raw"``
    users know what the bytes are. ``label`` is -1 when the shard stores none.
    """

    key: str
    ext: str
    data: bytes
    label: int
    shard: str = ""
    #: Extra members asked for by extension (``{"json": b"..."}``), raw; None when none were.
    fields: dict[str, bytes] | None = None
    #: Which source of a mixture it came from (its position in the list; 0 without a mixture).
    source: int = 0


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard of a dataset, as known before it is opened: the record that travels from source
    resolution through planning and reading to the storage that fetches it.

    ``samples`` and ``bytes`` are ``UNKNOWN`` and ``sha256`` empty when no manifest describes the
    shard (the dataset counts its samples; remote storage then cannot verify it). ``index`` is an
    older manifest's sparse byte-offset index (tar without ``index_sha256``), so a reader
    starting mid-shard can seek; a shard with ``index_sha256`` seeks through its sample index.
    """

    url: str
    samples: int = UNKNOWN
    bytes: int = UNKNOWN
    sha256: str = ""
    index: tuple[int, ...] = ()
    #: The sha256 of the shard's sample index file, where the manifest gives it.
    index_sha256: str = ""
    #: The sha256 of that index's fixed-width columns (head, offsets, key hashes), where the
    #: manifest gives it: a split reads and checks those bytes alone, not the whole file.
    columns_sha256: str = ""


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """Samples ``[start, stop)`` of shard number ``shard`` in the dataset's shard list.

    The unit of work handed to one DataLoader worker: splitting by slices rather than whole shards
    is what keeps every worker busy when there are fewer shards than ranks x workers.
    """

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class ShardStats:
    """What a writer reports when a shard is complete: the manifest's per-shard facts."""

    path: str
    samples: int
    bytes: int
    sha256: str
    #: Byte offset of every ``INDEX_EVERY``-th sample (0, 64, 128, ...); empty where the format
    #: needs none (LMDB seeks by key). Lets a reader start mid-shard without reading the prefix.
    index: tuple[int, ...] = ()
    #: The sha256 of the sample index written beside the shard ("": none written).
    index_sha256: str = ""
    #: The sha256 of the index's columns: an LMDB shard's index record's front
    #: (``lmdb_columns_sha256``; a tar index's come from ``ensure_indexes``). "": none.
    columns_sha256: str = ""


class ShardTable(Sequence):
    """A dataset's shards as columns: the shard list every process holds, not one object a shard.

    Opening a dataset of 40,000 shards happens in every rank (and every spawned DataLoader
    worker), so the list is numpy columns (``samples``, ``bytes``) and the lists of strings the
    manifest's parse already made (``names``, ``sha256``, ``index_sha256``,
    ``columns_sha256``); shard ``i``'s URL
    is ``head + names[i] + tail`` (the manifest's directory, or a URL prefix with its query
    string kept last; both empty where ``names`` are whole URLs). ``table[i]`` builds the
    ``ShardInfo`` of one shard when a reader asks for it, so a worker makes objects only for the
    shards it reads. ``index`` holds the sparse offsets of an older manifest (row -> offsets),
    only for the shards that list them.

    A ``Sequence[ShardInfo]`` everywhere a tuple of them was: iterating, indexing, slicing (a
    table of the rows), ``len``, and ``==`` against any sequence of ``ShardInfo``.
    """

    __slots__ = (
        "names",
        "head",
        "tail",
        "samples",
        "bytes",
        "sha256",
        "index_sha256",
        "index",
        "columns_sha256",
    )

    def __init__(
        self,
        names: Sequence[str],
        samples: Sequence[int] | np.ndarray,
        bytes: Sequence[int] | np.ndarray,
        sha256: Sequence[str] | None = None,
        index_sha256: Sequence[str] | None = None,
        index: Mapping[int, tuple[int, ...]] | None = None,
        *,
        head: str = "",
        tail: str = "",
        columns_sha256: Sequence[str] | None = None,
    ):
        n = len(names)
        self.names: list[str] = names if isinstance(names, list) else list(names)
        self.head, self.tail = head, tail
        self.samples: np.ndarray = _column(samples, n)
        self.bytes: np.ndarray = _column(bytes, n)
        self.sha256: list[str] = [""] * n if sha256 is None else _strings(sha256, n)
        self.index_sha256: list[str] = (
            [""] * n if index_sha256 is None else _strings(index_sha256, n)
        )
        self.index: dict[int, tuple[int, ...]] = {k: v for k, v in (index or {}).items() if v}
        self.columns_sha256: list[str] = (
            [""] * n if columns_sha256 is None else _strings(columns_sha256, n)
        )

    @classmethod
    def of(cls, shards: Iterable[ShardInfo]) -> ShardTable:
        """``shards`` as a table (itself when it is one already)."""
        if type(shards) is cls:
            return shards
        if isinstance(shards, ShardTable):  # another kind (the manifest's entries): same columns
            return shards._same(cls)
        rows = list(shards)
        return cls(
            [cls._name(s) for s in rows],
            [s.samples for s in rows],
            [s.bytes for s in rows],
            [s.sha256 for s in rows],
            [s.index_sha256 for s in rows],
            {i: s.index for i, s in enumerate(rows) if s.index},
            columns_sha256=[s.columns_sha256 for s in rows],
        )

    @classmethod
    def concat(cls, tables: Iterable[ShardTable]) -> ShardTable:
        """The tables' rows end to end (a mixture's shard list); names become whole URLs."""
        parts = [cls.of(t) for t in tables]
        index: dict[int, tuple[int, ...]] = {}
        first = 0
        for t in parts:
            index.update((first + k, v) for k, v in t.index.items())
            first += len(t)
        return cls(
            [u for t in parts for u in t.urls],
            np.concatenate([t.samples for t in parts]) if parts else (),
            np.concatenate([t.bytes for t in parts]) if parts else (),
            [x for t in parts for x in t.sha256],
            [x for t in parts for x in t.index_sha256],
            index,
            columns_sha256=[x for t in parts for x in t.columns_sha256],
        )

    def url(self, i: int) -> str:
        """Shard ``i``'s URL or path."""
        return self.head + self.names[i] + self.tail

    @property
    def urls(self) -> list[str]:
        """Every shard's URL or path (made here: a table holds names and one prefix)."""
        if not self.head and not self.tail:
            return list(self.names)
        return [self.head + n + self.tail for n in self.names]

    def with_samples(self, samples: np.ndarray) -> ShardTable:
        """The same shards with these sample counts (shards no manifest counted, counted)."""
        return self._same(type(self), samples)

    def _same(self, cls: type[ShardTable], samples: np.ndarray | None = None) -> ShardTable:
        """The same columns (shared, not copied) as a ``cls``, with ``samples`` if given."""
        return cls(
            self.names,
            self.samples if samples is None else samples,
            self.bytes,
            self.sha256,
            self.index_sha256,
            self.index,
            head=self.head,
            tail=self.tail,
            columns_sha256=self.columns_sha256,
        )

    def take(self, rows: Iterable[int]) -> ShardTable:
        """The table of ``rows`` (positions in this one), in that order."""
        rows = [int(r) for r in rows]
        names, sha, isha = self.names, self.sha256, self.index_sha256
        return type(self)(
            [names[r] for r in rows],
            self.samples[rows] if rows else (),
            self.bytes[rows] if rows else (),
            [sha[r] for r in rows],
            [isha[r] for r in rows],
            {j: self.index[r] for j, r in enumerate(rows) if r in self.index},
            head=self.head,
            tail=self.tail,
            columns_sha256=[self.columns_sha256[r] for r in rows],
        )

    @staticmethod
    def _name(row: ShardInfo) -> str:
        """What ``names`` holds of one row (``of``): a shard's URL."""
        return row.url

    def _row(self, i: int) -> ShardInfo:
        return ShardInfo(
            self.head + self.names[i] + self.tail,
            int(self.samples[i]),
            int(self.bytes[i]),
            self.sha256[i],
            self.index.get(i, ()),
            self.index_sha256[i],
            self.columns_sha256[i],
        )

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        n = len(self.names)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"shard {i} of a table of {n}")
        return self._row(i)

    def __iter__(self) -> Iterator[ShardInfo]:
        return map(self._row, range(len(self.names)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} shards, {int(self.samples.sum())} samples)"


def _column(values, n: int) -> np.ndarray:
    """An int64 column of ``n`` values, read-only: tables share columns, nobody edits one."""
    out = np.array(values, dtype=np.int64) if not isinstance(values, np.ndarray) else values
    if out.dtype != np.int64:
        out = out.astype(np.int64)
    if out.shape != (n,):
        raise ValueError(f"a shard table column of {out.shape} for {n} shards")
    if out.flags.writeable:
        out = out.view()
        out.flags.writeable = False
    return out


def _strings(values: Sequence[str], n: int) -> list[str]:
    out = values if isinstance(values, list) else list(values)
    if len(out) != n:
        raise ValueError(f"a shard table column of {len(out)} strings for {n} shards")
    return out
