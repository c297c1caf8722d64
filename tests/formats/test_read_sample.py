"""``read_sample`` (one sample's byte range, random access) gives what streaming gives, for tars
written by shardkit and by GNU tar in each of its formats, odd members included."""

from __future__ import annotations

import pytest
from conftest import gnu_tar

from shardkit.errors import ShardFormatError
from shardkit.formats.tar.reader import iter_tar_records, read_sample
from shardkit.formats.tar.tally import tally_tar
from shardkit.write.writer import ShardWriter

LONG = "d/" + "n" * 120  # past ustar's 100-byte name: a long-name or PAX record

MEMBERS = [
    ("a/x.jpg", b"\xff\xd8 x"),
    ("a/x.cls", b"2"),
    ("a/x.json", b'{"x": 1}'),
    ("__meta__.json", b"{}"),  # a record without an image: not a sample
    ("b/y.JPG", b"\xff\xd8 y"),  # upper-case extension
    ("b/y.seg.png", b"\x89PNG y"),  # a second image rides along
    ("b/y.txt", b"caption"),
    (LONG + ".jpg", b"\xff\xd8 long"),
    (LONG + ".cls", b"0"),
    ("c/z.input.jpg", b"\xff\xd8 z"),
    ("c/z.label", b" 7 "),
]


def _ranges(path: str) -> list[tuple[int, int]]:
    with open(path, "rb") as f:
        data = f.read()
    starts = tally_tar(path, every=1).index
    return [(a, b) for a, b in zip(starts, [*starts[1:], len(data)], strict=True)], data


def _check(path: str, fields=("json", "txt")):
    ranges, data = _ranges(path)
    streamed = list(iter_tar_records(path, shard="s", fields=fields))
    got = [read_sample(data[a:b], "s", fields) for a, b in ranges]
    assert got == streamed and len(got) == len(ranges)


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax"])
def test_foreign_tars_read_by_range_equal_streaming(tmp_path, fmt):
    members = [m for m in MEMBERS if fmt != "ustar" or not m[0].startswith(LONG)]
    _check(gnu_tar(tmp_path / "src", tmp_path / f"{fmt}.tar", members, fmt))


def test_shardkit_tars_read_by_range_equal_streaming(tmp_path):
    with ShardWriter(str(tmp_path / "d"), shard_size="1MB") as w:
        for i in range(40):
            w.add(
                f"k/{i}",
                "jpg",
                b"x" * (i * 37),
                i % 4,
                extra={"json": b"%d" % i} if i % 3 else None,
            )
    _check(str(next((tmp_path / "d").glob("*.tar"))), fields=("json",))


def test_a_bad_label_raises_as_streaming_does(tmp_path):
    path = gnu_tar(tmp_path / "src", tmp_path / "bad.tar", [("k.jpg", b"x"), ("k.cls", b"two")])
    ranges, data = _ranges(path)
    with pytest.raises(ShardFormatError, match="label"):
        list(iter_tar_records(path))
    with pytest.raises(ShardFormatError, match="label"):
        read_sample(data[ranges[0][0] : ranges[0][1]], "bad.tar")


def test_a_truncated_range_is_an_error_not_a_short_sample(tmp_path):
    path = gnu_tar(tmp_path / "src", tmp_path / "t.tar", [("k.jpg", b"x" * 2000), ("k.cls", b"1")])
    _, data = _ranges(path)
    with pytest.raises(ShardFormatError, match="truncated|ends"):
        read_sample(data[:1536], "t.tar")
