"""``iter_tar_records``: the streaming read of a tar shard, the hottest loop in shardkit."""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np

from ...errors import ShardFormatError
from ...manifest import INDEX_EVERY
from ...records import Record
from ..sample_index import SPLIT_SALT, ShardDigests, ShardSides, sample_digest
from .parse import (
    _EXT_KIND,
    _IMAGE,
    _LABEL,
    _OTHER,
    _ZERO_BLOCK,
    BLOCK,
    _bad_header,
    _bad_label,
    _Buffer,
    _compressed,
    _duplicate,
    _kind,
    _octal,
    _open,
    _pax_path,
    _second_end_block,
    _sequential,
    _split_slow,
    is_gzip_name,
)

__all__ = ["SampleAltered", "iter_tar_records", "read_at", "read_sample"]

try:  # the C parser of plain samples (shardkit/images/_native.c); optional, as its decoders
    from ...images._native import tar_at as _tar_at
    from ...images._native import tar_samples as _tar_samples
except ImportError:  # pragma: no cover - built without libjpeg's headers
    _tar_samples = _tar_at = None
_IMAGE_EXTS = frozenset(e for e, kind in _EXT_KIND.items() if kind is _IMAGE)
_LABEL_EXTS = frozenset(e for e, kind in _EXT_KIND.items() if kind is _LABEL)
#: Image bytes the C parser takes per call: records made and dropped in small runs, as one at a
#: time, keep glibc from trimming and re-faulting the heap each window (``_native.c``).
_BUDGET = 64 << 10


class SampleAltered(Exception):
    """``read_at``'s answer when a sample's bytes are not its digest's: ``args[0]`` is its place
    in the call's list (``iter_tar_records``'s: its number in the shard). The caller names the
    sample (it alone knows the shard's index and whether the bytes are worth fetching again)
    with its own one-line error."""


