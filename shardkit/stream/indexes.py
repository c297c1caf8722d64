"""Reading shards' sample indexes (``formats.sample_index``), locally or from object storage.

What construction, ``ShardView``, ``ls`` and ``show`` need from a shard (its keys, its samples'
byte ranges, its split hashes) comes from the index file beside it (tar) or the index record
inside it (LMDB): one small read per shard instead of a walk over every header or sample. A
shard without one (a foreign tar never indexed, an older pack) gives ``None`` and the caller
reads the shard as before.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ShardFormatError, StorageError
from ..formats.lmdb import LmdbSampleReader, lmdb_index_front, read_lmdb_index
from ..formats.lmdb.index import LmdbIndex, vouched_lmdb_hashes
from ..formats.sample_index import (
    IndexColumns,
    SampleIndex,
    ShardSides,
    columns_of,
    columns_size,
    decode_columns,
    index_path,
    key_hashes,
    load_index,
    read_local,
)
from ..records import ShardInfo
from ..urls import is_url
from .storage import Storage

__all__ = [
    "all_keys",
    "lmdb_index",
    "remote_bytes",
    "shard_columns",
    "shard_index",
    "shard_keys",
    "split_bits",
    "split_hashes",
    "split_positions",
    "ShardSplit",
    "drop_held",
    "held_columns",
    "val_mask",
    "warn_unindexed",
]


def shard_index(shard: ShardInfo, storage: Storage | None = None) -> SampleIndex | None:
    """``shard``'s sample index, checked against its manifest entry; None where there is none
    (or it is damaged or stale: a warning names it). ``storage``: whose retry policy and
    timeout a remote index's GET follows (``remote_bytes``)."""
    if not shard.sha256 or not shard.url.endswith(".tar"):
        return None  # no manifest to check it against, a compressed tar, or LMDB
    data = _index_bytes(shard, storage)
    where = index_path(shard.url)
    return load_index(data, where, shard.samples, shard.bytes, shard.sha256, shard.index_sha256)


def _index_bytes(shard: ShardInfo, storage) -> bytes | None:
    where = index_path(shard.url)
    if is_url(shard.url):
        return remote_bytes(where, storage)
    return read_local(where.removeprefix("file://"))


def columns_range(shard: ShardInfo) -> tuple[str, int] | None:
    """Where the head of ``shard``'s index is and its size (``shard_columns`` reads it); None
    for a shard that cannot have one."""
    if not shard.sha256 or not shard.url.endswith(".tar") or shard.samples < 0:
        return None
    return index_path(shard.url), columns_size(shard.samples)


def shard_columns(
    shard: ShardInfo, storage: Storage | None = None, read=None
) -> IndexColumns | None:
    """The head of ``shard``'s index (byte ranges and key hashes, 16 bytes a sample, not the
    key table): one read, or one ranged GET (``read(where, n)``: that GET, made already);
    None where there is none or it is not this shard's (a warning names it). A head a split
    read and checked in this process a moment ago (``held_columns``) is taken instead: no
    second read or GET of the same bytes."""
    if (found := columns_range(shard)) is None:
        return None
    if (held := _take_held(shard)) is not None:
        return held
    data = _columns_bytes(shard, storage, read)
    if data is None:  # no index, or unreadable: the shard is read instead
        return None
    return decode_columns(data, found[0], shard.samples, shard.bytes, shard.sha256)


def _columns_bytes(shard: ShardInfo, storage, read=None) -> bytes | None:
    """The first ``columns_size`` bytes of ``shard``'s index and no more (a local file: one
    unbuffered read, no read ahead; remote: one ranged GET under ``storage``'s retry policy
    and timeout, or ``read(where, n)``: that GET, made already); None where there is no index
    (or a local one cannot be read). A remote index shorter than that gives what it holds (its
    decoder names it stale); a store that keeps failing is a ``StorageError`` after the
    retries, as for the shard itself."""
    where, n = index_path(shard.url), columns_size(shard.samples)
    if is_url(shard.url):
        from ..remote.fetch import MissingObjectError, ShortObjectError
        from ..remote.storage import remote_of

        try:
            if read is not None:
                return read(where, n)
            return remote_of(storage).read_range(where, 0, n)
        except MissingObjectError:
            return None
        except ShortObjectError as exc:
            return exc.received
    try:
        if read is not None:
            return read(where, n)
        with open(where.removeprefix("file://"), "rb", buffering=0) as f:
            return f.read(n)
    except OSError:  # no index (FileNotFoundError), or unreadable
        return None


