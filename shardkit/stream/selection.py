"""What a dataset reads, as one value: ``select`` turns the ``source`` a user gives (a path,
glob, list of shards, a ``Source`` or a list of them) into a ``Selection``, and this module
resolves it into shards, storage and the samples each source may draw.

A plain path is a one-source selection, and so is one ``Source`` that narrows nothing (no
subset, no split, no ``epoch_size``; a weight means nothing alone): both are read by the plain
epoch's plan (``stream.partition.EpochLayout``), so wrapping a path in ``Source`` changes
neither the samples, their order nor the checkpoint, and a state saved under one spelling
loads under the other. Anything narrower or several sources take the mixture's plan
(``stream.mix``).
"""

from __future__ import annotations

import copy as _copy
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, check_choice, check_int
from ..formats import FORMATS
from ..paths import check_source
from ..records import UNKNOWN, ShardInfo, ShardTable
from ..urls import join_url, url_parent
from .fields import decode_field_image
from .indexes import ShardSplit, all_keys, shard_keys, split_bits, val_mask, warn_unindexed
from .lookup import key_shards, split_counts
from .members import (
    AllMembers,
    KeyedMembers,
    Members,
    RankedMembers,
    ShardSideMembers,
    SideMembers,
)
from .mix import (
    LABEL_MODES,
    MixedSource,
    Source,
    key_hashes,
    missing_keys,
    subset_members,
    subset_ranks,
)
from .partition import sample_counts
from .sources import ShardSource, resolve_source
from .stages import count_samples, empty_as_said, file_identity
from .storage import LocalStorage, Storage, is_url, storage_for

__all__ = ["Selection", "select"]


@dataclass(frozen=True)
class Selection:
    """What a dataset reads. ``plain``: one source read whole in the plain epoch's order,
    ``path`` with its own fsspec ``storage_options`` (a ``Source``'s; None: the storage's);
    else ``sources`` mixed (``epoch_size``, ``labels`` as given to the dataset)."""

    sources: tuple[Source, ...]
    plain: bool
    path: object = None
    storage_options: dict | None = None
    name: str = ""
    epoch_size: int | None = None
    labels: str = "keep"


def select(source, *, epoch_size=None, labels="keep", fields=()) -> Selection:
    """The ``Selection`` ``source`` names (checks ``epoch_size`` and ``labels``). ``fields``:
    the dataset's, so that a single ``Source(fields=...)`` carrying all of them is plain."""
    check_choice("labels", labels, LABEL_MODES)
    hint = " (an int, samples per epoch) or None (the sources' sizes)"
    check_int("epoch_size", epoch_size, 1, none=True, hint=hint)
    sources = _as_sources(source)
    if sources is None:
        if epoch_size is not None:
            return Selection((Source(source),), False, epoch_size=epoch_size, labels=labels)
        if labels != "keep":
            raise InputError(
                'labels="union" maps the class lists of several Source()s; a single source '
                "keeps its labels"
            )
        return Selection((), True, path=source, name=_describe(source))
    if len(sources) == 1 and epoch_size is None and labels == "keep":
        (src,) = sources
        carried = src.fields is None or all(f.lower() in src.fields for f in fields)
        if src.subset is None and src.split is None and carried:
            return Selection(
                (src,), True, path=src.path, storage_options=src.storage_options, name=src.name
            )
    return Selection(tuple(sources), False, epoch_size=epoch_size, labels=labels)


def _as_sources(source) -> list[Source] | None:
    """The ``Source`` list given, or None for a plain source (a path, glob, list of shards)."""
    if isinstance(source, Source):
        return [source]
    if isinstance(source, (str, os.PathLike)):
        return None
    if not isinstance(source, Sequence):
        raise InputError(
            f"source={source!r}: give a directory, manifest, glob, URL, a list of shard paths "
            "or of Source()s"
        )
    if len(source) > 0 and all(isinstance(s, Source) for s in source):
        return list(source)
    if any(isinstance(s, Source) for s in source):
        raise InputError("a source list mixes Source()s and paths: wrap every path in Source()")
    return None


