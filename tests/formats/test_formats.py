"""Tar and LMDB shards: round trips, slices, compatibility with standard readers, truncation."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import sys
import tarfile

import lmdb
import pytest

from shardkit.errors import InputError, ShardFormatError
from shardkit.formats import FORMATS, decode_key, encode_key, format_for_path, get_format
from shardkit.records import ShardInfo
from shardkit.stream.storage import LocalStorage


def _samples(n: int = 40, seed: int = 0) -> list[tuple[str, str, bytes, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        stem = f"class_{i % 3}/img.{i}_ünïcødé" + ("_long" * 30 if i == 5 else "")
        data = rng.randbytes(rng.randint(1, 40_000))
        out.append((encode_key(stem), "png" if i % 7 == 0 else "jpg", data, i % 3))
    return out


def _write(fmt_name: str, path, samples) -> None:
    w = get_format(fmt_name).open_writer(str(path))
    for key, ext, data, label in samples:
        w.add(key, ext, data, label)
    stats = w.close()
    assert stats.samples == len(samples)
    assert stats.bytes == os.path.getsize(path)


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_round_trip_and_slices(tmp_path, fmt_name):
    samples = _samples()
    path = tmp_path / f"s{FORMATS[fmt_name].suffix}"
    _write(fmt_name, path, samples)
    fmt = format_for_path(str(path))
    got = [(r.key, r.ext, r.data, r.label) for r in fmt.iter_records(str(path))]
    assert got == samples
    assert fmt.count(LocalStorage(), ShardInfo(str(path))) == len(samples)
    for start, stop in [(0, 1), (7, 13), (39, 40), (12, None), (40, 40)]:
        keys = [r.key for r in fmt.iter_records(str(path), start=start, stop=stop)]
        assert keys == [s[0] for s in samples[start:stop]]


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_projected_size_is_an_upper_bound(tmp_path, fmt_name):
    path = tmp_path / f"s{FORMATS[fmt_name].suffix}"
    w = get_format(fmt_name).open_writer(str(path))
    projected = 0
    for key, ext, data, label in _samples(60, seed=1):
        projected = w.projected_size(key, ext, len(data))
        w.add(key, ext, data, label)
    stats = w.close()
    assert stats.bytes <= projected
    if fmt_name == "tar":
        assert stats.bytes == projected  # tar sizes are exact


def test_tar_is_reproducible_and_read_by_standard_tools(tmp_path):
    samples = _samples()
    _write("tar", tmp_path / "a.tar", samples)
    _write("tar", tmp_path / "b.tar", samples)
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()

    names = [f"{k}.{e}" for k, e, _, _ in samples for e in (e, "cls")]
    with tarfile.open(tmp_path / "a.tar") as tf:
        assert tf.getnames() == names
        assert all(m.pax_headers == {} for m in tf.getmembers())
        assert tf.extractfile(names[1]).read() == b"0"
    if shutil.which("tar"):
        out = subprocess.run(
            ["tar", "-tf", str(tmp_path / "a.tar")], capture_output=True, text=True
        )
        assert out.returncode == 0 and out.stderr == ""
        assert out.stdout.splitlines() == names

    wds = pytest.importorskip("webdataset")
    got = list(wds.WebDataset(str(tmp_path / "a.tar"), shardshuffle=False))
    assert [g["__key__"] for g in got] == [s[0] for s in samples]
    assert [g[s[1]] for g, s in zip(got, samples, strict=True)] == [s[2] for s in samples]


def test_reads_tars_written_by_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    samples = _samples()
    with wds.TarWriter(str(tmp_path / "w.tar")) as tw:
        for key, ext, data, label in samples:
            tw.write({"__key__": key, ext: data, "cls": label, "json": {"k": key}})
    fmt = get_format("tar")
    got = [(r.key, r.ext, r.data, r.label) for r in fmt.iter_records(str(tmp_path / "w.tar"))]
    assert got == samples
    assert fmt.count(LocalStorage(), ShardInfo(str(tmp_path / "w.tar"))) == len(samples)


@pytest.mark.parametrize("cut", ["end_blocks", "mid_member", "mid_header", "empty"])
def test_truncated_tar_is_an_error_not_a_short_epoch(tmp_path, cut):
    _write("tar", tmp_path / "s.tar", _samples())
    data = (tmp_path / "s.tar").read_bytes()
    size = {
        "end_blocks": len(data) - 1024,
        "mid_member": len(data) // 2,
        "mid_header": 700,
        "empty": 0,
    }[cut]
    (tmp_path / "t.tar").write_bytes(data[:size])
    fmt = get_format("tar")
    with pytest.raises(ShardFormatError, match=r"t\.tar: truncated tar"):
        list(fmt.iter_records(str(tmp_path / "t.tar")))
    with pytest.raises(ShardFormatError, match="truncated"):
        fmt.count(LocalStorage(), ShardInfo(str(tmp_path / "t.tar")))


def test_corrupt_tar_header_is_detected(tmp_path):
    samples = _samples()
    _write("tar", tmp_path / "s.tar", samples)
    data = bytearray((tmp_path / "s.tar").read_bytes())
    second = 512 + (len(samples[0][2]) + 511) // 512 * 512  # header of the first .cls member
    data[second + 257 : second + 262] = b"XXXXX"  # magic gone -> checksum path; checksum now wrong
    (tmp_path / "c.tar").write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="corrupt tar header"):
        list(get_format("tar").iter_records(str(tmp_path / "c.tar")))


class _TrickleStream(io.RawIOBase):
    """Non-seekable, short reads: what a socket or a decompressor hands a reader."""

    def __init__(self, data: bytes):
        self._b = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        chunk = self._b.read(min(len(buf), 777))
        buf[: len(chunk)] = chunk
        return len(chunk)


def test_tar_reads_non_seekable_streams(tmp_path):
    samples = _samples()
    _write("tar", tmp_path / "s.tar", samples)
    data = (tmp_path / "s.tar").read_bytes()
    fmt = get_format("tar")
    keys = [r.key for r in fmt.iter_records(_TrickleStream(data), start=10, stop=25)]
    assert keys == [s[0] for s in samples[10:25]]
    assert [r.data for r in fmt.iter_records(io.BytesIO(data))] == [s[2] for s in samples]


def test_tar_member_larger_than_read_window(tmp_path):
    big = [(encode_key("c/big"), "png", random.Random(3).randbytes(9 << 20), 1)]
    _write("tar", tmp_path / "s.tar", big + _samples(3))
    got = list(get_format("tar").iter_records(str(tmp_path / "s.tar")))
    assert got[0].data == big[0][2] and len(got) == 4


def test_lmdb_shard_opens_with_plain_lmdb_and_grows_its_map(tmp_path):
    from shardkit.formats.lmdb import LmdbShardWriter, decode_value, sample_key

    path = str(tmp_path / "s.lmdb")
    w = LmdbShardWriter(path, map_size=1 << 20)  # far too small: must grow, not MDB_MAP_FULL
    samples = _samples(80)
    for s in samples:
        w.add(*s)
    w.close()
    assert not os.path.exists(path + "-lock")
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        rec = decode_value(txn.get(sample_key(41)), path, 41)
    env.close()
    assert (rec.key, rec.ext, rec.data, rec.label) == samples[41]


def test_lmdb_writer_replaces_an_existing_file(tmp_path):
    path = tmp_path / "s.lmdb"
    _write("lmdb", path, _samples(30, seed=1))
    _write("lmdb", path, _samples(5, seed=2))
    got = [(r.key, r.ext, r.data, r.label) for r in get_format("lmdb").iter_records(str(path))]
    assert got == _samples(5, seed=2)


def test_lmdb_errors_name_the_shard(tmp_path):
    fmt = get_format("lmdb")
    with pytest.raises(ShardFormatError, match="missing.lmdb"):
        list(fmt.iter_records(str(tmp_path / "missing.lmdb")))
    (tmp_path / "junk.lmdb").write_bytes(b"not an lmdb file" * 300)
    with pytest.raises(ShardFormatError, match="junk.lmdb"):
        fmt.count(LocalStorage(), ShardInfo(str(tmp_path / "junk.lmdb")))
    _write("lmdb", tmp_path / "s.lmdb", _samples(4))
    with pytest.raises(ShardFormatError, match="holds 4"):
        list(fmt.iter_records(str(tmp_path / "s.lmdb"), start=2, stop=9))


def test_keys_have_no_dots_and_round_trip():
    for stem in ["a/b.c.d", "x%2E/y.", "Jean-Claude_Van_Damme/J.C._0001", "ü/%"]:
        key = encode_key(stem)
        assert "." not in key
        assert decode_key(key) == stem
    assert encode_key("a.b") != encode_key("a_b")


def test_format_lookup_errors():
    with pytest.raises(InputError, match="unknown shard format 'zip'"):
        get_format("zip")
    with pytest.raises(InputError, match="shards end in"):
        format_for_path("out/shard.bin")
    assert format_for_path("s3://b/p/shard-000001.tar?versionId=3").name == "tar"


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_same_input_gives_identical_bytes(tmp_path, fmt_name):
    suffix = FORMATS[fmt_name].suffix
    for name in ("a", "b"):
        _write(fmt_name, tmp_path / f"{name}{suffix}", _samples(60, seed=4))
    assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


@pytest.mark.slow  # a child interpreter (a crash must not kill the run)
@pytest.mark.parametrize("keep", [0.5, 0.9, 0.001])
def test_truncated_lmdb_is_an_error_not_a_crash(tmp_path, keep):
    # Run in a child: before the size check, touching the unmapped tail killed it with SIGBUS.
    _write("lmdb", tmp_path / "s.lmdb", _samples(60))
    data = (tmp_path / "s.lmdb").read_bytes()
    (tmp_path / "t.lmdb").write_bytes(data[: int(len(data) * keep)])
    code = (
        "import sys\n"
        "from shardkit.formats import get_format\n"
        "from shardkit.errors import ShardFormatError\n"
        "try:\n"
        f"    list(get_format('lmdb').iter_records({str(tmp_path / 't.lmdb')!r}))\n"
        "except ShardFormatError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "t.lmdb: truncated LMDB shard" in out.stdout


class _CountingFile(io.FileIO):
    """A real file that counts the bytes handed to the reader."""

    read_bytes = 0

    def readinto(self, buf):
        n = super().readinto(buf)
        self.read_bytes += n or 0
        return n


def test_tar_index_points_at_every_64th_sample(tmp_path):
    from shardkit.manifest import INDEX_EVERY

    samples = _samples(200, seed=5)
    w = get_format("tar").open_writer(str(tmp_path / "s.tar"))
    for s in samples:
        w.add(*s)
    stats = w.close()
    assert len(stats.index) == 4 and stats.index[0] == 0
    with tarfile.open(tmp_path / "s.tar") as tf:
        offsets = {m.name: m.offset for m in tf.getmembers()}
    for k, offset in enumerate(stats.index):
        key, ext = samples[k * INDEX_EVERY][:2]
        assert offsets[f"{key}.{ext}"] == offset or offset < offsets[f"{key}.{ext}"] < offset + 2048


@pytest.mark.parametrize("start, stop", [(0, 10), (63, 70), (64, 65), (130, None), (149, 150)])
def test_tar_index_gives_the_same_samples_and_skips_the_prefix(tmp_path, start, stop):
    samples = _samples(150, seed=6)  # ~3 MB: less than the reader's 4 MB window
    w = get_format("tar").open_writer(str(tmp_path / "s.tar"))
    for s in samples:
        w.add(*s)
    index = w.close().index
    fmt = get_format("tar")
    size = os.path.getsize(tmp_path / "s.tar")
    read = {}
    for name, idx in [("plain", ()), ("indexed", index)]:
        with _CountingFile(tmp_path / "s.tar") as f:
            got = [r.key for r in fmt.iter_records(f, start=start, stop=stop, index=idx)]
            read[name] = f.read_bytes
        assert got == [s[0] for s in samples[start:stop]]
    prefix = index[start // 64]
    assert read["plain"] == size  # one big window: the prefix is read and thrown away
    assert read["indexed"] == size - prefix  # the prefix before the indexed sample is not
