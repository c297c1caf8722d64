"""The one rule of what a sample is, shared by pack and FolderDataset (shardkit/scan/)."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from shardkit import FolderDataset
from shardkit.scan import scan_source
from shardkit.write.packer import pack


def _img(path, shade):
    Image.new("RGB", (8, 8), (shade, 0, 0)).save(path)


def test_a_link_to_a_file_already_there_is_reported_not_a_second_sample(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    _img(src / "a" / "x.jpg", 10)
    _img(src / "b" / "y.jpg", 20)
    os.symlink(src / "a" / "x.jpg", src / "b" / "x-again.jpg")
    os.link(src / "b" / "y.jpg", src / "b" / "y-hard.jpg")  # a hard link is a file of its own
    scan = scan_source(str(src))
    assert list(scan.files) == ["a/x.jpg", "b/y-hard.jpg", "b/y.jpg"]
    assert scan.labels.tolist() == [0, 1, 1]
    assert [(s.path, s.reason) for s in scan.ignored] == [
        ("b/x-again.jpg", "symbolic link to a/x.jpg, a sample")
    ]
    report = pack(str(src), str(tmp_path / "out"), progress=False)
    assert report.samples == len(FolderDataset(str(src))) == 3
    assert "b/x-again.jpg" in {s.path for s in report.skipped}


def test_links_that_all_lead_outside_keep_one_sample_per_file(tmp_path):
    outside = tmp_path / "store"
    outside.mkdir()
    _img(outside / "z.jpg", 30)
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    os.symlink(outside / "z.jpg", src / "a" / "1.jpg")
    os.symlink(outside / "z.jpg", src / "a" / "2.jpg")
    scan = scan_source(str(src))
    assert list(scan.files) == ["a/1.jpg"]
    assert [s.path for s in scan.ignored] == ["a/2.jpg"]


def test_an_image_outside_any_class_folder_is_called_a_stray_image(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    _img(src / "a" / "x.jpg", 10)
    _img(src / "lost.jpg", 20)
    (src / "README").write_text("notes")
    reasons = {s.path: s.reason for s in scan_source(str(src)).ignored}
    assert reasons == {
        "lost.jpg": "stray image, not in a class folder (SRC/<class>/<image>)",
        "README": "not in a class folder",
    }


# --- a table's keys and repeated rows from hashes: the rules of the per-row lists, exactly -------

_NAMES = [
    "a.jpg", "a.png", "a~2.jpg", "b.jpg", "b~2.jpg", "b.jpg", "a.jpg", "x/y.jpg", "x/y.JPG",
    "x/y.jpeg", "p%2Eq.jpg", "p.q.jpg", "c.jpg", "b~2.jpg", "ü.jpg", "ü.png", "d.jpg",
]  # fmt: skip


def _tables(names):
    from shardkit.scan import StrTable

    exts = [n.rsplit(".", 1)[1].lower() for n in names]
    return StrTable(names), StrTable(exts), exts


@pytest.mark.parametrize("coarse", [False, True])
def test_table_keys_and_repeats_equal_the_rules_on_lists(monkeypatch, coarse):
    from shardkit.scan import keys as scan_mod

    if coarse:  # every string meets others: each decision falls to the exact comparison
        monkeypatch.setattr(scan_mod, "_hash", lambda s: hash(s) % 3)
    files, ext_table, exts = _tables(_NAMES)
    assert list(scan_mod._table_keys(files, ext_table)) == scan_mod._assign_keys(_NAMES, exts)
    seen, expected = set(), []
    for name in _NAMES:
        expected.append(name in seen)
        seen.add(name)
    assert scan_mod.repeats(files).tolist() == expected