# --- resolving a selection --------------------------------------------------------------------


def resolve_plain(selection: Selection, storage) -> tuple[ShardSource, Storage, ShardTable]:
    """A plain selection's shards (counted) and the storage that reads them."""
    options = _options(selection.storage_options, storage, selection.name)
    check_source(selection.path, options)  # "no such file", "no such bucket": named first
    resolved = resolve_source(selection.path, storage_options=options)
    own = selection.storage_options is not None
    store = _storage(_kind(resolved.shards), storage, copy=own, options=selection.storage_options)
    # Counted once here, in the main process, so workers never open a shard just to plan.
    return resolved, store, _counted(resolved.shards, resolved.format, store)


def resolve_mixed(
    src: Source, storage, *, seed: int, offset: int, fields, field_decoders, boxes
) -> MixedSource:
    """One ``Source`` of a mixture: shards, storage (its own copy of ``storage``), the samples
    it may draw (subset, split), its class list; its samples numbered from ``offset``."""
    _check_source_fields(src, fields, field_decoders, boxes)
    opts = _options(src.storage_options, storage, src.name)
    check_source(src.path, opts)
    r = resolve_source(src.path, storage_options=opts)
    store = _storage(_kind(r.shards), storage, copy=True, options=src.storage_options)
    shards = _counted(r.shards, r.format, store)
    by_keys = src.subset is not None and _is_keys(src.subset)
    if src.split is not None or src.subset is not None:
        warn_unindexed(shards, r.format, src.name, "split" if src.split else "subset")
    val_bits, refused = None, set()
    # a key subset's shards from the key file, each key confirmed in its shard when reached
    keyed = _keyed_subset(src, r, shards, store, opts, refused) if by_keys else None
    lazy = None
    if src.split is not None and (keyed is not None or not by_keys):
        lazy = _keyed_split(src, r, shards, store, opts, refused)
        keyed = keyed if lazy is not None else None
    # else a key subset's keys: from the indexes that check out (a refused one, damaged or
    # stale, is named, and its shard's headers give the keys and its samples)
    keys = all_keys(shards, r.format, store, opts, refused) if by_keys and not keyed else None
    counts = sample_counts(shards)
    if src.split is None:
        members: Members = AllMembers(counts)
    elif lazy is not None:  # counts from the key file, a shard's index read when reached
        members = lazy
    else:  # the indexes' hashes: no key read where they exist
        if keys is None:  # one shard's hashes at a time: the bits and a count a shard
            val_bits, per_shard = split_bits(
                shards, r.format, store, src.val_fraction, opts, refused
            )
        else:
            val = val_mask(key_hashes(keys), src.val_fraction)
            val_bits = np.packbits(val)
            at = np.concatenate(([0], np.cumsum(counts)))
            per_shard = np.diff(np.searchsorted(np.flatnonzero(val), at))
            del val
        members = SideMembers(counts, val_bits, per_shard, src.split == "val")
    if keyed is not None:  # its keys on the split's side (their own hashes), if split
        members = keyed if lazy is None else keyed.narrowed(_side_of(src))
    elif lazy is not None and src.subset is not None:  # drawn ranks: positions when reached
        members = RankedMembers(lazy, subset_ranks(lazy, src.subset, seed))
    else:
        members = subset_members(members, src.subset, seed, keys, src.name)
    if len(members) == 0:
        raise InputError(f"{src.name}: no samples to draw (empty shards, subset or split)")
    classes = tuple(r.classes) if r.classes else None
    mixed = MixedSource(src, shards, r.format, store, classes, members, offset)
    mixed.manifest = (r.manifest_path, file_identity(r.manifest_path))
    mixed.val_bits, mixed.unindexed = val_bits, frozenset(refused)
    if lazy is not None or keyed is not None:  # filled as shards are reached, in the
        mixed.side, mixed.unindexed = lazy, refused  # process that reads them
    return mixed