def _scan(  # noqa: C901 (the tar header state machine, inlined: the hot loop)
    b: _Buffer,
    shard: str,
    start: int,
    stop: int | None,
    first: int = 0,
    offset: int = 0,
    fields: frozenset[bytes] = frozenset(),
    sides: ShardSides | None = None,
    digests: ShardDigests | None = None,
    f=None,
) -> Iterator[Record]:
    """The one streaming parse loop over the window ``b``: yields Records for samples
    ``[start, stop)``; ``sides`` (a split's): each checked by its own key against the side the
    split put it on, in C where C parses it, a sample on the other side an error naming it.
    ``digests`` (a partial read's): each sample handed out checked against its index digest, in
    C as it parses it, else by its index's range read again from the file ``f``; one that
    differs raises ``SampleAltered(n)``, ``n`` its number in the shard.

    Members group into samples by key (``split_member_name``); a group is a sample when it holds
    an image member, and only samples are numbered (``__meta__.json``-like records are passed
    over). Samples outside the range are hopped over without reading their data. Runs of plain
    samples are parsed in C (``_native.tar_samples``); this loop takes everything else, with
    every rule and error. Kept as one function working on local copies of the window (``buf``,
    ``mv``, ``pos``, ``end``) on purpose: this is the hottest loop in shardkit, and attribute
    access per member showed up in profiles. ``_walk`` is its slower, plainer twin for counting
    and indexing.
    """
    b.base = offset  # the stream starts at sample ``first``, ``offset`` bytes into the shard
    buf, mv, pos, end = b.buf, b.mv, 0, 0
    done = first  # samples completed before the current group
    key: bytes | None = None
    image: bytes | None = None
    image_ext = b""
    has_image = labelled = wanted = False
    label = -1
    ext0 = b""
    ext1: bytes | None = None
    more: list[bytes] | None = None
    extra: dict[str, bytes] | None = None
    long_name: bytes | None = None
    ext_kind = _EXT_KIND.get
    # plain samples in C (``_native.tar_samples``), from a header that starts a sample; where it
    # stops, this loop goes on, and hands back at the next sample boundary (``native`` again)
    native = _tar_samples is not None
    last = -1 if stop is None else stop
    check: tuple = () if sides is None else (sides.bits, sides.base, SPLIT_SALT, sides.threshold)
    if digests is not None:
        check = (check or (b"", 0, b"", 0)) + (digests.digests, digests.offsets)
    while True:
        if end - pos < BLOCK:
            b.pos, b.end = pos, end
            if not b.fill(BLOCK):
                raise ShardFormatError(
                    f"{shard}: truncated tar: the shard ends at byte "
                    f"{b.size if b.size is not None else b.base + b.end} without "
                    "its end-of-archive blocks; re-copy or re-pack the shard"
                )
            buf, mv, pos, end = b.buf, b.mv, b.pos, b.end
        if native and key is None:
            got, at, done = _tar_samples(
                buf, pos, end, done, start, last, _BUDGET, _IMAGE_EXTS, _LABEL_EXTS, fields,
                Record, shard, *check, *((b.base,) if digests is not None else ()),
            )  # fmt: skip
            yield from got
            if stop is not None and done >= stop:
                return
            native = at != pos  # no progress: this loop parses up to the next boundary
            pos = at
            continue
        if buf[pos + 257 : pos + 262] != b"ustar":
            hdr = bytes(mv[pos : pos + BLOCK])
            here = b.base + pos
            if hdr == _ZERO_BLOCK:
                b.end = end
                _second_end_block(b, pos + BLOCK)
                break
            if here == 0:
                _compressed(hdr, shard)
            if _octal(hdr[148:156], shard, here) != sum(hdr) - sum(hdr[148:156]) + 256:
                raise _bad_header(shard, here, "checksum mismatch")
        try:
            size = int(buf[pos + 124 : pos + 135], 8)
        except ValueError:
            size = _octal(bytes(buf[pos + 124 : pos + 136]), shard, b.base + pos)
        if size < 0:
            raise _bad_header(shard, b.base + pos, "negative size")
        typeflag = buf[pos + 156]
        padded = (size + 511) & ~511
        if long_name is not None:
            name, long_name = long_name, None
            plain = False
        else:
            plain = True
            nul = buf.find(0, pos, pos + 100)
            name = bytes(mv[pos : nul if nul >= 0 else pos + 100])
            if buf[pos + 262] == 0 and buf[pos + 345]:  # POSIX ustar (not GNU) with a prefix
                name = bytes(buf[pos + 345 : pos + 500]).split(b"\x00", 1)[0] + b"/" + name
        pos += BLOCK
        use = False
        if typeflag != 48 and typeflag not in (0, 55):  # not a regular file ('0', NUL, '7')
            if typeflag in (76, 120):  # 'L' GNU long name, 'x' PAX header: name of the next one
                if end - pos < padded:
                    b.pos, b.end = pos, end
                    if not b.fill(padded):
                        b.truncated("a long-name record", padded)
                    buf, mv, pos, end = b.buf, b.mv, b.pos, b.end
                data = bytes(mv[pos : pos + size])
                pos += padded
                long_name = (
                    data.rstrip(b"\x00")
                    if typeflag == 76
                    else _pax_path(data, shard, b.base + pos - padded - BLOCK)
                )
                continue
        else:
            slash = name.rfind(b"/") + 1
            dot = name.find(b".", slash)
            if dot > slash and name[0] != 95 and b"\n" not in name:  # 95: "_" (meta names)
                k, ext = name[:dot], name[dot + 1 :]
            else:
                k, ext = _split_slow(name)
            if k is not None:
                kind = ext_kind(ext)  # known extensions are lower case already
                if kind is None:
                    ext = ext.lower()
                    kind = ext_kind(ext) or _kind(ext)
                if k != key:  # first member of the next group: the current one is complete
                    if has_image:
                        if wanted:
                            if sides is not None:
                                _on_side(sides, shard, done, key)  # type: ignore[arg-type]
                            if digests is not None and not digests.ok(f, done):
                                raise SampleAltered(done)
                            yield Record(
                                key.decode("utf-8", "surrogateescape"),  # type: ignore[union-attr]
                                image_ext.decode("utf-8", "surrogateescape"),
                                image,  # type: ignore[arg-type]
                                label,
                                shard,
                                extra,
                            )
                        done += 1
                        if stop is not None and done >= stop:
                            return
                    if plain and key is not None and _tar_samples is not None:
                        # the boundary after a sample parsed here: back to this header, for C
                        pos -= BLOCK
                        key, has_image, native = None, False, True
                        continue
                    key, image, label, ext0, ext1, more = k, None, -1, ext, None, None
                    has_image = labelled = False
                    wanted = done >= start
                    extra = {} if fields and wanted else None
                # a sample holds each extension once; kept without a per-sample set (hot path)
                elif ext1 is None:
                    if ext == ext0:
                        raise _duplicate(shard, k, ext)
                    ext1 = ext
                elif ext == ext0 or ext == ext1 or (more is not None and ext in more):
                    raise _duplicate(shard, k, ext)
                elif more is None:
                    more = [ext]
                else:
                    more.append(ext)
                if kind is _IMAGE:
                    if has_image:
                        kind = _OTHER  # a second image rides along like any other member
                    else:
                        has_image = True
                        use = wanted
                elif kind is _LABEL:
                    use = wanted and not labelled
                if extra is not None and ext in fields:
                    use = True
        if not use:  # hop over the data
            if padded <= end - pos:
                pos += padded
            else:
                b.pos, b.end = pos, end
                b.skip(padded, "a member")
                buf, mv, pos, end = b.buf, b.mv, b.pos, b.end
            continue
        if end - pos < padded:
            b.pos, b.end = pos, end
            if not b.fill(padded):
                b.truncated(f"member {name.decode(errors='replace')}", padded)
            buf, mv, pos, end = b.buf, b.mv, b.pos, b.end
        data = bytes(mv[pos : pos + size])
        pos += padded
        if kind is _IMAGE:
            image, image_ext = data, ext
        elif kind is _LABEL and not labelled:
            labelled = True
            try:
                label = int(data)
            except ValueError:
                raise _bad_label(shard, key, data) from None  # type: ignore[arg-type]
        if extra is not None and ext in fields:
            extra[ext.decode("utf-8", "surrogateescape")] = data
    if has_image and wanted:
        if sides is not None:
            _on_side(sides, shard, done, key)  # type: ignore[arg-type]
        if digests is not None and not digests.ok(f, done):
            raise SampleAltered(done)
        yield Record(
            key.decode("utf-8", "surrogateescape"),  # type: ignore[union-attr]
            image_ext.decode("utf-8", "surrogateescape"),
            image,  # type: ignore[arg-type]
            label,
            shard,
            extra,
        )


