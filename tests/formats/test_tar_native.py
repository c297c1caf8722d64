"""The C parser of plain samples (``_native.tar_samples``) against the Python parser alone.

Every tar the interop, fuzz and hostile tests read, shardkit's own shards, and plain tars with
every odd member the C parser must hand back: read with and without it, at windows that cut
samples anywhere and from several start samples, they give byte-identical records and the same
error at the same point.
"""

from __future__ import annotations

import io
import tarfile
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tar_compat import WRITERS
from test_tar_fuzz import BASES, damaged

from shardkit import pack
from shardkit.errors import ShardkitError
from shardkit.formats.tar import iter_tar_records
from shardkit.formats.tar import reader as tar_reader

pytestmark = pytest.mark.skipif(
    tar_reader._tar_samples is None, reason="shardkit.images._native is not built"
)

WINDOWS = [512, 1536, 4096, 4 << 20]
RANGES = [(0, None), (1, None), (2, 4), (0, 1)]
#: ``fields=`` asked for: members that ride along, and the image and label members themselves
FIELDS = [("json",), ("txt", "json", "cls", "jpg")]


def _outcome(data: bytes, native: bool, fields=(), **kw) -> list[tuple]:
    """The records (key, ext, data, label, fields) and, last, the error, if any."""
    saved = tar_reader._tar_samples
    if not native:
        tar_reader._tar_samples = None
    out: list[tuple] = []
    try:
        for r in iter_tar_records(io.BytesIO(data), shard="s.tar", fields=fields, **kw):
            out.append((r.key, r.ext, r.data, r.label, r.fields))
    except ShardkitError as exc:
        out.append((type(exc).__name__, str(exc)))
    finally:
        tar_reader._tar_samples = saved
    return out


def _same(data: bytes, windows=WINDOWS, ranges=RANGES) -> list[tuple]:
    for chunk in windows:
        for start, stop in ranges:
            kw = dict(chunk=chunk, start=start, stop=stop)
            want = _outcome(data, False, **kw)
            assert _outcome(data, True, **kw) == want, (chunk, start, stop)
            for fields in FIELDS:
                assert _outcome(data, True, fields=fields, **kw) == _outcome(
                    data, False, fields=fields, **kw
                ), fields
    return _outcome(data, True)


