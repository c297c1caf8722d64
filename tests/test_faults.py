"""Hostile names and faults on the writing side (issue 13, items 1 and 3).

Names are real bytes on disk (``os.fsencode`` paths that are not UTF-8); disk full is a real
small tmpfs where this process may mount one (root), and otherwise, and always for the exact
step under test, an ``ENOSPC`` raised by the os-level ``fsync`` of the file being written.
"""

from __future__ import annotations

import io
import json
import os
import warnings

import numpy as np
import pytest
from PIL import Image

from shardkit import FolderDataset, ShardDataset, ShardWriter, pack
from shardkit.errors import InputError
from shardkit.formats import decode_key, encode_key
from shardkit.manifest import read_manifest
from shardkit.verify import verify


def _jpeg(seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=80)
    return buf.getvalue()


def _quiet_pack(src, out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack(src, out, progress=False, **kw)


# --- item 1: names that are not UTF-8 ----------------------------------------------------------

#: (class folder, file) as raw bytes: Latin-1 e-acute, a stray 0xff, a truncated UTF-8 sequence,
#: and a name that is valid UTF-8 beside one that differs from it only by an invalid byte.
_BYTE_NAMES = [
    (b"caf\xe9", b"menu.jpg"),
    (b"caf\xe9", b"\xff\xfe.jpg"),
    (b"plain", b"ok.jpg"),
    (b"plain", b"trunc\xc3.jpg"),
    (b"plain", "caf\u00e9.jpg".encode()),
    (b"plain", b"caf\xe9.jpg"),
]


@pytest.fixture
def byte_tree(tmp_path):
    root = os.fsencode(tmp_path / "src")
    for i, (cls, name) in enumerate(_BYTE_NAMES):
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        with open(os.path.join(root, cls, name), "wb") as f:
            f.write(_jpeg(i))
    with open(os.path.join(root, b"plain", b"notes\xfe.txt"), "wb") as f:
        f.write(b"not an image")
    os.symlink(b"/nonexistent", os.path.join(root, b"plain", b"gone\xfe.jpg"))
    return root


def test_encode_key_escapes_undecodable_bytes_and_decode_key_restores_them():
    for raw in [b"caf\xe9/x", b"\xff\xfe", b"trunc\xc3", "caf\u00e9".encode(), b"a%E9.b\xe9"]:
        name = os.fsdecode(raw)
        key = encode_key(name)
        key.encode("utf-8")  # always storable text
        assert "." not in key
        assert decode_key(key) == name
        assert os.fsencode(decode_key(key)) == raw
    assert encode_key(os.fsdecode(b"caf\xe9")) == "caf%E9"
    assert encode_key("caf\u00e9") == "caf\u00e9"  # valid UTF-8 stays as it is


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_names_that_are_not_utf8_are_packed_under_escaped_keys(byte_tree, tmp_path, fmt):
    out = str(tmp_path / fmt)
    report = _quiet_pack(os.fsdecode(byte_tree), out, format=fmt)
    assert report.samples == len(_BYTE_NAMES)
    manifest = read_manifest(out)
    assert manifest.classes == ["caf\\xe9", "plain"]  # shown as Python shows the bytes
    skipped = {s.path: s.reason for s in manifest.skipped}
    assert skipped == {
        "plain/gone\\xfe.jpg": "unreadable: broken symbolic link",
        "plain/notes\\xfe.txt": "not an image",
    }
    with open(os.path.join(out, "manifest.json"), "rb") as f:
        json.loads(f.read().decode("utf-8"))  # strict UTF-8 JSON, readable by any tool
    got = {key: label for _, label, key in ShardDataset(out, shuffle=False, with_keys=True)}
    want = {
        encode_key(os.fsdecode(cls + b"/" + os.path.splitext(name)[0])): int(cls == b"plain")
        for cls, name in _BYTE_NAMES
    }
    assert got == want
    for key in got:  # every key leads back to its file on disk
        assert os.path.isfile(os.path.join(byte_tree, os.fsencode(decode_key(key)) + b".jpg"))
    assert verify(out).ok
    folder = FolderDataset(os.fsdecode(byte_tree), with_keys=True)
    assert folder.classes == manifest.classes  # same names, by construction


def test_tar_shard_of_undecodable_names_reads_in_tarfile(byte_tree, tmp_path):
    import tarfile

    out = tmp_path / "tar"
    _quiet_pack(os.fsdecode(byte_tree), str(out))
    with tarfile.open(out / "shard-000000.tar") as tf:
        names = tf.getnames()
    assert "caf%E9/%FF%FE.jpg" in names and "plain/caf\u00e9.jpg" in names
    assert "plain/caf%E9.jpg" in names  # distinct from the UTF-8 name it resembles


def test_writer_refuses_a_key_that_is_not_unicode_text(tmp_path):
    with ShardWriter(str(tmp_path / "o")) as w:
        with pytest.raises(InputError, match="encode_key"):
            w.write(os.fsdecode(b"caf\xe9"), _jpeg(0), 0)
        w.write(encode_key(os.fsdecode(b"caf\xe9")), _jpeg(0), 0)
