"""Counting and indexing a tar shard by its headers only (``shardkit index``, ``len()``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from ...errors import ShardFormatError
from ...manifest import INDEX_EVERY
from .parse import (
    _IMAGE,
    _LABEL,
    _ZERO_BLOCK,
    BLOCK,
    _bad_header,
    _bad_label,
    _Buffer,
    _compressed,
    _duplicate,
    _header_name,
    _kind,
    _name_of,
    _octal,
    _open,
    _pax_path,
    _second_end_block,
    _sequential,
    split_member_name,
)

__all__ = ["MemberLog", "TarTally", "count_tar_samples", "tally_tar", "warn_imageless"]


def _walk(  # noqa: C901 (_scan's plain twin, by headers only)
    b: _Buffer, wants: Callable[[bytes, bytes], bool]
) -> Iterator[tuple[int, bytes, bytes, bytes | None, int, int]]:
    """Every regular member as ``(offset, key, lowercased ext, data, data offset, size)``,
    data only where ``wants(key, ext)``; ``offset`` is that of its first header (long-name
    records included), ``data offset`` that of its first data byte.

    Same rules as ``_scan`` (which inlines them for speed), written plainly through the buffer's
    methods: counting and indexing read headers only, so this is not the hot path.
    """
    shard = b.shard
    long_name: bytes | None = None
    first_header: int | None = None
    while True:
        if not b.fill(BLOCK):
            raise ShardFormatError(
                f"{shard}: truncated tar: the shard ends at byte "
                f"{b.size if b.size is not None else b.base + b.end} without its end-of-archive "
                "blocks; re-copy or re-pack the shard"
            )
        here = b.base + b.pos
        hdr = bytes(b.mv[b.pos : b.pos + BLOCK])
        if hdr[257:262] != b"ustar":
            if hdr == _ZERO_BLOCK:
                _second_end_block(b, b.pos + BLOCK)
                return
            if here == 0:
                _compressed(hdr, shard)
            if _octal(hdr[148:156], shard, here) != sum(hdr) - sum(hdr[148:156]) + 256:
                raise _bad_header(shard, here, "checksum mismatch")
        size = _octal(hdr[124:136], shard, here)
        if size < 0:
            raise _bad_header(shard, here, "negative size")
        padded = (size + 511) & ~511
        typeflag = hdr[156]
        b.pos += BLOCK
        if first_header is None:
            first_header = here
        if typeflag in (76, 120):  # 'L' GNU long name, 'x' PAX header: name of the next one
            if not b.fill(padded):
                b.truncated("a long-name record", padded)
            data = bytes(b.mv[b.pos : b.pos + size])
            b.pos += padded
            long_name = data.rstrip(b"\x00") if typeflag == 76 else _pax_path(data, shard, here)
            continue
        name = long_name if long_name is not None else _header_name(hdr)
        long_name = None
        k, ext = split_member_name(name)
        if typeflag not in (48, 0, 55) or k is None:
            b.skip(padded, "a member")
            first_header = None
            continue
        ext = ext.lower()
        data_at = b.base + b.pos
        if wants(k, ext):
            if not b.fill(padded):
                b.truncated(f"member {name.decode(errors='replace')}", padded)
            data_or_none: bytes | None = bytes(b.mv[b.pos : b.pos + size])
            b.pos += padded
        else:
            data_or_none = None
            b.skip(padded, "a member")
        yield first_header, k, ext, data_or_none, data_at, size
        first_header = None


class MemberLog:
    """Each sample's label and members (lowercased extension, data offset, data size), in
    stored order, as a writer writes them or a walk over the headers meets them: the members
    section of a sample index (``formats.sample_index``; appended to per member at pack time,
    never on a read path)."""

    def __init__(self):
        self.labels: list[int] = []
        self.starts: list[int] = [0]
        self.exts: list[bytes] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []

    def add_sample(self, members: Sequence[tuple[bytes, int, int]], label: int) -> None:
        for ext, offset, size in members:
            self.exts.append(ext.lower())
            self.offsets.append(offset)
            self.sizes.append(size)
        self.end_sample(label)

    def end_sample(self, label: int) -> None:
        """The members appended since the last sample are one sample's (a writer appends them
        itself, a member at a time)."""
        self.starts.append(len(self.exts))
        self.labels.append(label)


@dataclass
class TarTally:
    """What one pass over a tar's headers finds: the facts ``shardkit index`` writes."""

    samples: int = 0
    #: Records (groups of members under one key) without an image member: not samples.
    imageless: int = 0
    #: Byte offset of the first header of samples 0, INDEX_EVERY, 2 x INDEX_EVERY, ...
    index: list[int] = field(default_factory=list)
    #: Labels found (from ``cls``/``label``/... members), when asked for.
    labels: set[int] = field(default_factory=set)
    #: Every sample's key, in order, when asked for (random access by key).
    keys: list[str] = field(default_factory=list)
    #: Field name (a member's extension) -> samples carrying it, when asked for: every member
    #: but a sample's image and its label, as ``fields=`` reads them and a pack counts them.
    fields: dict[str, int] = field(default_factory=dict)
    #: Byte offset of the end-of-archive blocks (where the last sample's byte range ends).
    end: int = 0
    #: Every sample's label and members (extension, data offset, size), when asked for.
    members: MemberLog | None = None