def _on_side(sides: ShardSides, shard: str, n: int, key: bytes) -> None:
    """Sample ``n`` (parsed here, not in C) on the side the split put it, by its own key."""
    if not sides.on_side(n, key):
        raise sides.error(shard, n, key.decode("utf-8", "surrogateescape"))


def iter_tar_records(
    source: str | os.PathLike | BinaryIO,
    *,
    shard: str = "",
    start: int = 0,
    stop: int | None = None,
    index: Sequence[int] = (),
    fields: Sequence[str] = (),
    chunk: int = 4 << 20,
    at: int | None = None,
    sides: ShardSides | None = None,
    digests: ShardDigests | None = None,
) -> Iterator[Record]:
    """Yield samples ``[start, stop)`` of a tar shard as Records, grouping members by key.

    Reads any readable binary stream front to back in ``chunk``-sized reads; samples before
    ``start`` are hopped over. Given ``at`` (the byte offset of sample ``start`` itself, from
    the shard's checked sample index) and a seekable stream positioned at the shard's start, it
    seeks straight there; given an older manifest's sparse ``index`` (byte offsets of samples 0,
    64, 128, ...), to the nearest indexed sample, so starting mid-shard reads at most 63 samples
    too many. A shard named ``.tar.gz``/``.tgz`` is decompressed as it streams and never seeks.
    ``fields``: the (lowercased) extensions of extra members to carry, raw, in
    ``Record.fields``. A shard that ends without its end-of-archive blocks, or mid-member,
    raises ShardFormatError: a truncated copy never passes as a short epoch. ``sides`` (a
    split's reader): every sample read is checked by its own key against the side the split
    put it on, and one on the other side is a ``ShardFormatError`` naming it and its key.
    ``digests`` (a partial read of a local shard with a sample index): every sample yielded is
    first checked against its index digest; one that differs raises ``SampleAltered(n)``.
    """
    f, name, owned = _open(source)
    shard = shard or name
    first = offset = 0
    k = start // INDEX_EVERY
    gz = is_gzip_name(shard)
    if at is not None and start and not gz:
        first, offset = start, at
    elif k and k < len(index) and not gz:
        first, offset = k * INDEX_EVERY, index[k]
    if offset:
        try:
            f.seek(offset)
        except (AttributeError, OSError, io.UnsupportedOperation):
            first = offset = 0  # not seekable: hop from the start
    want = frozenset(x.lower().encode() for x in fields)
    b = None
    try:
        b = _Buffer(_sequential(f, shard), shard, chunk)
        yield from _scan(b, shard, start, stop, first, offset, want, sides, digests, f)
    finally:
        if b is not None:
            b.release()
        if owned:
            f.close()


