"""Hostile tar headers and manifests: bounded parsing, clean errors, no silent drops.

Every case here once hung, allocated the size a header claimed, or raised a raw Python error.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest

from shardkit import Order
from shardkit.errors import ShardFormatError
from shardkit.formats import encode_key, get_format
from shardkit.records import ShardInfo
from shardkit.stream.storage import LocalStorage


def _with_checksum(block: bytearray) -> bytes:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\x00 " % sum(block)
    return bytes(block)


def _small_tar(tmp_path, n: int = 3) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(n):
            for ext, data in (("jpg", b"\xff\xd8" + bytes(1000)), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _with_size_field(data: bytes, field: bytes) -> bytes:
    """The tar with its first header's 12-byte size field replaced (checksum recomputed)."""
    block = bytearray(data[:512])
    block[124:136] = field
    return _with_checksum(block) + data[512:]


_BIG_FIELDS = {
    "8GiB-octal": b"77777777777\x00",
    "2^80-base256": b"\x80" + (1 << 80).to_bytes(11, "big"),
}


@pytest.mark.slow  # a child interpreter under limits
@pytest.mark.parametrize("field", sorted(_BIG_FIELDS))
@pytest.mark.parametrize("seekable", [True, False])
def test_huge_size_field_is_checked_before_allocating(tmp_path, field, seekable):
    """An 8 GiB (or 2^80) size field in a 4 KB file: a clean error under a 1 GiB address-space
    cap above what the interpreter already maps (the old reader allocated the claimed size)."""
    path = tmp_path / "huge.tar"
    path.write_bytes(_with_size_field(_small_tar(tmp_path), _BIG_FIELDS[field]))
    script = textwrap.dedent(
        f"""
        import io, resource, sys
        from shardkit.errors import ShardFormatError
        from shardkit.formats.tar import count_tar_samples, iter_tar_records
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1])
        cap = vm * 1024 + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        data = open({str(path)!r}, "rb").read()
        src = (lambda: {str(path)!r}) if {seekable} else (lambda: io.BufferedReader(
            type("S", (io.RawIOBase,), {{"readable": lambda s: True,
                "readinto": lambda s, b: s.__dict__.setdefault("b", io.BytesIO(data)).readinto(b)
            }})()))
        for fn in (lambda: list(iter_tar_records(src())), lambda: count_tar_samples(src())):
            try:
                fn()
            except ShardFormatError as exc:
                print("OK", exc)
            else:
                sys.exit("no error")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all("truncated tar" in line for line in lines), lines
    if seekable:  # the offset named is inside the file
        assert all(f"ends at byte {path.stat().st_size}" in line for line in lines), lines


def _pax_tar(record: bytes) -> bytes:
    """A tar whose first member is preceded by a PAX header holding ``record``."""
    good = _small_tar(None)
    pax = bytearray(512)
    pax[:16] = b"././@PaxHeader\x00\x00"
    pax[100:108] = b"0000644\x00"
    pax[124:136] = b"%011o\x00" % len(record)
    pax[156:157] = b"x"
    pax[257:265] = b"ustar\x0000"
    body = record + bytes(-len(record) % 512)
    return _with_checksum(pax) + body + good


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "record",
    [b"0 path=x\n", b"-5 path=x\n", b"abc path=x\n", b"3 path=x\n", b"999 path=x\n", b"12"],
)
def test_pax_record_lengths_are_bounded(tmp_path, record):
    """Length 0 or negative looped forever; non-numeric was a raw ValueError."""
    (tmp_path / "p.tar").write_bytes(_pax_tar(record))
    fmt = get_format("tar")
    with pytest.raises(ShardFormatError, match=r"p\.tar: corrupt PAX header at byte 0"):
        list(fmt.iter_records(str(tmp_path / "p.tar")))
    with pytest.raises(ShardFormatError, match="corrupt PAX header"):
        fmt.count(LocalStorage(), ShardInfo(str(tmp_path / "p.tar")))


def test_valid_pax_path_is_still_honoured(tmp_path):
    rec = b"path=s0.png\n"
    rec = b"%d " % (len(rec) + 3) + rec
    (tmp_path / "p.tar").write_bytes(_pax_tar(rec))
    recs = list(get_format("tar").iter_records(str(tmp_path / "p.tar")))
    got = [(r.key, r.ext, r.label) for r in recs]
    assert got == [("s0", "png", 0), ("s1", "jpg", 1), ("s2", "jpg", 2)]


def test_manifest_count_smaller_than_the_shard_is_an_error(tmp_path):
    """The stream used to stop at the manifest's count and drop the rest silently."""
    from shardkit import ShardDataset
    from shardkit.manifest import Manifest, ShardEntry, write_manifest

    w = get_format("tar").open_writer(str(tmp_path / "shard-000000.tar"))
    for i in range(10):
        w.add(encode_key(f"c/{i}"), "jpg", b"x" * 10, 0)
    st = w.close()
    entry = ShardEntry("shard-000000.tar", 7, st.bytes, st.sha256, st.index)
    write_manifest(Manifest("tar", ["c"], [entry]), str(tmp_path))
    ds = ShardDataset(str(tmp_path), decode="raw", order=Order(shuffle=False))
    assert len(ds) == 7
    with pytest.raises(ShardFormatError, match=r"shard-000000\.tar.*more samples than"):
        list(ds)
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc["num_samples"] == 7