def tally_tar(  # noqa: C901 (one pass: the grouping rules of members)
    source: str | os.PathLike | BinaryIO,
    *,
    shard: str = "",
    labels: bool = False,
    every: int = INDEX_EVERY,
    keys: bool = False,
    fields: bool = False,
    members: bool = False,
) -> TarTally:
    """Count samples (and optionally collect labels and offsets) reading headers only.

    ``every``: the offset of every ``every``-th sample goes in ``index`` (1: every sample, the
    dense index random access reads by); ``keys``: collect every sample's key; ``fields``:
    count the samples carrying each field; ``members``: log each sample's label and members
    (what the sample index holds; reads label members as ``labels`` does).

    Applies exactly the grouping rules of ``iter_tar_records``, so the count is what a stream
    yields; a duplicated member raises as it does there.
    """
    f, name, owned = _open(source)
    shard = shard or name
    tally = TarTally(members=MemberLog() if members else None)
    log = tally.members
    group: list[tuple[bytes, int, int]] = []  # this key's members: ext, data offset, size
    labels = labels or members
    try:
        b = _Buffer(_sequential(f, shard), shard, 64 << 10)

        def wants(k: bytes, ext: bytes) -> bool:
            return labels and _kind(ext) is _LABEL

        key: bytes | None = None
        seen: list[bytes] = []
        has_image = False
        label: int | None = None
        start = 0

        def close_group() -> None:
            if key is None:
                return
            if has_image:
                if tally.samples % every == 0:
                    tally.index.append(start)
                if keys:
                    tally.keys.append(key.decode("utf-8", "surrogateescape"))
                tally.samples += 1
                if label is not None:
                    tally.labels.add(label)
                if fields:
                    _count_fields(tally.fields, seen)
                if log is not None:
                    log.add_sample(group, -1 if label is None else label)
            else:
                tally.imageless += 1

        for offset, k, ext, data, data_at, size in _walk(b, wants):
            if k != key:
                close_group()
                key, seen, has_image, label, start = k, [ext], False, None, offset
                group = []
            elif ext in seen:
                raise _duplicate(shard, k, ext)
            else:
                seen.append(ext)
            if log is not None:
                group.append((ext, data_at, size))
            kind = _kind(ext)
            if kind is _IMAGE:
                has_image = True
            elif kind is _LABEL and data is not None and label is None:
                try:
                    label = int(data)
                except ValueError:
                    raise _bad_label(shard, k, data) from None
        close_group()
        tally.end = b.base + b.pos - BLOCK  # the walk stops past the first zero block
    finally:
        if owned:
            f.close()
    return tally


def _count_fields(counts: dict[str, int], exts: list[bytes]) -> None:
    """Add one sample's fields (``exts``: its members' extensions, in order) to ``counts``:
    every member but the first image (the sample's image) and the first label."""
    image = label = None
    for ext in exts:
        kind = _kind(ext)
        if kind is _IMAGE and image is None:
            image = ext
        elif kind is _LABEL and label is None:
            label = ext
        else:
            name = ext.decode("utf-8", "surrogateescape")
            counts[name] = counts.get(name, 0) + 1


def count_tar_samples(source: str | os.PathLike | BinaryIO, *, shard: str = "") -> int:
    """Number of samples (keys holding an image member), hopping over member data.

    Records without an image (``__meta__.json``, captions alone ...) are not samples: they are
    not counted, and one warning says how many there were.
    """
    tally = tally_tar(source, shard=shard or _name_of(source))
    if tally.imageless:
        warn_imageless(shard or _name_of(source), tally.imageless)
    return tally.samples


def warn_imageless(where: str, n: int) -> None:
    warnings.warn(
        f"{where}: {n} record{'s' if n != 1 else ''} without an image member (metadata such "
        "as __meta__.json, or samples missing their image) passed over; they are not samples",
        RuntimeWarning,
        stacklevel=3,
    )