#: Index heads a split read for a shard's sides (``ShardSplit``), their sha256 the manifest's
#: ``columns_sha256`` (or the whole file's its ``index_sha256``), held until the reader of the
#: same epoch reads the shard's samples through them (``shard_columns`` takes each once): one
#: read or GET of a head an epoch where there were two. Only what a worker is about to read
#: is held: a plan piece's shards, at most ``HELD`` bytes (the oldest dropped first, and then
#: read again), and a shard the reader streams instead drops its own (``drop_held``). A head
#: no reader takes (a plan made but not read, an epoch left part way) waits, within ``HELD``,
#: until newer ones push it out.
_HELD: OrderedDict[tuple, IndexColumns] = OrderedDict()
HELD = 16 << 20
_held = [0]
_held_lock = threading.Lock()


def _held_key(shard: ShardInfo) -> tuple:
    """What names a head: the shard's manifest facts (another pack at the URL: another key)."""
    return (shard.url, shard.sha256, shard.samples, shard.bytes, shard.index_sha256,
            shard.columns_sha256)  # fmt: skip


def _head_bytes(cols: IndexColumns) -> int:
    extra = 0 if cols.digests is None else cols.digests.nbytes
    return cols.offsets.nbytes + cols.hashes.nbytes + extra


def _hold(shard: ShardInfo, cols: IndexColumns) -> None:
    """Hold ``shard``'s checked head for its reader (``_HELD``)."""
    key, size = _held_key(shard), _head_bytes(cols)
    with _held_lock:
        old = _HELD.pop(key, None)
        _held[0] += size - (0 if old is None else _head_bytes(old))
        _HELD[key] = cols
        while _held[0] > HELD and len(_HELD) > 1:
            _, gone = _HELD.popitem(last=False)
            _held[0] -= _head_bytes(gone)


def _take_held(shard: ShardInfo) -> IndexColumns | None:
    with _held_lock:
        got = _HELD.pop(_held_key(shard), None)
        if got is not None:
            _held[0] -= _head_bytes(got)
    return got


def held_columns(shard: ShardInfo) -> bool:
    """Whether a checked head of ``shard`` is held for its reader (nothing to fetch)."""
    with _held_lock:
        return _held_key(shard) in _HELD


def drop_held(shard: ShardInfo) -> None:
    """Let go of ``shard``'s held head: its reader streams the shard instead."""
    _take_held(shard)


def remote_bytes(url: str, storage) -> bytes | None:
    """The whole object at ``url`` (an index beside its shard), read as a shard is: retried and
    resumed under ``storage``'s policy and timeout (``RemoteStorage.read_object``; another
    storage or None: the default policy); None where there is none. A store that keeps
    failing is a ``StorageError`` naming the URL, never a traceback nor a silent None."""
    from ..remote.fetch import MissingObjectError
    from ..remote.storage import remote_of

    try:
        return remote_of(storage).read_object(url)
    except MissingObjectError:
        return None


def lmdb_index(shard: ShardInfo, storage: Storage) -> LmdbIndex | None:
    """The index record of an LMDB shard (one lookup, checked against the manifest's count);
    None where it has none, or it is damaged (a warning names it)."""
    return read_lmdb_index(storage.local_path(shard), shard.url, shard.samples)[0]


def shard_keys(
    shard: ShardInfo, fmt: str, storage: Storage, storage_options=None, refused=None
) -> list[str]:
    """Every key of one shard in stored order: from its index, else from the shard (and
    ``refused`` gains the url of a tar shard whose index is there but was refused: damaged or
    stale, a warning has named it; its samples must not be read through it either)."""
    if fmt == "lmdb":
        index = lmdb_index(shard, storage)
    else:
        index = shard_index(shard, storage) if fmt == "tar" else None
    if index is not None:
        return index.keys()
    if refused is not None and columns_range(shard) is not None:
        refused.add(shard.url)  # no index, or one refused: streamed, its headers read
    return _keys_read(shard, fmt, storage)


