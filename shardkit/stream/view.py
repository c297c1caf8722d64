"""``ShardView``: a packed dataset as a map-style dataset, for evaluation and debugging.

``view[i]`` is sample i in packed order (shards in the dataset's order, samples in each), and
``view.get(key)`` the sample with that key, decoded as ``ShardDataset`` decodes. Where
``ShardDataset`` reads shards front to back, a view reads one sample with one read:

- tar: a dense per-sample byte-offset index, built when the view is made by one pass over each
  shard's headers (data is hopped over on local files); then sample i is one ``pread`` of its
  byte range, or one ranged GET for a remote shard. The range is parsed by the same tar reader
  as streaming, so labels, keys and fields come out identical.
- LMDB: one B-tree lookup (a remote LMDB is fetched into the cache first); the keys come from
  the shard's index record (one lookup), or where it has none from the start of every value.
  Each shard's identity (device, inode, size, mtime) is kept from when it was indexed: a shard
  replaced or rewritten since is refused by name when it is opened again, and every sample's
  key is checked against the index, so a view never hands out another sample than the one
  asked for.

Usable with ``DataLoader`` and ``DistributedSampler``: a view pickles without open files and
opens its shards again in each worker process. It is a map-style dataset by protocol
(``__len__``, ``__getitem__``), not a subclass of torch's ``Dataset``: this module imports no
torch, so ``shardkit ls`` and ``show`` answer from the index without loading it (``view + other``
still gives torch's ``ConcatDataset``).
"""

from __future__ import annotations

import bisect
import io
import itertools
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, ShardFormatError, StorageError, UnknownKeywordError
from ..formats.key_file import RunUnchecked
from ..formats.lmdb import LmdbSampleReader, file_stamp
from ..formats.lmdb.index import LmdbIndex
from ..formats.sample_index import Members, SampleIndex, key_hashes, table_hashes
from ..formats.tar.parse import BLOCK, LABEL_EXTS
from ..formats.tar.reader import read_sample
from ..formats.tar.tally import tally_tar
from ..images.options import Decode
from ..manifest import read_manifest
from ..paths import check_source
from ..records import Record, ShardInfo, ShardTable
from ..urls import is_url
from .fields import field_spec
from .indexes import shard_columns, shard_index
from .lookup import DatasetKeys, IndexCache, KeyFile, ViewCache
from .members import Members as Selected
from .mix import Source
from .ranges import check_sample, read_range, warn_undigested
from .selection import (
    _kind,
    _options,
    _run_path,
    _run_reader,
    _storage,
    key_file_fix,
    resolve_mixed,
)
from .sources import resolve_source
from .stages import decoded_fields, empty_as_said, sample_error

__all__ = ["SampleSummary", "ShardView"]

#: The retired keywords a view took (``retired.translate`` folds them into their objects).
_RETIRED = frozenset({"max_pixels", "storage_options", "cache_dir"})

#: How a dataset gets its key file: no command writes one for a dataset as it is.
KEY_FILE_FIX = (
    "re-pack it, or grow it with `shardkit pack MORE OUT --append` or `shardkit merge`, "
    "which write one"
)
_END = b"\0" * 1024  # two zero blocks: a sample's byte range parsed as a whole archive