def _keyed_subset(
    src: Source, r: ShardSource, shards: ShardTable, store: Storage, opts, refused: set
) -> KeyedMembers | None:
    """A subset by keys whose shards come from the dataset's key file (``lookup.key_shards``:
    a binary search of checked blocks a key), each key found in its shard's own index only
    when an epoch first reaches the shard (``_KeysInShard``): a key no block holds is named
    here, at construction, as before; one the key file puts in a shard that does not hold it
    (its hash is another key's) is named when a reader reaches that shard. None (every
    shard's keys read, as before) where the key file does not serve (``_key_listing``), or a
    key's hash is in more than one shard (a key packed twice, or two keys of one hash)."""
    folder = _key_listing(r)
    if folder is None:
        return None
    wanted = list(dict.fromkeys(src.subset))  # each key once, in the order given
    find = _KeysInShard(shards, r.format, store, opts, refused, src.name)
    if not wanted:  # no members: nothing to look for (refused below, as before)
        return KeyedMembers(sample_counts(shards), {}, find)
    n = int(shards.samples.sum())
    read = _run_reader(r.manifest_path, store)  # a URL's by ranged GETs
    found, why = key_shards(folder, r.manifest.keys, n, shards, key_hashes(wanted), read)
    if found is None:
        where = _run_path(r.manifest_path, r.manifest.keys["path"])
        warnings.warn(
            f"{where}: {why}; the subset reads every shard's keys instead ({key_file_fix(where)})",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    if any(len(f) > 1 for f in found):
        return None
    missing = [k for k, f in zip(wanted, found, strict=True) if not len(f)]
    if missing:
        raise missing_keys(src.name, missing)
    by_shard: dict[int, list[str]] = {}
    for k, f in zip(wanted, found, strict=True):
        by_shard.setdefault(int(f[0]), []).append(k)
    return KeyedMembers(sample_counts(shards), by_shard, find)


@dataclass
class _KeysInShard:
    """Shard i's positions of ``keys`` (ascending), from its own keys (its index, else its
    headers: ``indexes.shard_keys``; ``refused`` gains a shard whose index was not used); a
    key it does not hold is the subset's one-line error, naming the key."""

    shards: ShardTable
    fmt: str
    storage: Storage
    storage_options: dict | None
    refused: set
    where: str

    def __call__(self, i: int, keys: list[str]) -> np.ndarray:
        held = shard_keys(
            self.shards[i], self.fmt, self.storage, self.storage_options, self.refused
        )
        at = {k: j for j, k in enumerate(held)}  # the last, as a subset has always taken
        missing = [k for k in keys if k not in at]
        if missing:
            raise missing_keys(self.where, missing)
        return np.sort(np.asarray([at[k] for k in keys], dtype=np.int64))


def _side_of(src: Source):
    """The keys of a list on ``src``'s side of its split, by their own hashes."""
    threshold = np.uint64(math.ceil(src.val_fraction * 2**64))
    val = src.split == "val"

    def keep(keys: list[str]) -> list[str]:
        side = key_hashes(keys) < threshold
        return [k for k, v in zip(keys, side.tolist(), strict=True) if v == val]

    return keep


def _key_listing(r: ShardSource) -> str | None:
    """The folder of the key file a manifest lists (a URL's: read by ranged GETs,
    ``_run_reader``); None where there is none to read (shards without a manifest, a manifest
    that lists none: older packs, ``shardkit index``)."""
    listed = r.manifest.keys if r.manifest is not None else None
    if not listed or not r.manifest_path:
        return None
    return os.path.dirname(r.manifest_path)


def _keyed_split(
    src: Source, r: ShardSource, shards: ShardTable, store: Storage, opts, refused: set
) -> ShardSideMembers | None:
    """A split whose per-shard counts come from the dataset's key file (``manifest.keys``,
    ``lookup.split_counts``), each shard's sides read from its index only when an epoch first
    reaches it (``indexes.ShardSplit``); None (the split reads every shard's index, as
    before) where there is none to read: shards without a manifest, a manifest that lists
    none (older packs, ``shardkit index``), or one that does not serve (named in a warning).
    A URL dataset's key file is read by ranged GETs (``remote.ranged.RangedFile``, under
    ``store``'s retry policy): its head, block table and val-prefix blocks, not every
    shard's index."""
    listed = r.manifest.keys if r.manifest is not None else None
    if not listed or not r.manifest_path:
        return None
    folder = os.path.dirname(r.manifest_path)
    path = _run_path(r.manifest_path, listed["path"])
    threshold = math.ceil(src.val_fraction * 2**64)
    # the table, not the manifest's list: a list or glob of some of its shards has its
    # manifest too, and the key file's head names the manifest's whole list, in order
    n = int(shards.samples.sum())
    per_shard, why = split_counts(
        folder, listed, n, shards, threshold, _run_reader(r.manifest_path, store)
    )
    if per_shard is None:
        warnings.warn(
            f"{path}: {why}; the split reads every shard's index instead ({key_file_fix(path)})",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    load = ShardSplit(shards, r.format, store, threshold, per_shard, path, opts, refused)
    return ShardSideMembers(sample_counts(shards), per_shard, src.split == "val", load)


def key_file_fix(path: str) -> str:
    """How a key file at ``path`` that does not serve is written again."""
    if is_url(path):
        return "upload the key file its pack wrote, or pack the dataset again"
    return "the next append or merge writes the key file anew"


def _run_path(manifest_path: str, name: str) -> str:
    """A key-file run's path beside its manifest (a URL's: its query string kept last)."""
    if is_url(manifest_path):
        return join_url(url_parent(manifest_path), name)
    return os.path.join(os.path.dirname(manifest_path), name)


def _run_reader(manifest_path: str, store: Storage):
    """How ``split_counts``, ``key_shards`` and a view's ``DatasetKeys`` read a key file's run
    (as the manifest at ``manifest_path`` lists it): None for a local dataset (its files); a
    URL dataset's by ranged GETs of the run's listed size under ``store``'s retry policy and
    timeout."""
    if not is_url(manifest_path):
        return None
    from ..remote.ranged import RangedFile

    def read(run: dict) -> RangedFile:
        return RangedFile(_run_path(manifest_path, run["path"]), store, int(run["bytes"]))

    return read


def _options(own: dict | None, storage, name: str) -> dict | None:
    """The fsspec options a source is resolved with: its own, else the storage's; both refused."""
    if own is not None and _options_of(storage):
        raise InputError(
            f"{name}: Source(storage_options=) and storage=RemoteStorage("
            "storage_options=) both give fsspec options: give them in one place (the "
            "Source's for this source alone, the storage's for every source)"
        )
    return own if own is not None else _options_of(storage)


def _is_keys(subset) -> bool:
    return not isinstance(subset, (int, float))


def _check_source_fields(src: Source, fields, decoders, boxes) -> None:
    """A ``Source(fields=...)`` may leave out text-like fields (None in its samples), not a
    mask nor the boxes' field: those are cut with the image, and None has no pixels."""
    if src.fields is None:
        return
    for name, decode in zip(fields, decoders or (None,) * len(fields), strict=True):
        if name.lower() in src.fields:
            continue
        if decode is decode_field_image or (boxes is not None and boxes.field == name):
            raise InputError(
                f"{src.name}: Source(fields={list(src.fields)}) leaves out {name!r}, which is "
                "cut with the image (a mask or the boxes' field): every source must carry it"
            )


def _options_of(storage) -> dict | None:
    """The fsspec options a storage object carries (``RemoteStorage``), to resolve URLs with."""
    options = getattr(storage, "storage_options", None)
    return dict(options) if options else None


def _storage(urls: list[str], storage, *, copy: bool, options: dict | None = None) -> Storage:
    """The storage to read ``urls`` with: the default for them without ``storage``; a storage
    that only configures URLs (``RemoteStorage``) leaves local paths to ``LocalStorage``;
    ``copy``: a copy of its own (a mixture's sources each hold one: it is configuration only),
    with a ``Source``'s own fsspec ``options`` where it gives them."""
    if storage is None:
        return storage_for(urls, storage_options=options)
    urls_only = getattr(storage, "urls_only", False)
    if urls_only and not any(is_url(os.fspath(u)) for u in urls):
        return LocalStorage()
    if not isinstance(storage, Storage):
        raise InputError(
            f"storage={storage!r} is not a storage: give shardkit.remote.RemoteStorage(...), "
            "LocalStorage() or an object with open/local_path/prefetch/close"
        )
    if not copy:
        return storage
    own = _copy.copy(storage)
    if urls_only and options is not None:
        own.storage_options = dict(options)
    return own


def mixed_classes(sources: Sequence[MixedSource], labels: str) -> list[str] | None:
    """The dataset's class list. "keep": stored labels as they are, so the sources' class lists
    must agree label by label (a longer list may add classes at the end, as ``merge`` allows;
    the longest is the dataset's; a source without a list, e.g. foreign tars or captions, is
    not compared, and then there is none); two that disagree are refused, naming both.
    "union": names merged in source order; labels mapped to it."""
    if labels == "keep":
        return _kept_classes(sources)
    missing = [s.source.name for s in sources if not s.classes]
    if missing:
        raise InputError(
            f'labels="union" maps class names, but {missing[0]} has no class list (no manifest); '
            'pack it with shardkit or use labels="keep"'
        )
    union: dict[str, int] = {}
    for s in sources:
        for name in s.classes:
            union.setdefault(name, len(union))
        s.labels = np.asarray([union[n] for n in s.classes], dtype=np.int64)
    return list(union)


def _kept_classes(sources: Sequence[MixedSource]) -> list[str] | None:
    named = [s for s in sources if s.classes]
    longest = max(named, key=lambda s: len(s.classes), default=None)
    for s in named:
        if tuple(longest.classes[: len(s.classes)]) != tuple(s.classes):
            raise InputError(
                f"{s.source.name} and {longest.source.name} store labels under other class "
                f"lists ({_shown(s.classes)} and {_shown(longest.classes)}), so a stored label "
                'would mean two classes: pass labels="union" (maps them by name)'
            )
    if longest is None or len(named) < len(sources):
        return None
    return list(longest.classes)


def _shown(classes: Sequence[str], most: int = 6) -> str:
    names = ", ".join(map(repr, classes[:most]))
    return f"[{names}{', ...' if len(classes) > most else ''}]"


def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return f"the list of {len(source)} shards"


def _counted(shards: Sequence[ShardInfo], format: str, storage: Storage) -> ShardTable:
    """The shards as a table with every count known: shards no manifest covers are counted by
    reading (only those are made into a ``ShardInfo``); a shard whose entry says 0 samples is
    read too (``empty_as_said``)."""
    table = ShardTable.of(shards)
    empty_as_said(table, format, storage)
    unknown = np.flatnonzero(table.samples == UNKNOWN).tolist()
    if not unknown:
        return table
    fmt = FORMATS[format]
    counts = table.samples.copy()
    try:
        for i in unknown:
            counts[i] = count_samples(fmt, storage, table[i])
    finally:
        storage.close()
    return table.with_samples(counts)


def _kind(shards: ShardTable) -> list[str]:
    """One shard URL for ``_storage`` to choose local or remote storage by: a shard list is all
    URLs or all paths (``resolve_source`` refuses a mix), so one stands for every one."""
    return [shards.url(0)] if len(shards) else []