_END_BLOCKS = b"\0" * 1024


def _plain_member(hdr: bytes) -> tuple[bytes, bytes, int] | None:
    """(key, lowercased ext, size) of a plain ustar file member ("0", no prefix, an ordinary
    ``key.ext`` name); None for anything the streaming parser treats specially."""
    if hdr[257:262] != b"ustar" or hdr[156] != 48 or hdr[345] or hdr[0] == 95:  # 95: "_"
        return None
    try:
        size = int(hdr[124:135], 8)
    except ValueError:
        return None
    nul = hdr.find(0, 0, 100)
    name = hdr[: nul if nul >= 0 else 100]
    slash = name.rfind(b"/") + 1
    dot = name.find(b".", slash)
    if dot <= slash or b"\n" in name:
        return None
    return name[:dot], name[dot + 1 :].lower(), size


def read_sample(blob: bytes, shard: str, fields: Sequence[str] = ()) -> Record | None:
    """The first sample of ``blob``, one sample's byte range (random access): the same Record
    ``iter_tar_records`` gives for it. Plain ustar members (what shardkit writes) are parsed
    here, without the streaming window; anything else (long names, PAX, meta records, odd
    names, damage) goes through ``iter_tar_records`` itself, which also raises its errors."""
    want = frozenset(x.lower().encode() for x in fields)
    n, pos = len(blob), 0
    key = image = None
    image_ext = b""
    label, labelled = -1, False
    seen: list[bytes] = []
    extra: dict[str, bytes] | None = {} if want else None
    while pos + BLOCK <= n:
        hdr = blob[pos : pos + BLOCK]
        if hdr == _ZERO_BLOCK and key is not None:
            break
        member = _plain_member(hdr)
        if member is None:
            return _slow_sample(blob, shard, fields)
        k, ext, size = member
        if key is None:
            key = k
        elif k != key:
            break  # the next sample's header: this one is complete
        if ext in seen or pos + BLOCK + size > n:
            return _slow_sample(blob, shard, fields)
        seen.append(ext)
        data = blob[pos + BLOCK : pos + BLOCK + size]
        pos += BLOCK + ((size + 511) & ~511)
        kind = _EXT_KIND.get(ext) or _kind(ext)
        if kind is _IMAGE and image is None:
            image, image_ext = data, ext
        elif kind is _LABEL and not labelled:
            labelled = True
            try:
                label = int(data)
            except ValueError:
                return _slow_sample(blob, shard, fields)  # it names the bad label
        if extra is not None and ext in want:
            extra[ext.decode("utf-8", "surrogateescape")] = data
    if image is None:
        return _slow_sample(blob, shard, fields)
    return Record(
        key.decode("utf-8", "surrogateescape"),
        image_ext.decode("utf-8", "surrogateescape"),
        image,
        label,
        shard,
        extra,
    )


