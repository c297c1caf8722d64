"""What every tar reader here shares: the stream window, header fields, names, kinds, gzip.

``reader._scan`` inlines much of this for speed; ``tally._walk`` uses it plainly. Errors name the
shard and the byte offset, and say how to fix it.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import threading
import zlib
from typing import BinaryIO

from ...errors import ShardFormatError
from ...fsutil import open_regular
from ...images.checks import IMAGE_EXTENSIONS

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_END_OF_ARCHIVE = bytes(2 * BLOCK)
_GNU_MAGIC = b"ustar  \x00"  # magic + version of GNU format, as tarfile.GNU_FORMAT writes
_MAX_OCTAL_SIZE = 8**11 - 1  # 11 octal digits: 8 GiB - 1

#: Member extensions treated as the sample's image: a member whose extension (lowercased) ends in
#: one of these (``jpg``, ``input.jpg``) is the image; the first one in a sample wins.
IMAGE_EXTS = IMAGE_EXTENSIONS  # one answer to "is this an image?" (shardkit.images.checks)
#: Member extensions that carry the integer class label as decimal ASCII.
LABEL_EXTS = frozenset({"cls", "label", "cls.txt", "index"})


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

    __slots__ = ("f", "buf", "mv", "pos", "end", "base", "seekable", "size", "shard", "_readinto")

    def __init__(self, f: BinaryIO, shard: str, chunk: int):
        self.f, self.shard = f, shard
        spare = getattr(_SPARE, "windows", None)
        self.buf = spare.pop() if spare and len(spare[-1]) == chunk else bytearray(chunk)
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

    def release(self) -> None:
        """Keep the window for the next shard this thread reads: a new 4 MB bytearray is ~1,000
        page faults to make and an munmap to drop, ~1.5 ms per shard (3 us per LFW sample;
        measured). Records hold copies of their bytes, never views of the window."""
        self.mv.release()
        spare = _SPARE.__dict__.setdefault("windows", [])
        if len(spare) < _SPARE_WINDOWS:
            spare.append(self.buf)
        self.buf = self.mv = None

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


#: Windows kept per thread for the next shards (a mixture reads several shards at once).
_SPARE_WINDOWS = 4
_SPARE = threading.local()


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


def _header_name(hdr: bytes) -> bytes:
    name = hdr[:100].split(b"\x00", 1)[0]
    if hdr[262] == 0 and hdr[345]:  # POSIX ustar (not GNU) with a prefix
        name = hdr[345:500].split(b"\x00", 1)[0] + b"/" + name
    return name


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
                f"{self._shard}: damaged or truncated gzip stream{where} ({exc}); re-copy the shard"
            ) from None


def is_gzip_name(name: str) -> bool:
    base = name.split("?", 1)[0].lower()
    return base.endswith((".tar.gz", ".tgz"))


def _sequential(f: BinaryIO, shard: str) -> BinaryIO:
    return _Gunzip(f, shard) if is_gzip_name(shard) else f  # type: ignore[return-value]


def _name_of(source) -> str:
    name = source if isinstance(source, (str, os.PathLike)) else getattr(source, "name", None)
    return os.fspath(name) if isinstance(name, (str, os.PathLike)) else "<stream>"