def _keys_read(shard: ShardInfo, fmt: str, storage: Storage) -> list[str]:
    """Every key of one shard read from the shard itself (its headers, or each LMDB value)."""
    from ..formats.tar.tally import tally_tar

    if fmt == "lmdb":
        reader = LmdbSampleReader(storage.local_path(shard), shard.url)
        try:
            got = reader.keys()
        finally:
            reader.close()
    else:
        try:
            with storage.open(shard) as stream:
                got = tally_tar(stream, shard=shard.url, keys=True).keys
        except OSError as exc:
            raise StorageError(f"{shard.url}: cannot read its keys ({exc})") from exc
    if shard.samples >= 0 and len(got) != shard.samples:
        raise ShardFormatError(
            f"{shard.url}: holds {len(got)} samples, its manifest says {shard.samples}; "
            "the manifest belongs to another version of the shard: re-pack it"
        )
    return got


def split_hashes(
    shards: Sequence[ShardInfo],
    fmt: str,
    storage: Storage,
    storage_options=None,
    refused: set[str] | None = None,
) -> np.ndarray:
    """The split hash of every sample, in stored order, never taken on trust: a tar index's
    hashes are used once the sha256 of its columns (head, offsets, hashes: 16 bytes a sample,
    read alone) is the manifest's ``columns_sha256``, or, where it lists none or they differ,
    once the whole file's sha256 is the manifest's ``index_sha256``; an LMDB index record's
    hashes once the sha256 of its front (head, hashes, digests: 16 bytes a sample, read
    alone) is the manifest's ``columns_sha256``; else (an LMDB record the manifest lists no
    ``columns_sha256`` of, or another: its own checksum anyone rewriting it can fix up; a
    tar index the manifest lists no sha256 of) they are hashed again from the index's keys
    and compared, and a mismatch is a warning naming the shard, the keys' hashes used. A shard
    without an index has its keys read and hashed. ``refused`` gains the url of each shard
    whose index was not used as it stands (damaged, stale, or its hashes not its keys'): an
    epoch must not read through it either. Hashes that pass here are still not the keys: a
    manifest's checksums can be computed again from an edited index, so an epoch checks each
    sample it reads by its own key (``formats.sample_index.ShardSides``)."""
    parts = list(_shard_hashes(shards, fmt, storage, storage_options, refused))
    return np.concatenate(parts) if parts else np.empty(0, np.uint64)