def read_at(
    blob: bytes | bytearray,
    starts: np.ndarray,
    ends: np.ndarray,
    shard: str,
    fields: Sequence[str] = (),
    hashes: np.ndarray | None = None,
    digests: np.ndarray | None = None,
    known: bool = False,
) -> tuple[list[Record | None], list[int]]:
    """The samples of ``blob`` at ``[starts[i], ends[i])`` (int64 arrays, as a sample index
    places them; the wanted samples of a slice, apart or in runs): what ``read_sample`` gives
    for each, and which of them (their places in the list) are not yet checked against
    ``hashes`` (the index's key hashes, big-endian ``>u8``), which the caller checks. The plain
    ones are parsed in C in one call for them all (``_native.tar_at``), which needs the header
    after each sample in ``blob`` (it closes the sample, as in a streamed shard) and checks
    each key's hash there, taking no sample whose hash differs; the rest go through
    ``read_sample``. With ``digests`` (the index's sample digests of the same samples), every
    sample's bytes are checked against its digest before any record is handed out, raising
    ``SampleAltered`` for the first that differs: in C, each sample hashed as it is parsed (no
    Python a sample); in Python where the C parser is not built. ``known`` (with ``digests``):
    the keys of these samples were found to hash to ``hashes`` before, from bytes with these
    digests (``stream.ranges``' memo): the C parser does not hash them again."""
    out: list[Record | None]
    if _tar_at is not None:
        want = _wanted(tuple(fields))
        check = b"" if hashes is None or (known and digests is not None) else hashes
        sums = b"" if digests is None else np.ascontiguousarray(digests, np.uint64)
        out = _tar_at(
            blob, starts, ends, check, SPLIT_SALT, _IMAGE_EXTS, _LABEL_EXTS, want, Record, shard,
            sums,
        )  # fmt: skip
        if isinstance(out, int):
            raise SampleAltered(out)
    else:  # pragma: no cover - built without libjpeg's headers
        if digests is not None:
            view = memoryview(blob)
            pairs = zip(starts.tolist(), ends.tolist(), digests.tolist(), strict=True)
            for i, (a, b, d) in enumerate(pairs):
                if sample_digest(view[a:b]) != d:
                    raise SampleAltered(i)
        out = [None] * len(starts)
    unchecked = list(range(len(out))) if hashes is None or _tar_at is None else []
    for i, rec in enumerate(out):
        if rec is None:
            out[i] = read_sample(bytes(blob[int(starts[i]) : int(ends[i])]), shard, fields)
            if hashes is not None and _tar_at is not None:
                unchecked.append(i)
    return out, unchecked


@functools.lru_cache(maxsize=64)
def _wanted(fields: tuple[str, ...]) -> frozenset[bytes]:
    """The extensions ``tar_at`` takes as fields: made once per field list, not once a call."""
    return frozenset(x.lower().encode() for x in fields)


def _slow_sample(blob: bytes, shard: str, fields: Sequence[str]) -> Record | None:
    data = blob + _END_BLOCKS  # a range parsed as a whole archive ends cleanly
    records = iter_tar_records(
        io.BytesIO(data), shard=shard, start=0, stop=1, fields=fields, chunk=len(data)
    )
    return next(iter(records), None)