class ShardView:
    """Random access to a packed dataset: ``len(view)``, ``view[i]``, ``view.get(key)``.

    ``source``: what ``ShardDataset`` takes (directory, manifest, glob, list, URL), or one
    ``Source``: its ``split=``/``val_fraction=`` and ``subset=`` make the view one over exactly
    the samples that selection draws, in packed order (``view[i]`` is the i-th of them; a
    fraction subset is drawn as ``ShardDataset``'s default ``seed=0`` draws it), and its
    ``storage_options`` are used for its URLs. A ``weight`` (a share among several sources) or
    ``fields`` leaving out one of the view's ``fields=`` cannot take effect on one view and are
    refused; several sources are several views (``view_a + view_b``). ``decode`` (a mode
    string or a ``shardkit.Decode``; a crop is drawn as epoch 0 of seed 0 draws it),
    ``transform``, ``target_transform``, ``with_keys``, ``fields``: as ``ShardDataset``.
    ``storage``: where the shards live, as ``ShardDataset``'s ``storage=``: a
    ``shardkit.remote.RemoteStorage`` for URLs (fsspec options, ``cache_dir`` for fetched LMDB
    shards, retries and timeout every ranged GET and index read follows), or a local storage.
    Retired keywords (one release, with a ``FutureWarning`` naming the new spelling):
    ``storage_options=``/``cache_dir=`` (``storage=RemoteStorage(...)``), ``max_pixels=``
    (``decode=Decode(max_pixels=...)``).
    """

    def __init__(
        self,
        source,
        *,
        decode: str | Decode = "pil",
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        with_keys: bool = False,
        fields: Sequence[str] | Mapping[str, str | Callable] = (),
        storage=None,
        cache: ViewCache | None = None,
        **retired,
    ):
        if retired:  # the old spellings (one release): warn with the new one
            from .retired import translate

            unknown = sorted(set(retired) - _RETIRED)
            if unknown:
                raise UnknownKeywordError(
                    f"ShardView got an unknown keyword {unknown[0]}=; see help(shardkit.ShardView)"
                )
            _, decode, _, storage = translate(
                retired, source=source, decode=decode, order=None, storage=storage,
                owner="ShardView", groups=("decode", "storage"),
            )  # fmt: skip
        #: what a stored image becomes: the same ``Decode`` ShardDataset and ShardLoader take
        self.decode: Decode = Decode.of(decode)
        self.with_keys = bool(with_keys)
        self.transform, self.target_transform = transform, target_transform
        self.fields, self.field_decoders = field_spec(fields, self.decode.mode)
        self.max_pixels = self.decode.max_pixels
        self._decoder = None
        if self.decode.geometry is not None:  # torch: only a cropping view needs it
            from ..images.geometry import TensorDecoder

            self._decoder = TensorDecoder.of(self.decode)
        if cache is not None and not isinstance(cache, ViewCache):
            raise InputError(f"cache={cache!r}: give a shardkit.ViewCache(indexes=)")
        #: what the view holds for lookups: the bytes of shard indexes
        self.cache: ViewCache = cache or ViewCache()
        src = _one_source(source, self.fields)
        path = source if src is None else src.path
        own = None if src is None else src.storage_options
        self.where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "the shards"
        options = _options(own, storage, self.where)
        self.storage_options = options
        check_source(path, options)
        #: the samples a narrowing ``Source`` selects (positions, ascending); None: every one
        self._members: Selected | None = None
        if src is not None and (src.split is not None or src.subset is not None):
            mixed = resolve_mixed(
                src, storage, seed=0, offset=0, fields=self.fields,
                field_decoders=self.field_decoders, boxes=None,
            )  # fmt: skip
            self.format, classes, table = mixed.format, mixed.classes, mixed.shards
            self.storage = mixed.storage
            self._members = mixed.members
            manifest_at, listed = mixed.manifest[0], None  # its key file: read when asked
        else:
            resolved = resolve_source(path, storage_options=options)
            self.format, classes = resolved.format, resolved.classes
            table = resolved.shards  # columns: a ShardInfo made only for a shard asked about
            manifest_at = resolved.manifest_path
            listed = resolved.manifest.keys if resolved.manifest is not None else {}
            # one shard says local or URL: a shard list is all one or the other
            self.storage = _storage(_kind(table), storage, copy=own is not None, options=own)
        self.classes = list(classes) if classes else None
        self.shards: ShardTable = table
        #: the shard indexes held (on demand, within ``cache.indexes`` bytes)
        self._tables = IndexCache(self.cache.indexes, self._release)
        #: LMDB: per local shard, the file's identity when the view was made (a stat each)
        self._stamps: dict[str, tuple] = _lmdb_stamps(self.shards) if self.format == "lmdb" else {}
        lazy = bool((table.samples >= 0).all()) and all(table.sha256)
        try:
            empty_as_said(table, self.format, self.storage)  # never skipped on its word alone
            if lazy:  # the manifest's counts: nothing opened until a sample is asked for
                counts = table.samples.tolist()
            else:
                counts = []
                for k, shard in enumerate(self.shards):
                    table = self._index(shard)
                    self._tables.put(k, table, table.nbytes())
                    counts.append(table.samples)
        finally:
            self.storage.close()
        self._starts: list[int] = [0, *itertools.accumulate(counts)]  # bisect: no numpy per call
        self._open: dict[int, object] = {}
        self._pid = os.getpid()
        #: ``index(key)``: where the manifest lists a key file (a URL's read by ranged GETs):
        #: its path and listing; the listing None until read (a narrowing Source's manifest
        #: is read when asked)
        self._key_listing: tuple[str, dict | None] | None = (
            None if manifest_at is None else (manifest_at, listed)
        )
        #: the dataset's key file (``lookup.DatasetKeys``); False: it has none that serves
        self._dataset_keys: DatasetKeys | bool | None = None
        #: where it has none: every key hash sorted, in a private file (``lookup.KeyFile``)
        self._keyfile: KeyFile | None = None
        #: per shard: its hash column checked against its keys (``_by_keys``); and the keys'
        #: hashes of those whose column is not theirs
        self._vouched = np.zeros(len(self.shards), dtype=bool)
        self._fixed: dict[int, np.ndarray] = {}

    # --- the index --------------------------------------------------------------------------

    def _index(self, shard: ShardInfo) -> _Table:
        if self.format == "lmdb":
            return self._lmdb_table(shard)
        index = shard_index(shard, self.storage)
        if index is not None:  # one read of the index file beside the shard
            offsets = index.offsets.astype(np.int64)
            return _Table(index.samples, index, offsets, index.members, index.digests)
        try:
            with self.storage.open(shard) as stream:
                tally = tally_tar(stream, shard=shard.url, every=1, keys=True)
        except OSError as exc:
            raise StorageError(f"{shard.url}: cannot index ({exc})") from exc
        if shard.samples >= 0 and tally.samples != shard.samples:
            raise ShardFormatError(
                f"{shard.url}: holds {tally.samples} samples, its manifest says "
                f"{shard.samples}; the manifest belongs to another version of the shard: re-pack it"
            )
        end = shard.bytes if shard.bytes >= 0 else self._size(shard)
        return _Table(tally.samples, tally.keys, np.asarray([*tally.index, end], dtype=np.int64))

    def _lmdb_table(self, shard: ShardInfo) -> _Table:
        """Keys from the index record (one lookup), else from every value (older packs)."""
        reader = LmdbSampleReader(self.storage.local_path(shard), shard.url, walk=False)
        try:
            self._held_to(reader, shard.url)
            index = reader.index(shard.samples)
            keys = reader.keys() if index is None else index
            digests = None if index is None else index.digests
            return _Table(reader.samples, keys, np.empty(0, np.int64), digests=digests)
        finally:
            reader.close()

    def _table(self, k: int) -> _Table:
        table = self._tables.get(k)
        if table is None:
            table = self._index(self.shards[k])
            self._tables.put(k, table, table.nbytes())
        return table

    def _release(self, k: int) -> None:
        """Shard ``k``'s index was let go: close what this process opened for it."""
        handle = self._open.pop(k, None) if self._pid == os.getpid() else None
        if isinstance(handle, int):
            os.close(handle)
        elif handle is not None:
            handle.close()

    def _size(self, shard: ShardInfo) -> int:
        if not is_url(shard.url):
            return os.path.getsize(shard.url)
        fs, path = self._fs(shard.url)
        return int(fs.size(path))

    def _fs(self, url: str):
        from ..remote.fs import filesystem, protocol_of, strip

        fs = filesystem(protocol_of(url), self.storage_options)
        return fs, strip(fs, url)

    # --- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._starts[-1] if self._members is None else len(self._members)

    def keys(self) -> list[str]:
        """Every sample's key, in packed order (a narrowing ``Source``'s: those it selects)."""
        if self._members is None:
            return [k for i in range(len(self.shards)) for k in self._table(i).keys()]
        out = []
        for k in np.flatnonzero(self._members.per_shard).tolist():
            table = self._table(k)
            out += [table.key(j) for j in (self._members.shard(k) - self._starts[k]).tolist()]
        return out

    def _rank(self, position: int) -> int | None:
        """The view's index of the sample at ``position`` in packed order; None where a
        narrowing ``Source`` does not select it."""
        sel = self._members
        if sel is None:
            return position
        k = bisect.bisect_right(self._starts, position) - 1
        mine = sel.shard(k)
        at = int(np.searchsorted(mine, position))
        if at == len(mine) or int(mine[at]) != position:
            return None
        return int(sel.ends[k] - sel.per_shard[k]) + at

    def key(self, i) -> str:
        """Sample ``i``'s key (from the index, no sample read)."""
        shard, j = self._locate(i)
        return self._table(shard).key(j)

    def index(self, key: str) -> int:
        """The position of ``key`` (the first, should two shards hold the same key), by its
        key hash. Where the manifest lists a key file (``manifest.keys``, written by pack,
        append and merge), the one checked block of it the hash falls in (``os.pread``, nothing
        mapped; a URL's by ranged GETs; ``lookup.DatasetKeys``) names the shard(s) holding the
        hash, and the key is found in that shard's index (the bounded index cache) and
        confirmed on the real key:
        nothing built, nothing written, flat in memory, the first lookup as cheap as any; a
        hash no checked block holds is a missing key at once (the file's hashes were its keys'
        when written). Without one (packed before it existed, no manifest; a local
        manifest without one gets a warning saying how to get one), one that fails a check, or
        for a key whose named shard does not hold it (a file the manifest vouches for may still
        have been forged), the hashes the shards' indexes store are sorted with their
        positions into a private temporary file, once a view (``lookup.KeyFile``). A key no
        hash matches there is looked for in every shard's keys before it is called missing
        (``_by_keys``): a hash column may be wrong (damaged, or edited with its checksums
        computed again), and the keys, not their stored hashes, say what the dataset holds."""
        want = key_hashes([key])[0]
        keys = self._key_file_of_dataset()
        if keys is not None:
            try:
                named = keys.shards(want)
                found = self._in_shards(key, named)
            except RunUnchecked as exc:  # a block or table not its digest: not again
                self._refuse_keys(exc.path, exc.why)
            else:
                if found is not None:
                    return found
                if not keys.vouched():  # a file the manifest does not vouch for: not again
                    self._refuse_keys(keys.path, "its sha256 or its shards are not the manifest's")
                elif not named and keys.checked():  # no hash of it, from checked blocks
                    raise self._missing(key)

        # a key the key file misses (or no key file): the shards' own hash columns decide
        found = [p for p in self._key_file().candidates(want).tolist()]
        found = [p for p in found if self._at(p)[0] not in self._fixed]  # their columns lie
        for k, ours in self._fixed.items():  # the keys' own hashes stand in for those
            found += (np.flatnonzero(ours == want) + self._starts[k]).tolist()
        for i in sorted(found):
            k, j = self._at(i)
            if self._table(k).key(j) == key and self._rank(i) is not None:
                return self._rank(i)
        found = self._by_keys(key)
        if found is not None:
            return found
        raise self._missing(key)

    def _missing(self, key: str) -> InputError:
        some = "" if self._members is None else " (or not in the selection its Source makes)"
        return InputError(
            f"no sample with key {key!r} in {self.where}{some}; `shardkit ls` lists the keys"
        )

    def _in_shards(self, key: str, shards: list[int]) -> int | None:
        """The view's index of ``key`` in the first of ``shards`` that holds it (and, with a
        narrowing Source, selects it), found by each one's index; None where none does."""
        for k in shards:
            if not 0 <= k < len(self.shards):
                continue  # a file naming shards the manifest has not: never trusted
            table = self._table(k)
            j = table.position(key)
            if j is None:
                continue
            at = self._rank(self._starts[k] + j)  # a later copy, selected: found by a miss
            if at is not None:
                return at
        return None

    def _key_file_of_dataset(self) -> DatasetKeys | None:
        """The key file the manifest lists, once its size and head name this view's shards;
        None (and the private table from then on) where there is none that serves."""
        if self._dataset_keys is None:
            self._dataset_keys = False
            if self._key_listing is not None:
                manifest_at, listed = self._key_listing
                if listed is None:
                    opts = self.storage_options
                    listed = read_manifest(manifest_at, storage_options=opts).keys
                    self._key_listing = (manifest_at, listed)
                if listed:
                    path = _run_path(manifest_at, listed["path"])
                    n, folder = self._starts[-1], os.path.dirname(manifest_at)
                    read = _run_reader(manifest_at, self.storage)  # a URL's: ranged GETs
                    try:
                        keys, why = DatasetKeys.open(folder, listed, n, self.shards, read)
                    finally:
                        self.storage.close()
                    if keys is None:
                        self._refuse_keys(path, why)
                    else:
                        self._dataset_keys = keys
        return self._dataset_keys or None

    def _refuse_keys(self, path: str, why: str) -> None:
        """The key file at ``path`` does not serve: lookups use the private table instead."""
        if isinstance(self._dataset_keys, DatasetKeys):
            self._dataset_keys.close()
        self._dataset_keys = False
        fix = key_file_fix(path) if is_url(path) else f"write the key file again: {KEY_FILE_FIX}"
        warnings.warn(
            f"{path}: {why}; get(key) sorts every key hash into a private temporary file "
            f"instead ({fix})",
            RuntimeWarning,
            stacklevel=4,
        )

    def _key_file(self) -> KeyFile:
        """Every key hash sorted with its position, built into a private temporary file:
        what a dataset without a key file costs, once a view."""
        if self._keyfile is None:
            listing = self._key_listing  # an older local pack (a URL's: read by ranges)
            if listing is not None and not listing[1] and not is_url(listing[0]):
                warnings.warn(
                    f"{self.where}: no key file (manifest.keys) beside its manifest; get(key) "
                    f"sorts every key hash into a private temporary file, once a view (16 bytes "
                    f"a sample; write the key file: {KEY_FILE_FIX})",
                    RuntimeWarning,
                    stacklevel=4,
                )
            try:
                parts = (self._stored_hashes(k) for k in range(len(self.shards)))
                self._keyfile = KeyFile.build(parts, self._starts[-1])
            finally:
                self.storage.close()
        return self._keyfile

    def _starts_counts(self) -> np.ndarray:
        return np.diff(np.asarray(self._starts, np.int64))

    def _by_keys(self, key: str) -> int | None:
        """The position of ``key`` found by the keys themselves where no stored hash led to
        it: each shard whose hash column is not yet checked has its keys (its key table,
        checked against its manifest, or its headers where the index is refused) hashed, in C,
        and compared with the column. A column that agrees is vouched for from then on; one
        that does not is named in a warning, and the keys' hashes stand in for it (``_fixed``)
        in every lookup after. None where no shard holds the key. The first missing key costs
        one pass over every shard's keys (~90 bytes a sample read, 0.13 us a key hashed), one
        index at a time and none held; each one after, a lookup in the hashes."""
        want = key_hashes([key])[0]
        found = None
        try:
            for k in np.flatnonzero(~self._vouched).tolist():
                table = self._tables.get(k) or self._index(self.shards[k])  # not held: a pass
                keys = table._keys
                ours = table_hashes(keys) if isinstance(keys, _INDEXES) else key_hashes(keys)
                stored = np.asarray(self._hashes(k), np.uint64)
                self._vouched[k] = True
                if not np.array_equal(ours, stored):
                    self._fixed[k] = ours  # lookups use these for shard k from now on
                    self._lying(k, int(np.count_nonzero(ours != stored)))
                if found is None:
                    for j in np.flatnonzero(ours == want).tolist():
                        if table.key(j) == key and self._rank(self._starts[k] + j) is not None:
                            self._tables.put(k, table, table.nbytes())
                            found = self._rank(self._starts[k] + j)
                            break
        finally:
            self.storage.close()
        return found

    def _lying(self, k: int, bad: int) -> None:
        url = self.shards[k].url
        what, fix = (
            (f"{url}: its index record", "re-pack the shard")
            if self.format == "lmdb"
            else (f"{url}.idx", "delete it and run `shardkit index` on the dataset")
        )
        warnings.warn(
            f"{what}: {bad} stored split hash(es) are not their keys' hashes (the index is "
            f"damaged); keys are found by the keys' own hashes (rebuild it: {fix})",
            RuntimeWarning,
            stacklevel=4,
        )

    def _hashes(self, k: int) -> np.ndarray:
        """Shard ``k``'s key hashes in stored order: from its index already loaded, else the
        hash column alone (tar: 16 bytes a sample read; LMDB: its index record), else hashed
        from its keys (a shard without an index)."""
        if k in self._fixed:  # its column was found not to be its keys' (``_by_keys``)
            return self._fixed[k]
        return self._stored_hashes(k)

    def _stored_hashes(self, k: int) -> np.ndarray:
        """Shard ``k``'s key hashes as its index stores them (see ``_hashes``)."""
        table = self._tables.get(k)
        if table is not None and isinstance(table._keys, _INDEXES):
            return table._keys.hashes
        shard = self.shards[k]
        # the column, whatever is held: what the key table was built from (``_by_keys``
        # compares the keys with it), also where a held table's keys came from the headers
        if self.format == "tar":
            cols = shard_columns(shard, self.storage)
            if cols is not None:
                return cols.hashes
        elif self.format == "lmdb":  # the record read, not kept
            reader = LmdbSampleReader(self.storage.local_path(shard), shard.url, walk=False)
            try:
                self._held_to(reader, shard.url)
                index = reader.index(shard.samples)
            finally:
                reader.close()
            if index is not None:
                return index.hashes
        return key_hashes(self._table(k).keys())

    def get(self, key: str) -> tuple:
        """The sample whose key is ``key``, decoded as ``view[i]``."""
        return self[self.index(key)]

    def __getitem__(self, i) -> tuple:
        rec = self.record(i)
        if self.field_decoders is not None:
            extra = decoded_fields(rec, self.fields, self.field_decoders, self.decode)
        if self.decode.mode == "raw":
            img = rec.data
        else:
            try:
                if self._decoder is not None:  # a crop: drawn from (seed 0, epoch 0, key)
                    img = self._decoder(rec.data, rec.key)
                else:
                    img = self.decode.image(rec.data)
            except Exception as exc:
                raise sample_error(rec, exc) from exc
        label = rec.label
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            label = self.target_transform(label)
        head = (img, label, rec.key) if self.with_keys else (img, label)
        if self.field_decoders is not None:
            return head + extra
        if self.fields:
            extra = rec.fields or {}
            return head + tuple(extra.get(n.lower()) for n in self.fields)
        return head

    def record(self, i) -> Record:
        """Sample ``i`` as stored (bytes, label, key, fields): one read."""
        shard, j = self._locate(i)
        info = self.shards[shard]
        return self._record(shard, info, j, self.fields)

    def _record(self, shard: int, info: ShardInfo, j: int, fields) -> Record:
        table = self._table(shard)  # LMDB: first, for the identity the reader is held to
        if self.format == "lmdb":
            if table.digests is None:  # said once per dataset, when a sample is first read
                warn_undigested(info.url, "lmdb")
            rec = self._reader(shard, info).get(j, fields, table.digest(j))
        else:
            rec = read_sample(self._sample(shard, info, j, table), info.url, fields)
        if rec is None or rec.key != table.key(j):
            raise ShardFormatError(
                f"{info.url}: sample {j} is not where the index says (the shard changed since "
                "the view was made); make the view again"
            )
        return rec

    def members(self, i, names: Sequence[str] | None = None) -> list[tuple[str, bytes]]:
        """Every member of sample ``i`` as ``(extension, bytes)``, or only those whose
        extension is in ``names`` (``("txt", "json")``): where the shard's index lists the
        members, only their byte ranges are read (a caption without its image). LMDB gives the
        image, the label (as a tar's ``cls`` member; none for -1) and every field, in name
        order, as a tar lists them."""
        wanted = None if names is None else {n.lower() for n in names}
        if self.format == "lmdb":
            shard, j = self._locate(i)
            rec = self._record(shard, self.shards[shard], j, None)  # None: every field
            label = [] if rec.label == -1 else [("cls", str(rec.label).encode())]  # tar: no cls
            every = [(rec.ext, rec.data), *label, *rec.fields.items()]
            return [m for m in every if wanted is None or m[0].lower() in wanted]
        if wanted is not None:
            got = self._some_members(i, wanted)
            if got is not None:
                return got
        return [m for m in self._all_members(i) if wanted is None or m[0] in wanted]

    def _some_members(self, i, wanted: set[str]) -> list[tuple[str, bytes]] | None:
        """The ``wanted`` members of sample ``i``, each read as its header and data alone;
        None where the index lists no members or a header is not the member it should be
        (then the whole sample is read, and checked by its key)."""
        shard, j = self._locate(i)
        table, info = self._table(shard), self.shards[shard]
        if table.members is None:
            return None
        read = self._part_reader(shard, info, j, table)
        key = table.key(j).encode("utf-8", "surrogateescape")
        out = []
        for ext, at, size in table.members.of(j):
            if ext not in wanted:
                continue
            blob = read(at - BLOCK, at + size)
            name = blob[:100].rstrip(b"\0")
            want = key + b"." + ext.encode("utf-8", "surrogateescape")
            if name[: len(key)] != key[:100] or name.lower() != want[:100].lower():
                return None  # a long-name or PAX member, or the shard changed: read it whole
            if header_size(blob[:BLOCK]) != size:  # the index's size is not the header's
                _lying_index(info.url, j, f"member {ext!r} of {size} bytes")
                return None
            out.append((ext, blob[BLOCK:]))
        return out

    def _all_members(self, i) -> list[tuple[str, bytes]]:
        from ..formats.tar.parse import _Buffer
        from ..formats.tar.tally import _walk

        shard, j = self._locate(i)
        table, info = self._table(shard), self.shards[shard]
        blob = self._sample(shard, info, j, table)
        key = table.key(j).encode("utf-8", "surrogateescape")
        out = []
        buf = _Buffer(io.BytesIO(blob + _END), info.url, len(blob) + len(_END))
        for _, k, ext, data, _, _ in _walk(buf, lambda k, e: True):  # one read, one parse
            if k != key:
                break
            out.append((ext.decode("utf-8", "surrogateescape"), data or b""))
        if not out:
            raise ShardFormatError(
                f"{info.url}: sample {j} is not where the index says (the shard changed since "
                "the view was made); make the view again"
            )
        return out

    def summary(self, i) -> SampleSummary:
        """Sample ``i``'s key, label and members' sizes. Where a local shard's index lists the
        members, each member's header is read (not its data; a label's data too) and its name
        and size checked against the index's, and the label is the label member's: a few
        hundred bytes a member, never the image. Else (or where they differ: a warning names
        the index) from the sample's members, read whole. A remote shard's summary is its
        index's (one ranged GET a member would make ``ls`` slow), that index checked against
        the manifest's ``index_sha256`` when it was loaded."""
        shard, j = self._locate(i)
        table = self._table(shard)
        if self.format == "tar" and table.members is not None:
            if is_url(self.shards[shard].url):  # a GET a member: the index's (its sha256 the
                sizes = [(ext, size) for ext, _, size in table.members.of(j)]  # manifest's)
                return SampleSummary(table.key(j), int(table.members.labels[j]), sizes)
            got = self._checked_summary(shard, j, table)
            if got is not None:
                return got
        members = self.members(i)
        return SampleSummary(self.key(i), _label_of(members), [(e, len(d)) for e, d in members])

    def _checked_summary(self, shard: int, j: int, table: _Table) -> SampleSummary | None:
        """The summary from the index, each member's header read and compared with it; None
        where a header is not what the index says (a long name read whole; else a warning)."""
        info = self.shards[shard]
        read = self._part_reader(shard, info, j, table)
        key = table.key(j).encode("utf-8", "surrogateescape")
        sizes, label_data = [], None
        for ext, at, size in table.members.of(j):
            labelled = label_data is None and ext.lower() in LABEL_EXTS
            blob = read(at - BLOCK, at + size if labelled else at)
            name = blob[:100].rstrip(b"\0")
            want = key + b"." + ext.encode("utf-8", "surrogateescape")
            if name[: len(key)] != key[:100] or name.lower() != want[:100].lower():
                return None  # a long-name or PAX member: the sample is read whole
            if header_size(blob[:BLOCK]) != size:
                _lying_index(info.url, j, f"member {ext!r} of {size} bytes")
                return None
            if labelled:
                label_data = blob[BLOCK:]
            sizes.append((ext, size))
        label = _label_of([("cls", label_data)]) if label_data is not None else -1
        if label != int(table.members.labels[j]):
            _lying_index(info.url, j, f"label {int(table.members.labels[j])}")
            return None
        return SampleSummary(table.key(j), label, sizes)

    def _locate(self, i) -> tuple[int, int]:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"view index must be an int, not {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} is out of range: {self.where} holds {n} (0..{n - 1})")
        i = int(i) % n
        if self._members is not None:  # the i-th sample the Source selects
            i = int(self._members.take(np.asarray([i]))[0])
        return self._at(i)

    def _at(self, position: int) -> tuple[int, int]:
        """(shard, sample in it) of ``position`` in packed order."""
        shard = bisect.bisect_right(self._starts, position) - 1
        return shard, position - self._starts[shard]

    def _reader(self, shard: int, info: ShardInfo):
        self._fresh()
        reader = self._open.get(shard)
        if reader is None:
            reader = LmdbSampleReader(self.storage.local_path(info), info.url)
            self._held_to(reader, info.url)
            self._open[shard] = reader
        return reader

    def _held_to(self, reader: LmdbSampleReader, url: str) -> None:
        """Refuse an LMDB shard that is no longer the file the view was made on."""
        if reader.stamp != self._stamps.setdefault(url, reader.stamp) and not is_url(url):
            reader.close()
            raise ShardFormatError(
                f"{url}: the LMDB shard was replaced or rewritten since the view was "
                "made; make the view again"
            )

    def _sample(self, shard: int, info: ShardInfo, j: int, table: _Table) -> bytes:
        """Sample ``j``'s bytes as its index places them, checked against its digest where the
        index has one (``ranges.check_sample``: a remote range that differs is fetched once
        more, then it is an error; never other bytes than packed)."""
        start, stop = int(table.offsets[j]), int(table.offsets[j + 1])
        if table.digests is None:  # said once per dataset, when a sample is first read
            warn_undigested(info.url, "tar")
        data = self._read(shard, info, start, stop)
        again = (lambda: self._read(shard, info, start, stop)) if is_url(info.url) else None
        return check_sample(info, j, data, table.digest(j), self.storage, again)

    def _part_reader(self, shard: int, info: ShardInfo, j: int, table: _Table):
        """``read(start, stop)`` of bytes within sample ``j``: where its index holds digests,
        slices of the whole sample, read once and checked (a member alone cannot be checked:
        the digest covers the sample); else a read of those bytes alone, as before digests."""
        if table.digests is None:
            warn_undigested(info.url, "tar")
            return lambda a, b: self._read(shard, info, a, b)
        base = int(table.offsets[j])
        whole = memoryview(self._sample(shard, info, j, table))
        return lambda a, b: bytes(whole[a - base : b - base])

    def _read(self, shard: int, info: ShardInfo, start: int, stop: int) -> bytes:
        self._fresh()

        def fd() -> int:
            if shard not in self._open:
                self._open[shard] = os.open(info.url, os.O_RDONLY)
            return self._open[shard]

        fix = "re-pack it or make the view again"
        return read_range(info.url, start, stop, fd, self.storage, fix)

    def _fresh(self) -> None:
        """Files and environments are per process: a forked worker opens its own."""
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()

    def close(self) -> None:
        """Close the shards this process opened (a view dropped without it closes them when
        it is collected: ``__del__``)."""
        keyfile = getattr(self, "_keyfile", None)
        if keyfile is not None:  # private: gone with its descriptor
            keyfile.close()
            self._keyfile = None
        dataset_keys = getattr(self, "_dataset_keys", None)
        if isinstance(dataset_keys, DatasetKeys):  # mapped again when read
            dataset_keys.close()
        handles, self._open = getattr(self, "_open", {}), {}
        for handle in handles.values():
            if isinstance(handle, int):
                os.close(handle)
            else:
                handle.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, a descriptor closed elsewhere: nothing to do
            pass

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"] = {}
        state["_tables"] = None  # indexes are read again where they are used
        state["_keyfile"] = None  # a private table is built again where lookups are made
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tables = IndexCache(self.cache.indexes, self._release)

    def __add__(self, other):
        """``view + other``: torch's ``ConcatDataset`` of both, as a torch ``Dataset`` gives."""
        from torch.utils.data import ConcatDataset

        return ConcatDataset([self, other])

    def __repr__(self) -> str:
        return f"ShardView({len(self.shards)} {self.format} shards, {len(self)} samples)"


