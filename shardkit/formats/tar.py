"""Tar shards in the WebDataset convention: writer and reader side by side.

Why our own code instead of ``tarfile``: the writer must be byte-reproducible (fixed headers, no
PAX records) and the reader must stream at disk speed; ``tarfile`` builds a ``TarInfo`` object and
a member list per entry, which costs more than the I/O for 10-100 KB images. The layout is
specified in FORMAT.md; any ustar/GNU reader (``tarfile``, GNU tar, WebDataset) reads our shards.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from ..errors import ShardFormatError
from ..fsutil import open_regular
from ..images import IMAGE_EXTENSIONS
from ..manifest import INDEX_EVERY
from ..records import Record, ShardStats

__all__ = [
    "IMAGE_EXTS",
    "TarShardWriter",
    "TarTally",
    "count_tar_samples",
    "is_gzip_name",
    "iter_tar_records",
    "split_member_name",
    "tally_tar",
]

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_END_OF_ARCHIVE = bytes(2 * BLOCK)
_GNU_MAGIC = b"ustar  \x00"  # magic + version of GNU format, as tarfile.GNU_FORMAT writes
_MAX_OCTAL_SIZE = 8**11 - 1  # 11 octal digits: 8 GiB - 1

#: Member extensions treated as the sample's image: a member whose extension (lowercased) ends in
#: one of these (``jpg``, ``input.jpg``) is the image; the first one in a sample wins.
IMAGE_EXTS = IMAGE_EXTENSIONS  # one answer to "is this an image?" (shardkit.images)
#: Member extensions that carry the integer class label as decimal ASCII.
LABEL_EXTS = frozenset({"cls", "label", "cls.txt", "index"})


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _header(name: bytes, size: int, typeflag: bytes = b"0") -> bytes:
    """One GNU-format header with fixed mode/uid/gid/mtime, so equal input gives equal bytes."""
    if size > _MAX_OCTAL_SIZE:
        raise ShardFormatError(f"member {name!r} is {size} bytes; tar shards hold at most 8 GiB")
    head = (
        name.ljust(100, b"\x00")
        + b"0000644\x00"  # mode
        + b"0000000\x00"  # uid
        + b"0000000\x00"  # gid
        + b"%011o\x00" % size
        + b"00000000000\x00"  # mtime: fixed, for reproducible shards
    )
    tail = (
        typeflag
        + bytes(100)  # linkname
        + _GNU_MAGIC
        + bytes(32)  # uname
        + bytes(32)  # gname
        + bytes(8 + 8 + 167)  # devmajor, devminor, GNU atime/ctime/... and padding
    )
    chksum = sum(head) + sum(tail) + 8 * 32  # the checksum field counts as 8 spaces
    block = head + b"%06o\x00 " % chksum + tail
    return block


def _member(name: bytes, data: bytes) -> list[bytes]:
    """Header(s), data and padding of one member; long names go in a GNU ``././@LongLink``."""
    parts = []
    if len(name) > 100:
        long = name + b"\x00"
        parts += [
            _header(b"././@LongLink", len(long), b"L"),
            long,
            bytes(_padded(len(long)) - len(long)),
        ]
        name = name[:100]
    parts += [_header(name, len(data)), data, bytes(_padded(len(data)) - len(data))]
    return parts


def _member_size(name_len: int, data_len: int) -> int:
    size = BLOCK + _padded(data_len)
    if name_len > 100:
        size += BLOCK + _padded(name_len + 1)
    return size


class TarShardWriter:
    """Appends samples as ``<key>.<ext>`` + ``<key>.cls`` member pairs and hashes while writing.

    Writes exactly at ``path``; the packer passes a temporary name and renames when complete.
    """

    def __init__(self, path: str, buffer_size: int = 1 << 20):
        self.path = path
        self.samples = 0
        self._bytes = 0
        self._index: list[int] = []  # byte offset of every INDEX_EVERY-th sample
        self._hash = hashlib.sha256()
        self._file: BinaryIO | None = open(path, "wb", buffering=buffer_size)

    def projected_size(
        self, key: str, ext: str, nbytes: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> int:
        """Size of the finished shard (end-of-archive included) if this sample were added now."""
        klen = len(key.encode())
        return (
            self._bytes
            + _member_size(klen + 1 + len(ext), nbytes)
            + _member_size(klen + 4, 12)
            + (sum(_member_size(klen + 1 + len(n.encode()), len(v)) for n, v in extra)
               if extra else 0)
            + len(_END_OF_ARCHIVE)
        )

    def add(
        self, key: str, ext: str, data: bytes, label: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """``<key>.<ext>``, ``<key>.cls``, then one ``<key>.<name>`` member per extra field."""
        if "." in key.rsplit("/", 1)[-1]:
            raise ShardFormatError(f"key {key!r} contains a dot; encode it with encode_key()")
        kb = key.encode()
        if self.samples % INDEX_EVERY == 0:
            self._index.append(self._bytes)
        parts = _member(kb + b"." + ext.encode(), data) + _member(kb + b".cls", b"%d" % label)
        for name, value in extra:
            parts += _member(kb + b"." + name.encode(), value)
        self._write(b"".join(parts))
        self.samples += 1

    def _write(self, chunk: bytes) -> None:
        assert self._file is not None, "writer is closed"
        self._file.write(chunk)
        self._hash.update(chunk)
        self._bytes += len(chunk)

    def close(self) -> ShardStats:
        """Write the end-of-archive blocks, flush to disk, and report the shard's facts."""
        self._write(_END_OF_ARCHIVE)
        f, self._file = self._file, None
        assert f is not None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        return ShardStats(
            self.path, self.samples, self._bytes, self._hash.hexdigest(), tuple(self._index)
        )

    def abort(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()  # flushes the buffer: fails again on a full disk, which is known
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# --- reader ----------------------------------------------------------------------------------


def _octal(field: bytes, shard: str, offset: int) -> int:
    if field[0] == 0x80:  # GNU base-256 for big numbers (0xff: negative, never valid here)
        return int.from_bytes(field[1:], "big")
    if field[0] & 0x80:
        raise ShardFormatError(
            f"{shard}: corrupt tar header at byte {offset} (negative number); the shard is "
            "damaged, re-copy or re-pack it"
        )
    try:
        return int(field.split(b"\x00", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise ShardFormatError(
            f"{shard}: corrupt tar header at byte {offset}; the shard is damaged, re-copy or "
            "re-pack it"
        ) from None


def _pax_path(data: bytes, shard: str = "", offset: int = 0) -> bytes | None:
    """The ``path`` record of a PAX extended header (written by tarfile for long/unicode names).

    Every record is ``"<length> <key>=<value>\n"``; a length that is not a decimal number, does
    not cover its own digits or runs past the data is an error: a hostile 0 or negative length
    would otherwise loop forever.
    """
    pos = 0
    path = None
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else data[pos : pos + 20]
        length = int(digits) if space > pos and digits.isdigit() else -1
        if not 0 < space - pos + 1 < length <= len(data) - pos:
            if not data[pos:].strip(b"\x00"):
                break  # zero padding after the last record
            raise ShardFormatError(
                f"{shard}: corrupt PAX header at byte {offset}: record length "
                f"{digits[:20].decode('ascii', 'replace') or '(none)'!r} is invalid; the shard is "
                "damaged, re-copy or re-pack it"
            )
        k, _, v = data[space + 1 : pos + length - 1].partition(b"=")
        if k == b"path":
            path = v
        pos += length
    return path


class _Buffer:
    """A sliding window over a binary stream: big ``readinto`` calls in, exact slices out.

    Parsing headers out of a multi-megabyte window costs a few slice operations per member,
    where ``tarfile`` (and per-member ``read()`` calls) pay far more; reading into one reused
    bytearray leaves a single copy of each image's bytes (the slice handed to the Record).
    """

    __slots__ = (
        "f", "buf", "mv", "pos", "end", "base", "seekable", "size", "shard", "_readinto"
    )

    def __init__(self, f: BinaryIO, shard: str, chunk: int):
        self.f, self.shard = f, shard
        self.buf = bytearray(chunk)
        self.mv = memoryview(self.buf)
        self.pos = self.end = 0
        self.base = 0  # stream offset of buf[0]
        self._readinto = getattr(f, "readinto", None)
        try:
            self.seekable = f.seekable()
        except (AttributeError, OSError):
            self.seekable = False
        #: The stream's physical size when it can be known (a seekable file), else None: every
        #: length read from a header is checked against it before anything is allocated.
        self.size = _stream_size(f) if self.seekable else None

    def _read_more(self) -> int:
        if self._readinto is not None:
            got = self._readinto(self.mv[self.end :])
            return got or 0
        data = self.f.read(len(self.buf) - self.end)
        self.mv[self.end : self.end + len(data)] = data
        return len(data)

    def fill(self, n: int) -> bool:
        """Make ``n`` bytes available at ``pos``; False if the stream ends first."""
        have = self.end - self.pos
        if have >= n:
            return True
        if self.pos:  # slide the unread tail to the front
            self.mv[:have] = self.mv[self.pos : self.end]
            self.base += self.pos
            self.pos, self.end = 0, have
        if self.size is not None and self.base + n > self.size:
            return False  # claims more bytes than the file holds: allocate nothing
        while self.end < n:
            if self.end == len(self.buf):  # one member larger than the window: grow it, but
                # only as far as bytes actually arrive (a lying header costs no memory)
                self.mv.release()
                self.buf.extend(bytes(min(n, 2 * len(self.buf)) - len(self.buf)))
                self.mv = memoryview(self.buf)
            got = self._read_more()
            if not got:
                return False
            self.end += got
        return True

    def skip(self, n: int, what: str) -> None:
        """Move ``n`` bytes forward, seeking over data outside the window when possible."""
        ahead = self.end - self.pos
        if n <= ahead:
            self.pos += n
            return
        if self.seekable:
            if self.size is not None and self.base + self.pos + n > self.size:
                self.truncated(what, n)
            self.f.seek(n - ahead, io.SEEK_CUR)
            self.base += self.end + (n - ahead)
            self.pos = self.end = 0
            return
        while n > 0:
            step = min(n, len(self.buf))
            if not self.fill(step):
                self.truncated(what, n)
            self.pos += step
            n -= step

    def truncated(self, what: str, n: int):
        end = self.size if self.size is not None else self.base + self.end
        raise ShardFormatError(
            f"{self.shard}: truncated tar: {what} needs {n} bytes at byte {self.base + self.pos} "
            f"but the shard ends at byte {end}; re-copy or re-pack the shard"
        )


def _stream_size(f: BinaryIO) -> int | None:
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass
    try:
        here = f.tell()
        size = f.seek(0, io.SEEK_END)
        f.seek(here)
        return size
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _open(source: str | os.PathLike | BinaryIO) -> tuple[BinaryIO, str, bool]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            return open_regular(path, buffering=0), path, True
        except OSError as exc:
            raise ShardFormatError(f"{path}: cannot open shard ({exc.strerror})") from None
    return source, _name_of(source), False


_IMAGE, _LABEL, _OTHER = "image", "label", "other"
_EXT_KIND = {e.encode(): _IMAGE for e in IMAGE_EXTS} | {e.encode(): _LABEL for e in LABEL_EXTS}
_IMAGE_LAST = frozenset(e.encode() for e in IMAGE_EXTS)


def _kind(lext: bytes) -> str:
    """What a member is, from its lowercased extension: ``input.jpg`` is an image (last part)."""
    kind = _EXT_KIND.get(lext)
    if kind is None:
        kind = _IMAGE if lext.rpartition(b".")[2] in _IMAGE_LAST else _OTHER
    return kind


#: webdataset's ``base_plus_ext`` and ``tar_file_iterator`` rules, for the names the fast split
#: cannot take (basename starting with a dot, a leading ``__``, a newline in the name).
_WDS_SPLIT = re.compile(rb"^((?:.*/|)[^.]+)[.]([^/]*)$")
_WDS_META = re.compile(rb"__[^/]*__($|/)")


def _split_slow(name: bytes) -> tuple[bytes | None, bytes]:
    if b"/" not in name and name.startswith(b"__") and name.endswith(b"__"):
        return None, b""
    if _WDS_META.match(name):
        return None, b""
    m = _WDS_SPLIT.match(name)
    return (m.group(1), m.group(2)) if m else (None, b"")


def split_member_name(name: bytes) -> tuple[bytes | None, bytes]:
    """``(key, extension)`` of a member name as webdataset splits it; key None: not sample data.

    The key is the path up to the first dot of the basename (``a/s1.input.jpg`` -> ``a/s1``,
    ``input.jpg``); webdataset's metadata names (``__x__``, ``__x__/...``) and names without a
    dot belong to no sample. The extension is returned as written; callers lowercase it.
    """
    slash = name.rfind(b"/") + 1
    dot = name.find(b".", slash)
    if dot > slash and name[:2] != b"__" and b"\n" not in name:
        return name[:dot], name[dot + 1 :]
    return _split_slow(name)


def _compressed(hdr: bytes, shard: str) -> None:
    """At byte 0 a header that is not one: name the compression if the magic bytes show one."""
    for magic, what, fix in _COMPRESSIONS:
        if hdr.startswith(magic):
            raise ShardFormatError(
                f"{shard}: the shard is {what}-compressed, not a plain tar; {fix}"
            )


_COMPRESSIONS = (
    (b"\x1f\x8b", "gzip", "name it .tar.gz or .tgz (decompressed while streaming) or gunzip it"),
    (b"BZh", "bzip2", "decompress it (bunzip2); shardkit reads plain and gzip tars"),
    (b"\xfd7zXZ\x00", "xz", "decompress it (xz -d); shardkit reads plain and gzip tars"),
    (b"\x28\xb5\x2f\xfd", "zstd", "decompress it (zstd -d); shardkit reads plain and gzip tars"),
)


def _bad_header(shard: str, offset: int, why: str) -> ShardFormatError:
    return ShardFormatError(
        f"{shard}: corrupt tar header at byte {offset} ({why}); the shard is damaged, re-copy or "
        "re-pack it"
    )


def _second_end_block(b: _Buffer, pos: int) -> None:
    """After the first zero block at ``pos - BLOCK``: the second must follow, whole and zero."""
    b.pos = pos
    if not b.fill(BLOCK):
        end = b.size if b.size is not None else b.base + b.end
        raise ShardFormatError(
            f"{b.shard}: truncated tar: the shard ends at byte {end} after one end-of-archive "
            "block, the second is missing; re-copy or re-pack the shard"
        )
    if bytes(b.mv[b.pos : b.pos + BLOCK]) != _ZERO_BLOCK:
        raise _bad_header(b.shard, b.base + b.pos - BLOCK, "a zero block inside the archive")


def _duplicate(shard: str, key: bytes, ext: bytes) -> ShardFormatError:
    return ShardFormatError(
        f"{shard}: sample {key.decode(errors='replace')!r} has two {ext.decode(errors='replace')!r}"
        " members; a sample holds each extension once (as in webdataset): remove one and re-write"
        " the shard"
    )


def _bad_label(shard: str, key: bytes, data: bytes) -> ShardFormatError:
    return ShardFormatError(
        f"{shard}: sample {key.decode(errors='replace')!r} has a non-integer label {data[:20]!r}"
    )


def _scan(
    f: BinaryIO,
    shard: str,
    start: int,
    stop: int | None,
    chunk: int,
    first: int = 0,
    offset: int = 0,
    fields: frozenset[bytes] = frozenset(),
) -> Iterator[Record]:
    """The one streaming parse loop: yields Records for samples ``[start, stop)``.

    Members group into samples by key (``split_member_name``); a group is a sample when it holds
    an image member, and only samples are numbered (``__meta__.json``-like records are passed
    over). Samples outside the range are hopped over without reading their data. Kept as one
    function working on local copies of the window (``buf``, ``mv``, ``pos``, ``end``) on
    purpose: this is the hottest loop in shardkit, and attribute access per member showed up in
    profiles. ``_walk`` is its slower, plainer twin for counting and indexing.
    """
    b = _Buffer(f, shard, chunk)
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
        else:
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
        yield Record(
            key.decode("utf-8", "surrogateescape"),  # type: ignore[union-attr]
            image_ext.decode("utf-8", "surrogateescape"),
            image,  # type: ignore[arg-type]
            label,
            shard,
            extra,
        )


def _header_name(hdr: bytes) -> bytes:
    name = hdr[:100].split(b"\x00", 1)[0]
    if hdr[262] == 0 and hdr[345]:  # POSIX ustar (not GNU) with a prefix
        name = hdr[345:500].split(b"\x00", 1)[0] + b"/" + name
    return name


def _walk(
    b: _Buffer, wants: Callable[[bytes, bytes], bool]
) -> Iterator[tuple[int, bytes, bytes, bytes | None]]:
    """Every regular member as ``(offset, key, lowercased ext, data)``, data only where
    ``wants(key, ext)``; ``offset`` is that of its first header (long-name records included).

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
        if wants(k, ext):
            if not b.fill(padded):
                b.truncated(f"member {name.decode(errors='replace')}", padded)
            data_or_none: bytes | None = bytes(b.mv[b.pos : b.pos + size])
            b.pos += padded
        else:
            data_or_none = None
            b.skip(padded, "a member")
        yield first_header, k, ext, data_or_none
        first_header = None


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


def tally_tar(
    source: str | os.PathLike | BinaryIO, *, shard: str = "", labels: bool = False
) -> TarTally:
    """Count samples (and optionally collect labels and offsets) reading headers only.

    Applies exactly the grouping rules of ``iter_tar_records``, so the count is what a stream
    yields; a duplicated member raises as it does there.
    """
    f, name, owned = _open(source)
    shard = shard or name
    tally = TarTally()
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
                if tally.samples % INDEX_EVERY == 0:
                    tally.index.append(start)
                tally.samples += 1
                if label is not None:
                    tally.labels.add(label)
            else:
                tally.imageless += 1

        for offset, k, ext, data in _walk(b, wants):
            if k != key:
                close_group()
                key, seen, has_image, label, start = k, [ext], False, None, offset
            elif ext in seen:
                raise _duplicate(shard, k, ext)
            else:
                seen.append(ext)
            kind = _kind(ext)
            if kind is _IMAGE:
                has_image = True
            elif kind is _LABEL and data is not None and label is None:
                try:
                    label = int(data)
                except ValueError:
                    raise _bad_label(shard, k, data) from None
        close_group()
    finally:
        if owned:
            f.close()
    return tally


class _Gunzip(io.RawIOBase):
    """A ``.tar.gz`` shard as a plain, non-seekable tar stream (offsets cannot be seeked).

    Errors of the decompressor become ShardFormatErrors naming the shard and how far into the
    compressed file it got, which is never past the file's end.
    """

    def __init__(self, raw: BinaryIO, shard: str):
        self._raw, self._shard = raw, shard
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, buf) -> int:
        try:
            return self._gz.readinto(buf)
        except (OSError, EOFError, zlib.error) as exc:
            try:
                where = f" after {self._raw.tell()} compressed bytes"
            except (AttributeError, OSError, ValueError):
                where = ""
            raise ShardFormatError(
                f"{self._shard}: damaged or truncated gzip stream{where} ({exc}); re-copy the "
                "shard"
            ) from None


def is_gzip_name(name: str) -> bool:
    base = name.split("?", 1)[0].lower()
    return base.endswith((".tar.gz", ".tgz"))


def _sequential(f: BinaryIO, shard: str) -> BinaryIO:
    return _Gunzip(f, shard) if is_gzip_name(shard) else f  # type: ignore[return-value]


def iter_tar_records(
    source: str | os.PathLike | BinaryIO,
    *,
    shard: str = "",
    start: int = 0,
    stop: int | None = None,
    index: Sequence[int] = (),
    fields: Sequence[str] = (),
    chunk: int = 4 << 20,
) -> Iterator[Record]:
    """Yield samples ``[start, stop)`` of a tar shard as Records, grouping members by key.

    Reads any readable binary stream front to back in ``chunk``-sized reads; samples before
    ``start`` are hopped over. With the manifest's sparse ``index`` (byte offsets of samples 0,
    64, 128, ...) and a seekable stream positioned at the shard's start, it first seeks to the
    nearest indexed sample, so starting mid-shard reads at most 63 samples too many. A shard
    named ``.tar.gz``/``.tgz`` is decompressed as it streams and never seeks. ``fields``: the
    (lowercased) extensions of extra members to carry, raw, in ``Record.fields``. A shard that
    ends without its end-of-archive blocks, or mid-member, raises ShardFormatError: a truncated
    copy never passes as a short epoch.
    """
    f, name, owned = _open(source)
    shard = shard or name
    first = offset = 0
    k = start // INDEX_EVERY
    gz = is_gzip_name(shard)
    if k and k < len(index) and not gz:
        try:
            f.seek(index[k])
            first, offset = k * INDEX_EVERY, index[k]
        except (AttributeError, OSError, io.UnsupportedOperation):
            pass  # not seekable: hop from the start
    want = frozenset(x.lower().encode() for x in fields)
    try:
        yield from _scan(_sequential(f, shard), shard, start, stop, chunk, first, offset, want)
    finally:
        if owned:
            f.close()


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


def _name_of(source) -> str:
    name = source if isinstance(source, (str, os.PathLike)) else getattr(source, "name", None)
    return os.fspath(name) if isinstance(name, (str, os.PathLike)) else "<stream>"
