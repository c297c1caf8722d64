"""The one rule of what a sample is, shared by pack and FolderDataset (shardkit/scan/)."""

from __future__ import annotations

import os

import pytest
from conftest import ReversedSpans, assert_same_scan
from PIL import Image

from shardkit import FolderDataset
from shardkit.errors import InputError
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


# --- the walk's own stat: the plan and the "up to date" check take it, no second stat per file --


def _stat_tree(src):
    """Subfolders listed before a file that sorts after them (the class is reordered), links,
    an outside link, and files of distinct sizes and mtimes (a misaligned row shows)."""
    outside = src.parent / "store"
    outside.mkdir()
    (outside / "far.jpg").write_bytes(b"\xff\xd8\xff" + b"f" * 700)
    for k, rel in enumerate(["a/b.jpg", "a/a/x.jpg", "a/a/z/y.jpg", "a/c.jpeg", "b/q.jpg"]):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(b"\xff\xd8\xff" + bytes([k]) * (100 + 37 * k))
        os.utime(src / rel, ns=(10**18, 10**18 + 1000 * k))
    os.symlink(src / "a" / "b.jpg", src / "b" / "again.jpg")  # a link to a sample: dropped
    os.symlink(outside / "far.jpg", src / "b" / "far.jpg")
    return src


def test_the_walk_records_each_files_size_and_mtime_in_sample_order(tmp_path):
    from shardkit.write.read import file_stats

    src = _stat_tree(tmp_path / "src")
    scan = scan_source(str(src))
    assert list(scan.files) == ["a/a/x.jpg", "a/a/z/y.jpg", "a/b.jpg", "a/c.jpeg", "b/far.jpg",
                                "b/q.jpg"]  # fmt: skip
    assert scan.stats.tolist() == file_stats(str(src), scan.files).tolist()


def test_the_same_pack_again_stats_no_image_a_second_time(tmp_path, monkeypatch):
    """The "up to date" check costs the walk (its one stat per file), not a second os.stat of
    every image on top."""
    src = _stat_tree(tmp_path / "src")
    out = tmp_path / "out"
    first = pack(str(src), str(out), progress=False, validate="none")
    seen: list[str] = []
    real = os.stat

    def counting(path, *args, **kw):
        seen.append(os.fspath(path))
        return real(path, *args, **kw)

    monkeypatch.setattr(os, "stat", counting)
    again = pack(str(src), str(out), progress=False, validate="none")
    assert again.up_to_date and again.samples == first.samples == 6
    assert not [p for p in seen if p.endswith((".jpg", ".jpeg"))], seen


def test_a_tables_scan_records_each_rows_image_stat_in_row_order(tmp_path):
    from shardkit.write.read import file_stats

    src = _stat_tree(tmp_path / "src")
    rows = ["a/c.jpeg", "b/again.jpg", "a/a/x.jpg", "missing.jpg", "a/b.jpg"]  # a link, too
    (src / "t.csv").write_text("image\n" + "\n".join(rows) + "\n")
    scan = scan_source(str(src / "t.csv"))
    assert list(scan.files) == ["a/c.jpeg", "b/again.jpg", "a/a/x.jpg", "a/b.jpg"]
    assert scan.stats.tolist() == file_stats(str(src), scan.files).tolist()


# --- a table scanned in spans, as an engine's workers scan it: the scan of one process ---------


def _rich_rows(src):
    """Rows with every case a span boundary could split: labels first seen late (their numbers
    are remapped), a row naming an image again, missing files, a non-image, a NUL path, long
    and multi-line captions, non-ASCII."""
    (src / "img").mkdir(parents=True)
    names = [f"p{k}.jpg" for k in range(9)] + ["ü.png"]
    for k, name in enumerate(names):
        _img(src / "img" / name, 20 * k)
    rows = []
    for k in range(23):
        rel = f"img/{names[k % len(names)]}"
        if k == 4:
            rel = "img/missing.jpg"
        if k == 9:
            rel = "img/notes.txt"
        caption = 'line one\nline two, "quoted"' if k % 5 == 2 else f"caption {k} ü" * (k % 3)
        rows.append({"image": rel, "caption": caption, "label": f"z{(23 - k) // 4}", "k": k})
    rows.insert(13, {"image": "img/a\0b.jpg", "caption": "", "label": "z0", "k": 99})
    return rows


