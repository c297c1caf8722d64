"""Foreign tars: what tarfile, GNU tar or webdataset wrote reads as webdataset reads it.

Every tar here is built by a real writer (``tarfile`` in ustar/gnu/pax, GNU ``tar`` in
ustar/gnu/pax, webdataset's ``TarWriter``) and read back by our reader and webdataset's, and
the keys, image bytes, labels, extra members and counts must agree.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import shutil
import tarfile

import pytest
from conftest import gnu_tar
from PIL import Image

from shardkit import Order, ShardDataset
from shardkit.errors import ShardFormatError
from shardkit.formats import format_for_path
from shardkit.formats.tar import IMAGE_EXTS, count_tar_samples, iter_tar_records

wds = pytest.importorskip("webdataset")


def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8 + seed % 5, 8), (seed * 37 % 256, 50, 90)).save(buf, "JPEG")
    return buf.getvalue()


_LONG = "b/" + "d" * 60 + "/" + "e" * 60  # > 100 bytes, splittable into a ustar prefix + name

#: Member order and bytes of the foreign corpus: every case of the issue's "Why" list.
MEMBERS: list[tuple[str, bytes]] = [
    ("a/s0.jpg", _jpeg(0)),
    ("a/s0.cls", b"0"),
    ("a/s0.json", b'{"caption": "zero"}'),
    ("__meta__.json", b'{"about": "a record without an image"}'),  # not a sample
    ("a/s1.input.jpg", _jpeg(1)),  # several dots: key a/s1, ext input.jpg
    ("a/s1.cls", b"1\n"),
    ("a/s1.txt", b"one"),
    ("b/s2.PNG", _jpeg(2)),  # upper-case extension: lowercased, as webdataset does
    ("b/s2.cls", b"2"),
    (_LONG + ".jpg", _jpeg(3)),  # long name: GNU L, PAX path or ustar prefix
    (_LONG + ".cls", b"0"),
    ("c/s4.jpg", _jpeg(4)),  # no label member: -1
    ("c/s4.json", b"{}"),
    ("dir.with.dots/s5.jpeg", _jpeg(5)),  # dots in the directory are not the key's
    ("dir.with.dots/s5.label", b"1"),
    ("ünï/s6.jpg", _jpeg(6)),  # UTF-8 names
    ("ünï/s6.cls", b"2"),
    ("c/s7.jpg", _jpeg(7)),
    ("c/s7.output.png", _jpeg(70)),  # a second image rides along as an extra member
    ("c/s7.cls", b"1"),
    ("c/captions_only.txt", b"no image here"),  # a record without an image: not a sample
]
N_SAMPLES = 8


def _tarfile(path, fmt, members=MEMBERS) -> str:
    with tarfile.open(path, "w", format=fmt, encoding="utf-8") as tf:
        d = tarfile.TarInfo("a")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)  # a directory member: not sample data
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def _gnu_tar(tmp_path, fmt, members=MEMBERS) -> str:
    return gnu_tar(tmp_path / f"tree-{fmt}", tmp_path / f"gnu-{fmt}.tar", members, fmt)


def _wds_tar(path, members=MEMBERS) -> str:
    """webdataset's own writer: one dict per key, in our member order."""
    samples: dict[str, dict] = {}
    for name, data in members:
        key, ext = wds.tariterators.base_plus_ext(name)
        samples.setdefault(key, {"__key__": key})[ext] = data
    with wds.TarWriter(str(path)) as w:
        for s in samples.values():
            w.write(s)
    return str(path)


WRITERS = {
    "tarfile-ustar": lambda tmp: _tarfile(tmp / "u.tar", tarfile.USTAR_FORMAT),
    "tarfile-gnu": lambda tmp: _tarfile(tmp / "g.tar", tarfile.GNU_FORMAT),
    "tarfile-pax": lambda tmp: _tarfile(tmp / "p.tar", tarfile.PAX_FORMAT),
    "gnutar-ustar": lambda tmp: _gnu_tar(tmp, "ustar"),
    "gnutar-gnu": lambda tmp: _gnu_tar(tmp, "gnu"),
    "gnutar-pax": lambda tmp: _gnu_tar(tmp, "pax"),
    "webdataset": lambda tmp: _wds_tar(tmp / "w.tar"),
}
needs_gnu_tar = pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")


