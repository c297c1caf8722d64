"""Tar shards in the WebDataset convention: writer and reader side by side.

Why our own code instead of ``tarfile``: the writer must be byte-reproducible (fixed headers, no
PAX records) and the reader must stream at disk speed; ``tarfile`` builds a ``TarInfo`` object and
a member list per entry, which costs more than the I/O for 10-100 KB images. The layout is
specified in FORMAT.md; any ustar/GNU reader (``tarfile``, GNU tar, WebDataset) reads our shards.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from ..errors import ShardFormatError
from ..images import IMAGE_EXTENSIONS
from ..manifest import INDEX_EVERY
from ..records import Record, ShardStats

__all__ = ["TarShardWriter", "iter_tar_records", "count_tar_samples", "IMAGE_EXTS"]

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_END_OF_ARCHIVE = bytes(2 * BLOCK)
_GNU_MAGIC = b"ustar  \x00"  # magic + version of GNU format, as tarfile.GNU_FORMAT writes
_MAX_OCTAL_SIZE = 8**11 - 1  # 11 octal digits: 8 GiB - 1

#: Member extensions treated as the sample's image (the first one found in a sample wins).
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

    def projected_size(self, key: str, ext: str, nbytes: int) -> int:
        """Size of the finished shard (end-of-archive included) if this sample were added now."""
        klen = len(key.encode())
        return (
            self._bytes
            + _member_size(klen + 1 + len(ext), nbytes)
            + _member_size(klen + 4, 12)
            + len(_END_OF_ARCHIVE)
        )

    def add(self, key: str, ext: str, data: bytes, label: int) -> None:
        if "." in key.rsplit("/", 1)[-1]:
            raise ShardFormatError(f"key {key!r} contains a dot; encode it with encode_key()")
        kb = key.encode()
        if self.samples % INDEX_EVERY == 0:
            self._index.append(self._bytes)
        parts = _member(kb + b"." + ext.encode(), data) + _member(kb + b".cls", b"%d" % label)
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
            self._file.close()
            self._file = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# --- reader ----------------------------------------------------------------------------------


def _octal(field: bytes, shard: str, offset: int) -> int:
    if field[0] & 0x80:  # GNU base-256 for big numbers
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.split(b"\x00", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise ShardFormatError(
            f"{shard}: corrupt tar header at byte {offset}; the shard is damaged, re-copy or "
            "re-pack it"
        ) from None


def _pax_path(data: bytes) -> bytes | None:
    """The ``path`` record of a PAX extended header (written by tarfile for long/unicode names)."""
    pos = 0
    path = None
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
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

    __slots__ = ("f", "buf", "mv", "pos", "end", "base", "seekable", "shard", "_readinto")

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
        if n > len(self.buf):  # one member larger than the window: grow it
            self.mv.release()
            self.buf.extend(bytes(n - len(self.buf)))
            self.mv = memoryview(self.buf)
        while self.end < n:
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
        end = self.base + self.end
        raise ShardFormatError(
            f"{self.shard}: truncated tar: {what} needs {n} bytes at byte {self.base + self.pos} "
            f"but the shard ends at byte {end}; re-copy or re-pack the shard"
        )


def _open(source: str | os.PathLike | BinaryIO) -> tuple[BinaryIO, str, bool]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            return open(path, "rb", buffering=0), path, True
        except OSError as exc:
            raise ShardFormatError(f"{path}: cannot open shard ({exc.strerror})") from None
    return source, getattr(source, "name", "<stream>"), False


def _scan(
    f: BinaryIO, shard: str, start: int, stop: int | None, chunk: int, first: int = 0,
    offset: int = 0,
) -> Iterator[Record | int]:
    """The one tar parsing loop: yields Records for samples in ``[start, stop)``.

    With ``stop == -1`` it reads headers only and yields the sample count at the end. Samples
    outside the range are hopped over without reading their data. Kept as one function working
    on local copies of the window (``buf``, ``mv``, ``pos``, ``end``) on purpose: this is the
    hottest loop in shardkit, and attribute access per member showed up in profiles.
    """
    count_only = stop == -1
    b = _Buffer(f, shard, chunk)
    b.base = offset  # the stream starts at sample ``first``, ``offset`` bytes into the shard
    buf, mv, pos, end = b.buf, b.mv, 0, 0
    index = first - 1  # sample number of the current key
    key: bytes | None = None
    image: bytes | None = None
    image_ext = b""
    label = -1
    wanted = False
    long_name: bytes | None = None
    ext_kind = _EXT_KIND.get
    while True:
        if end - pos < BLOCK:
            b.pos, b.end = pos, end
            if not b.fill(BLOCK):
                raise ShardFormatError(
                    f"{shard}: truncated tar: the shard ends at byte {b.base + b.end} without "
                    "its end-of-archive blocks; re-copy or re-pack the shard"
                )
            buf, mv, pos, end = b.buf, b.mv, b.pos, b.end
        if buf[pos + 257 : pos + 262] != b"ustar":
            hdr = bytes(mv[pos : pos + BLOCK])
            if hdr == _ZERO_BLOCK:
                break
            offset = b.base + pos
            if _octal(hdr[148:156], shard, offset) != sum(hdr) - sum(hdr[148:156]) + 256:
                raise ShardFormatError(
                    f"{shard}: corrupt tar header at byte {offset} (checksum mismatch); the "
                    "shard is damaged, re-copy or re-pack it"
                )
        try:
            size = int(buf[pos + 124 : pos + 135], 8)
        except ValueError:
            size = _octal(bytes(buf[pos + 124 : pos + 136]), shard, b.base + pos)
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
        if typeflag != 48 and typeflag not in (0, 55):  # not a regular file ('0', NUL, '7')
            if typeflag in (76, 120):  # 'L' GNU long name, 'x' PAX header: name of the next one
                if end - pos < padded:
                    b.pos, b.end = pos, end
                    if not b.fill(padded):
                        b.truncated("a long-name record", padded)
                    buf, mv, pos, end = b.buf, b.mv, b.pos, b.end
                data = bytes(mv[pos : pos + size])
                pos += padded
                long_name = data.rstrip(b"\x00") if typeflag == 76 else _pax_path(data)
                continue
            kind = None  # directories, links, PAX globals ...: no sample data
        else:
            slash = name.rfind(b"/") + 1
            dot = name.find(b".", slash)
            if dot < 0:
                kind = None
            else:
                if name[:dot] != key:  # first member of the next sample
                    if wanted:
                        if image is None:
                            raise ShardFormatError(
                                f"{shard}: sample {key.decode()!r} has no image member"
                            )
                        yield Record(
                            key.decode("utf-8", "surrogateescape"),
                            image_ext.decode(),
                            image,
                            label,
                            shard,
                        )
                    index += 1
                    if stop is not None and index >= stop and not count_only:
                        return
                    key, image, label = name[:dot], None, -1
                    wanted = index >= start and not count_only
                if wanted:
                    ext = name[dot + 1 :]
                    kind = ext_kind(ext)
                    if kind is None:
                        ext = ext.lower()
                        kind = ext_kind(ext)
                else:
                    kind = None
        if kind is None:  # hop over the data
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
        if kind is _LABEL:
            try:
                label = int(data)
            except ValueError:
                raise ShardFormatError(
                    f"{shard}: sample {key.decode()!r} has a non-integer label {data[:20]!r}"
                ) from None
        elif image is None:
            image, image_ext = data, ext
    if wanted:
        if image is None:
            raise ShardFormatError(f"{shard}: sample {key.decode()!r} has no image member")
        yield Record(
            key.decode("utf-8", "surrogateescape"), image_ext.decode(), image, label, shard
        )
    if count_only:
        yield index + 1


_IMAGE, _LABEL = "image", "label"
_EXT_KIND = {e.encode(): _IMAGE for e in IMAGE_EXTS} | {e.encode(): _LABEL for e in LABEL_EXTS}


def iter_tar_records(
    source: str | os.PathLike | BinaryIO,
    *,
    shard: str = "",
    start: int = 0,
    stop: int | None = None,
    index: Sequence[int] = (),
    chunk: int = 4 << 20,
) -> Iterator[Record]:
    """Yield samples ``[start, stop)`` of a tar shard as Records, grouping members by key.

    Reads any readable binary stream front to back in ``chunk``-sized reads; samples before
    ``start`` are hopped over. With the manifest's sparse ``index`` (byte offsets of samples 0,
    64, 128, ...) and a seekable stream positioned at the shard's start, it first seeks to the
    nearest indexed sample, so starting mid-shard reads at most 63 samples too many. A shard
    that ends without its end-of-archive blocks, or mid-member, raises ShardFormatError: a
    truncated copy never passes as a short epoch.
    """
    f, name, owned = _open(source)
    first = offset = 0
    k = start // INDEX_EVERY
    if k and k < len(index):
        try:
            f.seek(index[k])
            first, offset = k * INDEX_EVERY, index[k]
        except (AttributeError, OSError, io.UnsupportedOperation):
            pass  # not seekable: hop from the start
    try:
        yield from _scan(f, shard or name, start, stop, chunk, first, offset)
    finally:
        if owned:
            f.close()


def count_tar_samples(source: str | os.PathLike | BinaryIO, *, shard: str = "") -> int:
    """Number of samples (distinct consecutive keys), hopping over member data."""
    f, name, owned = _open(source)
    try:
        *_, count = _scan(f, shard or name, 0, -1, 64 << 10)
    finally:
        if owned:
            f.close()
    return count