def _tar(members, fmt=tarfile.USTAR_FORMAT, edit=None) -> bytes:
    """A tar of (name, data) members; ``edit(i, header)`` may rewrite member i's header."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    raw = bytearray(buf.getvalue())
    pos, i = 0, 0
    while pos + 512 <= len(raw) and raw[pos : pos + 512] != bytes(512):
        size = int(raw[pos + 124 : pos + 135], 8)
        if edit is not None:
            header = raw[pos : pos + 512]
            edit(i, header)
            header[148:156] = b" " * 8
            header[148:155] = b"%06o\x00" % sum(header)
            raw[pos : pos + 512] = header
        pos += 512 + (size + 511) // 512 * 512
        i += 1
    return bytes(raw[:pos]) + bytes(1024)  # the two end blocks, no record padding


def _plain(n: int = 6, label=lambda i: str(i % 3).encode(), size: int = 700) -> list:
    out = []
    for i in range(n):
        out += [(f"d/s{i}.jpg", bytes([i]) * (size + 37 * i)), (f"d/s{i}.cls", label(i))]
    return out


def test_the_c_parser_takes_plain_shards_and_the_python_parser_agrees(tmp_path, monkeypatch):
    """shardkit's own shards (what packs write) and a plain tar: identical records, and all
    but the last sample of each (its end blocks are the Python parser's) come from C."""
    taken = []
    real = tar_reader._tar_samples

    def counting(*args):
        got = real(*args)
        taken.append(len(got[0]))
        return got

    monkeypatch.setattr(tar_reader, "_tar_samples", counting)
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    from PIL import Image

    for i in range(9):
        Image.new("RGB", (8, 8 + i), (i * 20, 5, 9)).save(src / f"im{i}.jpg")
    pack(str(tmp_path / "src"), str(tmp_path / "out"), progress=False)
    for shard in sorted((tmp_path / "out").glob("*.tar")):
        got = _same(shard.read_bytes())
        assert len(got) == 9 and all(len(r) == 5 for r in got)
    taken.clear()
    got = _outcome(_tar(_plain()), True)
    assert sum(taken) == 5
    taken.clear()
    got = _outcome(_tar(_plain()), True, fields=("cls", "json"))
    assert sum(taken) == 5 and got[2][4] == {"cls": b"2"}
    got = _same(_tar(_plain()))
    assert [r[0] for r in got] == [f"d/s{i}" for i in range(6)]
    assert [r[3] for r in got] == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_interop_tar_reads_the_same(tmp_path, writer):
    with open(WRITERS[writer](tmp_path), "rb") as f:
        _same(f.read())


@pytest.mark.parametrize("base", range(len(BASES)))
def test_the_fuzz_corpus_reads_the_same(base):
    _same(BASES[base])


ODD = {
    "labels int() reads": _plain(label=lambda i: [b" 7\n", b"-1", b"+3", b"007", b"\t5 ", b"1"][i]),
    "labels only Python reads or names": _plain(
        label=lambda i: [b"1_0", b"", b"x", b"9" * 19, b"1", b"2 3"][i]
    ),
    "upper-case extension": _plain()[:4] + [("d/s9.JPG", b"j" * 10)] + _plain()[4:],
    "a duplicated member": _plain()[:5] + [("d/s2.cls", b"1")] + _plain()[5:],
    "no image in a sample": _plain()[:4] + [("d/t.json", b"{}")] + _plain()[4:],
    "many members": [(f"d/s.x{j}", b"m") for j in range(20)] + [("d/s.jpg", b"j")] + _plain(),
    "zero-size members": [("d/z.jpg", b""), ("d/z.cls", b"4")] + _plain(),
    "meta and dotted names": [("__meta__.json", b"{}"), ("d/.hidden.jpg", b"h")] + _plain(),
    "dotted extension": _plain()[:2] + [("d/s0.input.jpg", b"i")] + _plain()[2:],
    "newline in a name": _plain()[:2] + [("d/s\n1.jpg", b"n")] + _plain()[2:],
    "a second image": _plain()[:1] + [("d/s0.png", b"second")] + _plain()[1:],
    "two label members": _plain()[:2] + [("d/s0.label", b"9")] + _plain()[2:],
    "long names": [("x" * 120 + ".jpg", b"l"), ("x" * 120 + ".cls", b"1")] + _plain(),
}


@pytest.mark.parametrize("case", sorted(ODD))
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_members_the_c_parser_hands_back_read_the_same(case, fmt):
    try:
        data = _tar(ODD[case], fmt)
    except ValueError:  # a name ustar cannot hold
        pytest.skip("not representable in this format")
    _same(data)


def _set(offset: int, value: bytes, only: int | None = None):
    def edit(i, header):
        if only is None or i == only:
            header[offset : offset + len(value)] = value

    return edit


HEADERS = {
    "size with leading spaces": _set(124, b"     " + b"%06o" % 700, only=2),
    "size NUL-terminated": _set(124, b"%010o\x00" % 774, only=2),
    "size in base-256": _set(124, b"\x80" + bytes(7) + (774).to_bytes(4, "big"), only=2),
    "size not octal": _set(124, b"0000000008", only=2),
    "type NUL": _set(156, b"\x00"),
    "type 7 (contiguous)": _set(156, b"7", only=3),
    "a directory": _set(156, b"5", only=4),
    "a ustar prefix": _set(345, b"pre", only=2),
    "GNU magic": _set(257, b"ustar  \x00", only=3),
    "no magic": _set(257, b"\x00" * 8, only=3),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_odd_headers_read_the_same(case):
    _same(_tar(_plain(), edit=HEADERS[case]))


@pytest.mark.parametrize("cut", [100, 511, 512, 1000, 1800, 3000, -1024, -600, -1])
def test_truncated_plain_tars_fail_the_same(cut):
    data = _tar(_plain())
    got = _same(data[:cut])
    assert got[-1][0] == "ShardFormatError"


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=damaged([_tar(_plain()), _tar(_plain(3), tarfile.GNU_FORMAT)], edits=4, width=8),
    chunk=st.sampled_from([512, 2048, 1 << 20]),
)
def test_damaged_plain_tars_read_the_same(data, chunk):
    _same(data, windows=[chunk], ranges=[(0, None), (2, None)])


def _at(data: bytes, tmp_path, native: bool, pick, fields=(), shift: int = 0, flip=None) -> list:
    """``read_at`` of the samples ``pick`` (indices) of the tar ``data``, at the byte ranges its
    index would place them (``shift`` moves each end), with their keys' hashes as the index
    stores them (``flip``: the pick whose hash is damaged), as (key, ext, data, label, fields),
    and last the picks left unchecked by C."""
    import numpy as np

    from shardkit.formats.sample_index import key_hashes
    from shardkit.formats.tar.tally import tally_tar

    path = tmp_path / "s.tar"
    path.write_bytes(data)
    tally = tally_tar(str(path), every=1, keys=True)
    offsets = np.array([*tally.index, tally.end], np.int64)
    pick = np.asarray(pick, np.int64)
    hashes = key_hashes([tally.keys[k] for k in pick]).astype(">u8")
    if flip is not None:
        hashes[flip] ^= 1
    saved = tar_reader._tar_at
    if not native:
        tar_reader._tar_at = None
    try:
        got, unchecked = tar_reader.read_at(
            data, offsets[pick], offsets[pick + 1] + shift, "s.tar", fields, hashes
        )
    except ShardkitError as exc:
        return [(type(exc).__name__, str(exc))]
    finally:
        tar_reader._tar_at = saved
    out = [None if r is None else (r.key, r.ext, r.data, r.label, r.fields) for r in got]
    return out + [unchecked if native else None]


def _same_at(data: bytes, tmp_path, streamed: bool = True) -> None:
    """Every sample, every other one and each alone: the C reader and the Python reader give
    the same records, and (``streamed``) the ones the streaming parser gives."""
    from shardkit.formats.tar.tally import count_tar_samples

    path = tmp_path / "s.tar"
    path.write_bytes(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # records without an image, passed over
            n = count_tar_samples(str(path))
    except ShardkitError:  # a tar no index is made for (e.g. a member twice)
        return
    stream = [r[:5] for r in _outcome(data, True)] if streamed else None
    for fields in [(), *FIELDS]:
        if streamed:
            stream = [r[:5] for r in _outcome(data, True, fields=fields)]
        for pick in [range(n), range(0, n, 2), range(1, n, 2), *([k] for k in range(n))]:
            got = _at(data, tmp_path, True, pick, fields)
            assert got[:-1] == _at(data, tmp_path, False, pick, fields)[:-1], (list(pick), fields)
            if streamed:
                assert got[:-1] == [stream[k] for k in pick], (list(pick), fields)


def test_the_c_reader_at_index_offsets_agrees_with_the_python_reader(tmp_path, monkeypatch):
    """``read_at`` (a subset's or split's samples at their index's byte ranges): plain samples
    come from C in one call, apart or in runs, the first and the last of a shard too (the last
    is closed by the end-of-archive block), and are the records streaming gives."""
    calls = []
    real = tar_reader._tar_at

    def counting(*args):
        got = real(*args)
        calls.append(sum(r is not None for r in got))
        return got

    monkeypatch.setattr(tar_reader, "_tar_at", counting)
    data = _tar(_plain())
    got = _at(data, tmp_path, True, [0, 2, 3, 5])
    assert calls == [4] and [r[0] for r in got[:-1]] == ["d/s0", "d/s2", "d/s3", "d/s5"]
    assert [r[3] for r in got[:-1]] == [0, 2, 0, 2] and got[-1] == []  # every key checked in C
    # a key whose hash is not its index's: not taken by C, left to the caller's check
    flipped = _at(data, tmp_path, True, [0, 2, 3, 5], flip=1)
    assert calls[-1] == 3 and flipped[:-1] == got[:-1] and flipped[-1] == [1]
    _same_at(data, tmp_path)


@pytest.mark.parametrize("case", sorted(ODD))
def test_odd_members_read_at_index_offsets_the_same(case, tmp_path):
    """Samples the C reader hands back (long names, PAX headers, meta records, a bad label,
    duplicates ...) read as the Python reader reads them."""
    try:
        data = _tar(ODD[case], tarfile.PAX_FORMAT)
    except ValueError:  # pragma: no cover - PAX holds every name
        pytest.skip("not representable")
    _same_at(data, tmp_path, streamed=False)


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_odd_headers_read_at_index_offsets_the_same(case, tmp_path):
    _same_at(_tar(_plain(), edit=HEADERS[case]), tmp_path, streamed=False)


@pytest.mark.parametrize("shift", [-512, 512, -1024])
def test_ranges_that_are_not_a_samples_are_handed_to_the_python_reader(shift, tmp_path):
    """An end that is not where the sample ends (a damaged index): the C reader takes no such
    sample, and the Python reader's answer stands (which the range reader then checks by key)."""
    data = _tar(_plain())
    for pick in ([1], [0, 3], [2, 4]):
        native = _at(data, tmp_path, True, pick, shift=shift)
        assert native[:-1] == _at(data, tmp_path, False, pick, shift=shift)[:-1]
        assert len(native) == 1 or native[-1] == list(range(len(pick)))


# --- a split's side check, in C and in Python ----------------------------------------------


def _keyed_tar(keys: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for k in keys:
            for ext, data in (("jpg", b"\xff\xd8" + k.encode()), ("cls", b"1")):
                info = tarfile.TarInfo(f"{k}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("flip", [None, 0, 5, 11])
def test_the_side_check_in_c_is_hashlibs(flip, monkeypatch):
    """Keys of every length a plain ustar name holds (1 to 95 bytes: the salt and key in one
    BLAKE2b block or at its edge): with each sample's own side in the bits every sample is read,
    in C and in Python alike; one bit flipped, both stop at that sample with the same error
    naming its key."""
    import numpy as np

    from shardkit.formats.sample_index import ShardSides, key_hashes

    keys = [(f"k{n}-" + "x" * 95)[:n] for n in (1, 2, 8, 50, 94, 95)]
    keys += [f"s{i:03d}" for i in range(6)]
    threshold = 1 << 63
    val = key_hashes(keys) < np.uint64(threshold)
    if flip is not None:
        val[flip] = not val[flip]
    bits = np.packbits(np.concatenate((np.zeros(3, bool), val)))  # the shard starts at 3
    sides = ShardSides(bits, 3, threshold)
    data = _keyed_tar(keys)
    checked = []  # the samples Python checked (C checks the ones it parses)
    real = ShardSides.on_side
    monkeypatch.setattr(ShardSides, "on_side", lambda s, n, k: checked.append(n) or real(s, n, k))
    _outcome(data, True, chunk=4 << 20, sides=sides)
    # C took every sample on its side but the last (closed by the end of the archive, not by
    # another sample's header: the Python parser's)
    assert checked == ([11] if flip in (None, 11) else [flip])
    for chunk in (1536, 4 << 20):
        got = [_outcome(data, native, chunk=chunk, sides=sides) for native in (True, False)]
        assert got[0] == got[1]
        if flip is None:
            assert [r[0] for r in got[0]] == keys
        else:
            assert [r[0] for r in got[0][:-1]] == keys[:flip]
            assert got[0][-1][0] == "ShardFormatError" and repr(keys[flip]) in got[0][-1][1]


@pytest.mark.parametrize("size", [0, 1, 3, 16, 17, 128, 129, 240, 241, 1000, 100000])
def test_the_c_parsers_xxh3_is_xxhashs(size):
    """The digest tar_at checks is the xxhash wheel's ``xxh3_64_intdigest`` (FORMAT.md's sample
    digest) at each of XXH3's code paths (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer bytes), on
    random bytes and on a misaligned slice."""
    import os

    import xxhash

    from shardkit.images import _native

    for _ in range(20):
        data = os.urandom(size + 1)
        for b in (data[:size], memoryview(data)[1:]):
            assert _native.xxh3_64(b) == xxhash.xxh3_64_intdigest(b)


def test_a_flipped_byte_is_caught_by_the_c_parsers_digest_check(tmp_path):
    """A byte flipped in any sample (its headers or its data) makes tar_at answer that sample's
    number instead of records; every sample's own bytes pass."""
    import numpy as np

    from shardkit.formats.sample_index import SPLIT_SALT, sample_digest

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(6):
            for ext, data in (("jpg", bytes([i]) * (300 + 97 * i)), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"s{i:03d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    blob = bytearray(buf.getvalue())
    cuts = [0]
    for i in range(6):  # each sample: its two members
        for size in (300 + 97 * i, len(b"%d" % i)):
            cuts.append(cuts[-1] + 512 + (size + 511) // 512 * 512)
    starts, ends = np.array(cuts[0:-1:2], np.int64), np.array(cuts[2::2], np.int64)
    digests = np.array(
        [sample_digest(blob[a:b]) for a, b in zip(starts, ends, strict=True)], np.uint64
    )

    def call(data):
        return tar_reader._tar_at(
            data, starts, ends, b"", SPLIT_SALT, tar_reader._IMAGE_EXTS, tar_reader._LABEL_EXTS,
            frozenset(), tar_reader.Record, "t.tar", digests,
        )  # fmt: skip

    assert [r.key for r in call(blob)] == [f"s{i:03d}" for i in range(6)]
    for i in range(6):
        for at in (int(starts[i]) + 3, int(starts[i]) + 600, int(ends[i]) - 1):
            bad = bytearray(blob)
            bad[at] ^= 0x01
            assert call(bad) == i


def test_pread_spans_lays_a_files_spans_end_to_end(tmp_path):
    """The range reader's one call a chunk (``_native.pread_spans``): each span's bytes in order
    from the buffer's start; fewer bytes where the file ends first (the reader names the shard);
    a span out of order or past the buffer refused; a read that fails is an OSError."""
    import os

    import numpy as np

    from shardkit.images import _native

    data = bytes(range(256)) * 40  # 10,240 bytes
    path = tmp_path / "f"
    path.write_bytes(data)
    lo = np.array([0, 700, 5000, 10000], np.int64)
    hi = np.array([100, 1800, 5001, 10240], np.int64)
    want = b"".join(data[a:b] for a, b in zip(lo.tolist(), hi.tolist(), strict=True))
    buf = bytearray(len(want) + 7)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _native.pread_spans(fd, buf, lo, hi) == len(want)
        assert bytes(buf[: len(want)]) == want
        past = np.array([10200], np.int64), np.array([10300], np.int64)  # the file ends at 10,240
        assert _native.pread_spans(fd, buf, *past) == 40
        assert bytes(buf[:40]) == data[10200:]
        with pytest.raises(ValueError, match="past the buffer"):
            _native.pread_spans(fd, bytearray(10), lo, hi)
        with pytest.raises(ValueError, match="out of order"):
            _native.pread_spans(fd, buf, hi, lo)
        with pytest.raises(ValueError, match="differ in length"):
            _native.pread_spans(fd, buf, lo, hi[:2])
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        _native.pread_spans(fd, buf, lo, hi)  # closed
