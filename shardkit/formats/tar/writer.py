"""``TarShardWriter``: reproducible GNU-format members, hashed and indexed while written."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import BinaryIO

from ...errors import ShardFormatError
from ...manifest import INDEX_EVERY
from ...records import ShardStats
from ..sample_index import encode_index, sample_digest, write_index_file
from .parse import _END_OF_ARCHIVE, _GNU_MAGIC, _MAX_OCTAL_SIZE, BLOCK
from .tally import MemberLog

__all__ = ["TarShardWriter", "TarSizer"]


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


_HEAD_FIXED = b"0000644\x00" + b"0000000\x00" + b"0000000\x00"  # mode, uid, gid
_MTIME = b"00000000000\x00"  # fixed, for reproducible shards


def _tail(typeflag: bytes) -> bytes:
    return (
        typeflag
        + bytes(100)  # linkname
        + _GNU_MAGIC
        + bytes(32)  # uname
        + bytes(32)  # gname
        + bytes(8 + 8 + 167)  # devmajor, devminor, GNU atime/ctime/... and padding
    )


#: Each type's constant header tail and the checksum of every constant byte (the checksum
#: field counts as 8 spaces): a header then sums only its name and size, not 512 bytes.
_TAILS = {
    t: (_tail(t), sum(_HEAD_FIXED) + sum(_MTIME) + sum(_tail(t)) + 8 * 32) for t in (b"0", b"L")
}


def _header(name: bytes, size: int, typeflag: bytes = b"0") -> bytes:
    """One GNU-format header with fixed mode/uid/gid/mtime, so equal input gives equal bytes."""
    if size > _MAX_OCTAL_SIZE:
        raise ShardFormatError(f"member {name!r} is {size} bytes; tar shards hold at most 8 GiB")
    tail, constant = _TAILS[typeflag]
    octal = b"%011o\x00" % size
    chksum = constant + sum(name[:100]) + sum(octal)
    return (
        name[:100].ljust(100, b"\x00") + _HEAD_FIXED + octal + _MTIME + b"%06o\x00 " % chksum + tail
    )


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


def _sample_size(key: str, ext: str, nbytes: int, extra: Sequence[tuple[str, bytes]] = ()) -> int:
    """Bytes one sample adds to a tar shard: its image, label and field members."""
    klen = len(key.encode())
    size = _member_size(klen + 1 + len(ext), nbytes) + _member_size(klen + 4, 12)
    if extra:
        size += sum(_member_size(klen + 1 + len(n.encode()), len(v)) for n, v in extra)
    return size


class TarSizer:
    """A tar shard's size as samples are added, from their sizes alone (no bytes): the roll
    rule a pack is planned by before any image is read. ``projected_size`` is the writer's."""

    def __init__(self):
        self.samples = 0
        self._bytes = 0

    @staticmethod
    def _size(klen: int, elen: int, nbytes: int, extra=()) -> int:
        size = _member_size(klen + 1 + elen, nbytes) + _member_size(klen + 4, 12)
        return size + sum(_member_size(klen + 1 + n, v) for n, v in extra)

    def projected_size(self, klen: int, elen: int, nbytes: int, extra=()) -> int:
        """``klen``/``elen``: bytes of the key and the extension (UTF-8); ``extra``: ``(name
        bytes, value bytes)`` of each extra field."""
        return self._bytes + self._size(klen, elen, nbytes, extra) + len(_END_OF_ARCHIVE)

    def add(self, klen: int, elen: int, nbytes: int, extra=()) -> None:
        self._bytes += self._size(klen, elen, nbytes, extra)
        self.samples += 1


class TarShardWriter:
    """Appends samples as ``<key>.<ext>`` + ``<key>.cls`` member pairs and hashes while writing.

    Writes exactly at ``path``; the packer passes a temporary name and renames when complete.
    """

    def __init__(self, path: str, buffer_size: int = 1 << 20):
        self.path = path
        self.samples = 0
        self._bytes = 0
        self._index: list[int] = []  # byte offset of every INDEX_EVERY-th sample
        self._keys: list[bytes] = []  # the sample index beside the shard (sample_index)
        self._offsets: list[int] = []
        self._digests: list[int] = []  # each sample's bytes' digest, as written
        self._members = MemberLog()
        self._hash = hashlib.sha256()
        self._file: BinaryIO | None = open(path, "wb", buffering=buffer_size)

    def projected_size(
        self, key: str, ext: str, nbytes: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> int:
        """Size of the finished shard (end-of-archive included) if this sample were added now."""
        return self._bytes + _sample_size(key, ext, nbytes, extra) + len(_END_OF_ARCHIVE)

    def add(
        self, key: str, ext: str, data: bytes, label: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """``<key>.<ext>``, ``<key>.cls``, then one ``<key>.<name>`` member per extra field."""
        if "." in key.rsplit("/", 1)[-1]:
            raise ShardFormatError(f"key {key!r} contains a dot; encode it with encode_key()")
        kb = key.encode()
        if self.samples % INDEX_EVERY == 0:
            self._index.append(self._bytes)
        self._keys.append(kb)
        self._offsets.append(self._bytes)
        members = [(ext.encode(), data)]
        if label >= 0:  # -1: no label, no member (readers give -1)
            members.append((b"cls", b"%d" % label))
        members += [(name.encode(), value) for name, value in extra]
        parts: list[bytes] = []
        at = self._bytes
        log = self._members  # each member's extension, data offset and size: the sample index
        for mext, value in members:
            name = kb + b"." + mext
            member = _member(name, value)
            head = BLOCK if len(member) == 3 else _member_size(len(name), 0)  # a long name
            log.exts.append(mext.lower())
            log.offsets.append(at + head)
            log.sizes.append(len(value))
            at += head + len(value) + len(member[-1])
            parts += member
        log.end_sample(label if label >= 0 else -1)
        chunk = b"".join(parts)
        self._digests.append(sample_digest(chunk))
        self._write(chunk)
        self.samples += 1

    def _write(self, chunk: bytes) -> None:
        assert self._file is not None, "writer is closed"
        self._file.write(chunk)
        self._hash.update(chunk)
        self._bytes += len(chunk)

    def close(self) -> ShardStats:
        """Write the end-of-archive blocks, flush to disk, and report the shard's facts; the
        sample index goes beside the shard (``path + ".idx"``)."""
        self._offsets.append(self._bytes)
        self._write(_END_OF_ARCHIVE)
        f, self._file = self._file, None
        assert f is not None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        sha = self._hash.hexdigest()
        index_sha = ""
        if self.samples:
            data = encode_index(
                self._bytes, sha, self._keys, self._offsets, self._members, self._digests
            )
            write_index_file(self.path, data)
            index_sha = hashlib.sha256(data).hexdigest()
        return ShardStats(self.path, self.samples, self._bytes, sha, tuple(self._index), index_sha)

    def abort(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()  # flushes the buffer: fails again on a full disk, which is known
            except OSError:
                pass
        for path in (self.path, self.path + ".idx"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