def _theirs(path) -> list[tuple]:
    """webdataset's samples, reduced to ours: those with an image member, first image wins."""
    out = []
    for s in wds.WebDataset(str(path), shardshuffle=False, empty_check=False):
        exts = [k for k in s if not k.startswith("__")]
        images = [k for k in exts if k.rsplit(".", 1)[-1] in IMAGE_EXTS]
        if not images:
            continue
        raw = next((s[k] for k in ("cls", "label", "cls.txt", "index") if k in s), None)
        label = int(raw) if raw is not None else -1
        extra = {k: s[k] for k in exts if k in ("json", "txt")}
        out.append((s["__key__"], images[0], s[images[0]], label, extra))
    return out


def _ours(source, **kw) -> list[tuple]:
    return [
        (r.key, r.ext, r.data, r.label, r.fields)
        for r in iter_tar_records(source, fields=("json", "txt"), **kw)
    ]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_foreign_tars_read_exactly_as_webdataset_reads_them(tmp_path, writer):
    if writer.startswith("gnutar") and shutil.which("tar") is None:
        pytest.skip("GNU tar not installed")
    path = WRITERS[writer](tmp_path)
    ours, theirs = _ours(path), _theirs(path)
    assert ours == theirs
    assert len(ours) == N_SAMPLES
    assert [o[0] for o in ours][:3] == ["a/s0", "a/s1", "b/s2"]
    assert ours[1][1] == "input.jpg" and ours[2][1] == "png" and ours[3][0] == _LONG
    assert [o[3] for o in ours] == [0, 1, 2, 0, -1, 1, 2, 1]
    assert ours[0][4] == {"json": b'{"caption": "zero"}'} and ours[1][4] == {"txt": b"one"}
    # counting applies the same rules and says what it passed over
    with pytest.warns(RuntimeWarning, match="2 records without an image member"):
        assert count_tar_samples(path) == N_SAMPLES
    # and so does a stream that cannot seek
    with open(path, "rb") as f:
        assert _ours(io.BufferedReader(_Unseekable(f.read()))) == theirs


class _Unseekable(io.RawIOBase):
    def __init__(self, data: bytes):
        self._b = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        return self._b.readinto(buf)


@pytest.mark.parametrize("suffix", [".tar.gz", ".tgz"])
def test_gzip_shards_stream_like_the_plain_tar(tmp_path, suffix):
    plain = _tarfile(tmp_path / "p.tar", tarfile.PAX_FORMAT)
    gz = tmp_path / f"p{suffix}"
    gz.write_bytes(gzip.compress(open(plain, "rb").read()))
    assert format_for_path(str(gz)).name == "tar"
    assert _ours(str(gz)) == _ours(plain) == _theirs(gz)
    assert _ours(str(gz), start=3, stop=6) == _ours(plain)[3:6]
    # an offset index is ignored (no seeking in a gzip stream): same samples
    assert _ours(str(gz), start=3, index=(0, 10)) == _ours(plain)[3:]
    # a remote-like stream is recognised by the shard name it is read under
    with open(gz, "rb") as f:
        assert _ours(f, shard="s3://b/p" + suffix) == _ours(plain)
    with pytest.warns(RuntimeWarning, match="without an image"):
        ds = ShardDataset(str(gz), decode="raw", order=Order(shuffle=False))
    assert len(ds) == N_SAMPLES
    assert [s[0] for s in ds] == [o[2] for o in _ours(plain)]


def test_gzip_bytes_under_a_tar_name_say_compressed(tmp_path):
    plain = _tarfile(tmp_path / "p.tar", tarfile.GNU_FORMAT)
    bad = tmp_path / "shard.tar"
    bad.write_bytes(gzip.compress(open(plain, "rb").read()))
    for fn in (lambda: list(iter_tar_records(str(bad))), lambda: count_tar_samples(str(bad))):
        match = r"shard\.tar: the shard is gzip-compressed.*\.tar\.gz"
        with pytest.raises(ShardFormatError, match=match):
            fn()


def test_truncated_gzip_names_an_offset_inside_the_file(tmp_path):
    plain = _tarfile(tmp_path / "p.tar", tarfile.GNU_FORMAT)
    data = gzip.compress(open(plain, "rb").read())
    cut = tmp_path / "c.tar.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardFormatError, match=r"c\.tar\.gz: damaged or truncated gzip") as exc:
        list(iter_tar_records(str(cut)))
    after = int(str(exc.value).split(" after ")[1].split()[0])
    assert after <= len(data) // 2