def _write_table(path, rows, kind):
    import csv
    import json

    if kind == "jsonl":  # with blank lines between
        path.write_text("".join(json.dumps(r) + ("\n\n" if i % 4 == 1 else "\n")
                                for i, r in enumerate(rows)))  # fmt: skip
    elif kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        cols = {c: [r[c] for r in rows] for c in rows[0]}
        pq.write_table(pa.table(cols), str(path), row_group_size=3)
    else:  # Excel's CSV: a byte-order mark, \r\n line ends, quoted cells across lines
        with open(path, "w", newline="", encoding="utf-8-sig") as f:
            w = csv.writer(f, delimiter="\t" if kind == "tsv" else ",", lineterminator="\r\n")
            w.writerow(list(rows[0]))
            for i, r in enumerate(rows):
                w.writerow(list(r.values()))
                if i == 6:
                    f.write("\r\n")  # a blank line
    return path


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "parquet"])
@pytest.mark.parametrize("per", [1, 2, 5, 1000])
def test_a_table_scanned_in_spans_on_an_engine_is_the_scan_of_one_process(tmp_path, kind, per):
    src = tmp_path / "src"
    table = _write_table(src / f"t.{kind}", _rich_rows(src), kind)
    alone = scan_source(str(table))
    engine = ReversedSpans(per)
    spanned = scan_source(str(table), engine=engine)
    rows = 24
    groups = -(-rows // 3)  # a Parquet table is cut at its row groups (3 rows each)
    want = -(-groups // -(-per // 3)) if kind == "parquet" else -(-rows // per)
    assert engine.spans == want and len(alone.files) == 21
    assert_same_scan(spanned, alone)
    assert alone.classes == [f"z{k}" for k in range(6)] and alone.labels[0] == 5
    assert [e.reason.split(": ")[-1] for e in alone.errors] == [
        "no such image file", "not an image file name",
        "a NUL character in the image path in column 'image'",
    ]  # fmt: skip


_BAD_ROWS = {  # line: (row, what the scan says of it), in table order
    4: ("../outside.jpg,c", "t.csv:4: image path '../outside.jpg' leads outside"),
    6: ("img/p1.jpg,c,extra", "t.csv:6: 3 cells under a header of 2"),
    8: (b"img/p2.jpg,caf\xe9", "t.csv:8: not UTF-8 text (invalid continuation byte)"),
}


@pytest.mark.parametrize("per", [1, 2, 3, 4, 100])
def test_of_several_bad_rows_the_first_in_table_order_wins_whichever_span_meets_it(tmp_path, per):
    """The rows of a span are refused in order, the spans' errors are taken in table order:
    the first bad row of the table wins on any engine and span size, and here (a byte that is
    not UTF-8 is an error of its own line, not of the block of text read with it)."""
    src = tmp_path / "src"
    (src / "img").mkdir(parents=True)
    for k in range(3):
        _img(src / "img" / f"p{k}.jpg", k)
    bad = dict(_BAD_ROWS)
    while bad:
        lines = [b"image,caption"]
        for line in range(2, 10):
            row = bad.get(line, (f"img/p{line % 3}.jpg,ok {line}",))[0]
            lines.append(row if isinstance(row, bytes) else row.encode())
        (src / "t.csv").write_bytes(b"\n".join(lines) + b"\n")
        first = bad[min(bad)][1]
        with pytest.raises(InputError) as alone:
            scan_source(str(src / "t.csv"))
        with pytest.raises(InputError) as spanned:
            scan_source(str(src / "t.csv"), engine=ReversedSpans(per))
        assert str(alone.value) == str(spanned.value)
        assert str(alone.value).replace(f"{src}{os.sep}", "").startswith(first), str(alone.value)
        del bad[min(bad)]


@pytest.mark.parametrize("per", [1, 2, 3, 100])
def test_of_several_bad_json_lines_the_first_wins_whichever_span_meets_it(tmp_path, per):
    src = tmp_path / "src"
    (src / "img").mkdir(parents=True)
    _img(src / "img" / "p.jpg", 0)
    ok = '{"image": "img/p.jpg"}'
    bad = {3: "{not json", 5: '{"image": "img/p.jpg", "label": "a\\u0000"}', 7: b'"caf\xe9"'}
    while bad:
        lines = [bad.get(n, ok if n % 4 else "") for n in range(1, 10)]
        (src / "t.jsonl").write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode()
                                                for x in lines) + b"\n")  # fmt: skip
        with pytest.raises(InputError) as alone:
            scan_source(str(src / "t.jsonl"))
        with pytest.raises(InputError) as spanned:
            scan_source(str(src / "t.jsonl"), engine=ReversedSpans(per))
        assert str(alone.value) == str(spanned.value)
        assert str(alone.value).startswith(f"{src / 't.jsonl'}:{min(bad)}: "), str(alone.value)
        del bad[min(bad)]