_INDEXES = (SampleIndex, LmdbIndex)


def _one_source(source, fields: Sequence[str]) -> Source | None:
    """The ``Source`` a view is given (None: a path, glob or shard list), refusing what cannot
    take effect on one view: several sources, a weight, fields left out."""
    if isinstance(source, Source):
        if source.weight is not None:
            raise InputError(
                f"ShardView(Source({source.name!r}, weight={source.weight})): a weight shares an "
                "epoch among several sources, a view reads one: leave weight out"
            )
        left = [f for f in fields if source.fields is not None and f.lower() not in source.fields]
        if left:
            raise InputError(
                f"ShardView(Source({source.name!r}, fields={list(source.fields)})) leaves out "
                f"the view's field {left[0]!r}: give the view only fields the source carries"
            )
        return source
    many = not isinstance(source, (str, os.PathLike)) and isinstance(source, Sequence)
    if many and any(isinstance(s, Source) for s in source):
        raise InputError(
            "ShardView reads one source: make a view of each Source and join them "
            "(view_a + view_b is torch's ConcatDataset)"
        )
    return None


def _lmdb_stamps(shards: Sequence[ShardInfo]) -> dict[str, tuple]:
    """The identity of each local LMDB shard now (one stat each: nothing read), so a shard
    replaced before the view first reads it is refused like one replaced after."""
    stamps = {}
    for shard in shards:
        if not is_url(shard.url):
            try:
                stamps[shard.url] = file_stamp(shard.url)
            except OSError:
                pass  # missing or unreadable: opening it names the shard
    return stamps