def split_bits(
    shards: Sequence[ShardInfo],
    fmt: str,
    storage: Storage,
    val_fraction: float,
    storage_options=None,
    refused: set[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``np.packbits(val_mask(split_hashes(...)))`` and each shard's count of val samples, one
    shard's hashes held at a time: what a split holds is 1/8 byte a sample of the dataset (the
    bits) and 8 bytes a shard (``members.SideMembers``), never a byte or a position a sample."""
    total = int(sum(s.samples for s in shards))  # counted: each shard's hashes are checked
    packed = np.zeros(-(-total // 8), dtype=np.uint8)
    per_shard = np.zeros(len(shards), dtype=np.int64)
    carry = np.empty(0, dtype=bool)  # the last shard's bits that are not yet a whole byte
    at = 0  # bytes of ``packed`` written
    hashes = _shard_hashes(shards, fmt, storage, storage_options, refused)
    for i, h in enumerate(hashes):
        val = val_mask(h, val_fraction)
        per_shard[i] = np.count_nonzero(val)
        bits = np.concatenate((carry, val))
        whole = len(bits) - len(bits) % 8
        packed[at : at + whole // 8] = np.packbits(bits[:whole])
        at, carry = at + whole // 8, bits[whole:]
    if len(carry):
        packed[at] = np.packbits(carry)[0]
    return packed, per_shard


def _shard_hashes(shards, fmt, storage, storage_options, refused):
    """Each shard's split hashes in turn, checked as ``split_hashes`` says."""
    try:
        for shard in shards:
            yield _one_shard_hashes(shard, fmt, storage, storage_options, refused)
    finally:
        storage.close()


def _one_shard_hashes(shard, fmt, storage, storage_options, refused, hold=False):
    """One shard's split hashes, checked as ``split_hashes`` says (``hold``: a checked tar
    head is held for the epoch's reader, ``_HELD``)."""
    hashes, trusted = _checked_hashes(shard, fmt, storage, storage_options, hold)
    if hashes is None:
        hashes = key_hashes(_keys_read(shard, fmt, storage))
    if not trusted and refused is not None:
        refused.add(shard.url)
    if shard.samples >= 0 and len(hashes) != shard.samples:
        raise ShardFormatError(
            f"{shard.url}: its index holds {len(hashes)} samples, its manifest says "
            f"{shard.samples}; rebuild the index (`shardkit index`) or re-pack the shard"
        )
    return hashes


@dataclass
class ShardSplit:
    """Shard i's "is val" mask, read when a split's epoch first reaches the shard
    (``members.ShardSideMembers.load``): its split hashes, checked as ``split_hashes`` checks
    them (``refused`` gains a shard whose index was not used), under ``threshold``. The
    shard's count of val samples must be ``val_per_shard[i]``, what the dataset's key file
    (``keys``) says and every rank partitioned the epoch by: another count is an error naming
    the key file, never an epoch cut by wrong counts (ranks with unequal samples hang a
    distributed step)."""

    shards: object  # a ShardTable
    fmt: str
    storage: Storage
    threshold: int
    val_per_shard: np.ndarray
    keys: str
    storage_options: dict | None = None
    refused: set = field(default_factory=set)

    def __call__(self, i: int) -> np.ndarray:
        shard = self.shards[i]
        opts = self.storage_options
        hashes = _one_shard_hashes(shard, self.fmt, self.storage, opts, self.refused, True)
        val = hashes < np.uint64(self.threshold)
        got, said = int(np.count_nonzero(val)), int(self.val_per_shard[i])
        if got != said:
            self._name_the_liar(shard, val, said)
            raise ShardFormatError(
                f"{self.keys}: counts {said} val sample(s) in {shard.url}, whose index and keys "
                f"hold {got}: the key file is not this dataset's; delete it (a split then reads "
                "every shard's index, and the next append or merge writes it anew)"
            )
        return val

    def _name_the_liar(self, shard: ShardInfo, val: np.ndarray, said: int) -> None:
        """Where the key file's count is the shard's keys' own (its headers read, hashed), the
        index's column lies (recomputed checksums vouch for an edited column): the error
        names the first sample its key puts on the other side, as a reader's check would."""
        keys = _keys_read(shard, self.fmt, self.storage)
        truth = key_hashes(keys) < np.uint64(self.threshold)
        if int(np.count_nonzero(truth)) != said or len(truth) != len(val):
            return  # the key file's count is not the keys' either: it is the one named
        n = int(np.flatnonzero(truth != val)[0])
        raise ShardSides(np.packbits(val), 0, self.threshold).error(shard.url, n, keys[n])


def _checked_hashes(shard: ShardInfo, fmt: str, storage: Storage, storage_options, hold=False):
    """``shard``'s split hashes from its index, checked (``split_hashes``), and whether the
    index holds them as they are; (None, False) where it has no usable index (a warning has
    named a damaged or stale one). ``hold``: a head whose sha256 was the manifest's is held
    for the reader (``_hold``); one checked no other way never is."""
    if fmt == "lmdb" and shard.columns_sha256 and shard.samples >= 0:
        hashes = vouched_lmdb_hashes(
            lmdb_index_front(storage.local_path(shard), shard.url, shard.samples),
            shard.samples,
            shard.columns_sha256,
        )  # 16 bytes a sample read, none hashed in Python; else the keys are hashed below
        if hashes is not None:
            return hashes, True
    if (
        fmt == "tar"
        and shard.columns_sha256
        and shard.index_sha256
        and shard.sha256
        and shard.url.endswith(".tar")
    ):
        cols = _listed_columns(shard, storage)  # 16 bytes a sample, not ~90
        if cols is not None:
            return _vouched(shard, cols, hold)
    if fmt == "tar" and shard.index_sha256 and shard.sha256 and shard.url.endswith(".tar"):
        data = _index_bytes(shard, storage)  # the packer's file: its head is enough
        if data is not None and hashlib.sha256(data).hexdigest() == shard.index_sha256:
            head, where = data[: columns_size(shard.samples)], index_path(shard.url)
            cols = decode_columns(head, where, shard.samples, shard.bytes, shard.sha256)
            return (None, False) if cols is None else _vouched(shard, cols, hold)
    if fmt == "lmdb":
        index = lmdb_index(shard, storage)
    else:
        index = shard_index(shard, storage) if fmt == "tar" else None
    if index is None:
        return None, False
    hashes = key_hashes(index.keys())
    trusted = bool(np.array_equal(hashes, index.hashes))
    if not trusted:
        bad = int(np.count_nonzero(hashes != index.hashes))
        if fmt == "tar":
            what, fix = f"{shard.url}.idx", "delete it and run `shardkit index` on the dataset"
        else:
            what, fix = f"{shard.url}: its index record", "re-pack the shard"
        warnings.warn(
            f"{what}: {bad} split hash(es) are not their keys' hashes (the index is damaged); "
            f"the split uses the keys' own hashes ({fix})",
            RuntimeWarning,
            stacklevel=4,
        )
    return hashes, trusted


def _vouched(shard: ShardInfo, cols: IndexColumns, hold: bool) -> tuple[np.ndarray, bool]:
    """The split hashes of a head whose sha256 is the manifest's, trusted (``hold``: the head
    held for the epoch's reader, ``_hold``)."""
    if hold:
        _hold(shard, cols)
    return cols.hashes.astype(np.uint64), True


def _listed_columns(shard: ShardInfo, storage) -> IndexColumns | None:
    """The columns of ``shard``'s index (``columns_size`` bytes, read alone) where their sha256
    is the manifest's ``columns_sha256``: the packer's offsets and key hashes, whatever the key
    table after them holds (nothing the split reads). None where they cannot be read or differ
    (damaged, stale, a hash flipped): the caller then checks the whole file, as for an entry
    without ``columns_sha256``, and that names it."""
    if shard.samples < 0:
        return None
    data = _columns_bytes(shard, storage)
    if data is None or len(data) < columns_size(shard.samples):
        return None
    if hashlib.sha256(columns_of(data, shard.samples)).hexdigest() != shard.columns_sha256:
        return None
    where = index_path(shard.url)
    return decode_columns(data, where, shard.samples, shard.bytes, shard.sha256, listed=True)


def split_positions(hashes: np.ndarray, split: str, val_fraction: float) -> np.ndarray:
    """Positions of the ``split`` part, ascending: "val" where the hash is below
    ``val_fraction * 2**64`` (FORMAT.md, "Train/val splits"), "train" elsewhere."""
    val = val_mask(hashes, val_fraction)
    return np.flatnonzero(val if split == "val" else ~val).astype(np.int64)


def val_mask(hashes: np.ndarray, val_fraction: float) -> np.ndarray:
    """True where a hash puts its sample in "val"."""
    return hashes < np.uint64(math.ceil(val_fraction * 2**64))  # exact: h < x iff h < ceil(x)


def all_keys(
    shards: Sequence[ShardInfo], fmt: str, storage: Storage, storage_options=None, refused=None
) -> list[str]:
    """Every sample's key, in stored order (indexes where the shards have them; ``refused``:
    as ``shard_keys``)."""
    keys: list[str] = []
    try:
        for shard in shards:
            keys.extend(shard_keys(shard, fmt, storage, storage_options, refused))
    finally:
        storage.close()
    return keys


def warn_unindexed(shards: Sequence[ShardInfo], fmt: str, name: str, what: str) -> None:
    """Warn once, before a subset or split is chosen, where plain tar shards have no sample
    index (an older pack, or its ``.idx`` files left behind in a copy): then the split hashes
    come from every shard's headers and a subset's epoch reads every shard whole, not the
    drawn samples' bytes. Nothing is read to tell: a local shard's index is looked for (a stat
    each); a remote one is taken as there where the manifest lists its sha256."""
    if fmt != "tar":
        return
    plain = [s for s in shards if s.url.endswith(".tar")]
    missing = [s for s in plain if not _index_there(s)]
    if not missing:
        return
    where = os.path.dirname(missing[0].url) or "."
    cost = {
        "split": "this split reads their keys from every header of every one",
        "subset": "this subset reads their every byte each epoch, not the drawn samples'",
    }[what]
    warnings.warn(
        f"{name}: {len(missing)} of its {len(plain)} tar shards have no sample index (an older "
        f"pack?), so {cost}; `shardkit index {where}` writes the indexes once, without "
        "rewriting a shard",
        RuntimeWarning,
        stacklevel=4,
    )


def _index_there(shard: ShardInfo) -> bool:
    """A local shard's index: a stat; a remote one's: the manifest lists its sha256 (an older
    pack's lists none; nothing is fetched to tell)."""
    if is_url(shard.url) and not shard.url.startswith("file://"):
        return bool(shard.index_sha256)
    return os.path.exists(index_path(shard.url.removeprefix("file://")))