@pytest.mark.parametrize("dup", [("s0.jpg", "s0.jpg"), ("s0.JPG", "s0.jpg"), ("s0.cls", "s0.cls")])
def test_a_member_duplicated_in_a_sample_is_an_error(tmp_path, dup):
    members = [
        (dup[0], _jpeg(0) if "jpg" in dup[0].lower() else b"1"),
        ("s0.json", b"{}"),
        (dup[1], _jpeg(1) if "jpg" in dup[1] else b"2"),
    ]
    if "cls" in dup[0]:
        members.insert(0, ("s0.jpg", _jpeg(0)))
    path = _tarfile(tmp_path / "d.tar", tarfile.GNU_FORMAT, members)
    with pytest.raises(ValueError, match="duplicate"):
        list(wds.WebDataset(path, shardshuffle=False, empty_check=False))
    for fn in (lambda: list(iter_tar_records(path)), lambda: count_tar_samples(path)):
        match = r"d\.tar: sample 's0' has two '(jpg|cls)' members"
        with pytest.raises(ShardFormatError, match=match):
            fn()


def _data_end(path) -> tuple[int, int, int]:
    """(end of the last member's data, start of its header, start of its data)."""
    with tarfile.open(path) as tf:
        last = tf.getmembers()[-1]
    return last.offset_data + (last.size + 511) // 512 * 512, last.offset, last.offset_data


@needs_gnu_tar
@pytest.mark.parametrize("cut", ["one_end_block", "both_end_blocks", "in_header", "in_member"])
@pytest.mark.parametrize("how", ["path", "stream", "gzip"])
def test_truncation_in_any_form_is_an_error_with_an_offset_inside_the_file(tmp_path, cut, how):
    path = _gnu_tar(tmp_path, "gnu")  # GNU tar pads to 10 KB records: cut what matters
    end, header, data = _data_end(path)
    size = {
        "one_end_block": end + 512,
        "both_end_blocks": end,
        "in_header": header + 100,
        "in_member": data + 10,
    }[cut]
    blob = open(path, "rb").read()[:size]
    if how == "path":
        src = tmp_path / "t.tar"
        src.write_bytes(blob)
        make = lambda: str(src)  # noqa: E731
    elif how == "stream":
        make = lambda: io.BufferedReader(_Unseekable(blob))  # noqa: E731
    else:
        src = tmp_path / "t.tar.gz"
        src.write_bytes(gzip.compress(blob))
        make = lambda: str(src)  # noqa: E731
    for fn in (lambda: list(iter_tar_records(make())), lambda: count_tar_samples(make())):
        with pytest.raises(ShardFormatError, match="truncated tar") as exc:
            fn()
        ends_at = int(re.search(r"ends at byte (\d+)", str(exc.value)).group(1))
        assert ends_at == size  # the size of the tar stream, never beyond it
        if cut == "one_end_block":
            assert "second is missing" in str(exc.value)


def test_a_complete_gnu_tar_with_record_padding_reads(tmp_path):
    if shutil.which("tar") is None:
        pytest.skip("GNU tar not installed")
    path = _gnu_tar(tmp_path, "gnu")
    assert os.path.getsize(path) % 10240 == 0
    assert len(_ours(path)) == N_SAMPLES


def test_shard_dataset_on_foreign_tars(tmp_path):
    path = _tarfile(tmp_path / "f.tar", tarfile.PAX_FORMAT)
    with pytest.warns(RuntimeWarning, match=r"f\.tar: 2 records without an image member"):
        ds = ShardDataset(path, decode="raw", order=Order(shuffle=False))
    assert len(ds) == N_SAMPLES  # the metadata and caption-only records are not samples
    plain = list(ds)
    assert all(len(s) == 2 for s in plain)  # default shape unchanged
    with pytest.warns(RuntimeWarning):
        ds = ShardDataset(
            path, decode="raw", order=Order(shuffle=False), fields=("json",), with_keys=True
        )
    got = list(ds)
    assert [len(s) for s in got] == [4] * N_SAMPLES
    assert got[0][2:] == ("a/s0", b'{"caption": "zero"}')
    assert got[1][3] is None  # a sample without that member


def test_on_error_skip_on_a_foreign_tar(tmp_path):
    members = [m for m in MEMBERS if not m[0].startswith("b/s2")] + [
        ("z/bad.jpg", b"\xff\xd8 not a jpeg"),
        ("z/bad.cls", b"1"),
    ]
    path = _tarfile(tmp_path / "f.tar", tarfile.GNU_FORMAT, members)
    with pytest.warns(RuntimeWarning):
        ds = ShardDataset(
            path, decode="tensor", order=Order(shuffle=False), on_error="skip", with_keys=True
        )
    assert len(ds) == N_SAMPLES  # 7 good + 1 undecodable; the 2 image-less records not counted
    with pytest.warns(RuntimeWarning, match="z/bad"):
        got = list(ds)
    assert len(got) == N_SAMPLES - 1 and ds.skipped == 1
    assert "z/bad" not in [k for _, _, k in got]