@dataclass(frozen=True)
class SampleSummary:
    """What ``shardkit ls`` prints of a sample: its key, label and ``(extension, size)`` of
    each member, in stored order."""

    key: str
    label: int
    members: list[tuple[str, int]]


def header_size(header: bytes) -> int:
    """The data size a tar header gives (octal, or GNU base-256); -1 where it is not a
    number (never a member's size)."""
    field = header[124:136]
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return -1


def _lying_index(url: str, j: int, what: str) -> None:
    """Warn that ``url``'s sample index does not describe the shard's headers (the sample is
    then read from its headers: the bytes and label handed out are the shard's)."""
    warnings.warn(
        f"{url}.idx: sample {j}'s {what} in the sample index is not what the shard's header "
        "says; reading the sample from its headers instead (rebuild the index: delete it and "
        "run `shardkit index` on the dataset)",
        RuntimeWarning,
        stacklevel=4,
    )


def _label_of(members: list[tuple[str, bytes]]) -> int:
    """The label as a reader gives it: the first label member as decimal, else -1."""
    for ext, data in members:
        if ext.lower() in LABEL_EXTS:
            try:
                return int(data)
            except ValueError:
                return -1
    return -1


class _Table:
    """One shard's keys and sample byte ranges: a ``SampleIndex`` (read from the file beside the
    shard), an ``LmdbIndex`` (the record inside it), or what a walk over its headers or values
    gave (a key list; a dict built on the first lookup). ``members``: each sample's members,
    where the index lists them (tar index version 2)."""

    __slots__ = ("samples", "_keys", "offsets", "_by_key", "members", "digests")

    def __init__(
        self,
        samples: int,
        keys,
        offsets: np.ndarray,
        members: Members | None = None,
        digests: np.ndarray | None = None,
    ):
        self.samples, self._keys, self.offsets = samples, keys, offsets
        self.members = members
        #: Each sample's digest (tar index version 3, LMDB index record version 2); None where
        #: the index predates them or there is none (reads unchecked: a warning said so).
        self.digests = digests
        self._by_key: dict[str, int] | None = None

    def digest(self, j: int) -> int | None:
        return None if self.digests is None else int(self.digests[j])

    def nbytes(self) -> int:
        """About the bytes this holds: its arrays and key table (an index's numpy views over
        the file's bytes: about the file's size), or its key list's strings."""
        size = self.offsets.nbytes + (0 if self.digests is None else self.digests.nbytes)
        keys = self._keys
        if isinstance(keys, _INDEXES):
            size += len(keys.table) + keys.ends.nbytes + keys.hashes.nbytes
        else:
            size += sum(len(k) + 56 for k in keys)
        m = self.members
        if m is not None:
            size += m.labels.nbytes + m.starts.nbytes + m.offsets.nbytes + m.sizes.nbytes
            size += m.ids.nbytes
        return size

    def key(self, j: int) -> str:
        keys = self._keys
        return keys.key(j) if isinstance(keys, _INDEXES) else keys[j]

    def keys(self) -> list[str]:
        keys = self._keys
        return keys.keys() if isinstance(keys, _INDEXES) else list(keys)

    def position(self, key: str) -> int | None:
        if isinstance(self._keys, _INDEXES):
            return self._keys.position(key)
        if self._by_key is None:
            self._by_key = {}
            for j, k in enumerate(self._keys):
                self._by_key.setdefault(k, j)
        return self._by_key.get(key)
