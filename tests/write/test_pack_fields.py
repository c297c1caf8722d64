"""Files that share a key with an image (x.jpg + x.txt + x.json + x.seg.png) pack as one sample."""

from __future__ import annotations

import csv
import json
import os
import re
import tarfile

import lmdb
import pytest
from click.testing import CliRunner
from PIL import Image

from shardkit import FolderDataset, PackOptions, ShardDataset, pack, scan
from shardkit.cli import main
from shardkit.errors import InputError, OutputError
from shardkit.manifest import read_manifest
from shardkit.scan import scan_source


def _captioned(root, n=4, stem="x"):
    """root/cls/x{i}.jpg with .txt and .json beside each, a .seg.png beside the even ones."""
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (8, 6), (40 * i, 9, 0)).save(root / c / f"{stem}{i}.jpg")
            (root / c / f"{stem}{i}.txt").write_text(f"a {c} number {i}")
            (root / c / f"{stem}{i}.json").write_text(json.dumps({"i": i, "c": c}))
            if i % 2 == 0:
                Image.new("L", (8, 6), i).save(root / c / f"{stem}{i}.seg.png")
    return root


def test_the_scan_joins_sidecars_to_their_image(tmp_path):
    src = _captioned(tmp_path / "src")
    (src / "dog" / "notes.md").write_text("a caption without its image")
    (src / "cat" / "a.b.jpg").write_bytes((src / "cat" / "x0.jpg").read_bytes())
    scan = scan_source(str(src))
    assert list(scan.keys) == [f"cat/{k}" for k in ("a%2Eb", "x0", "x1", "x2", "x3")] + [
        f"dog/x{i}" for i in range(4)
    ]
    assert scan.fields_of(1) == [("json", "cat/x0.json"), ("seg.png", "cat/x0.seg.png"),
                                 ("txt", "cat/x0.txt")]  # fmt: skip
    assert scan.fields_of(0) == [] and scan.fields_of(2)[1] == ("txt", "cat/x1.txt")
    assert scan.field_counts == {"json": 8, "seg.png": 4, "txt": 8}
    assert scan.not_images == 0
    assert [(e.path, "no image with key 'dog/notes'" in e.reason) for e in scan.errors] == [
        ("dog/notes.md", True)
    ]
    # FolderDataset lists the same samples: the sidecars are no images to it either
    with pytest.warns(UserWarning, match="dog/notes.md"):
        assert len(FolderDataset(str(src))) == 9


def test_a_stray_file_beside_bare_images_is_still_only_ignored(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(src / "a" / "x.jpg")
    (src / "a" / "README.txt").write_text("hi")
    scan = scan_source(str(src))
    assert not scan.errors and scan.not_images == 1 and scan.field_counts == {}


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_pack_writes_the_fields_and_counts_them(tmp_path, fmt):
    src = _captioned(tmp_path / "src")
    report = pack(str(src), str(tmp_path / "out"), format=fmt, shuffle=False)
    assert report.samples == 8 and report.errors == 0 and report.not_images == 0
    m = read_manifest(str(tmp_path / "out"))
    assert m.fields == {"json": 8, "seg.png": 4, "txt": 8}
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["fields"] == m.fields
    shard = str(tmp_path / "out" / m.shards[0].path)
    if fmt == "tar":
        with tarfile.open(shard) as tf:
            members = {n: tf.extractfile(n).read() for n in tf.getnames()}
        assert [n for n in members if n.startswith("cat/x0.")] == [
            "cat/x0.jpg", "cat/x0.cls", "cat/x0.json", "cat/x0.seg.png", "cat/x0.txt"
        ]  # fmt: skip
        assert "cat/x1.seg.png" not in members
        stored = {n: members[n] for n in ("dog/x3.txt", "dog/x2.seg.png", "dog/x2.json")}
    else:
        env = lmdb.open(shard, subdir=False, readonly=True, lock=False)
        with env.begin() as txn:  # dog/x2 is sample 6 in a sorted, unshuffled pack
            stored = {
                "dog/x3.txt": txn.get(b"+0000000007.txt"),
                "dog/x2.seg.png": txn.get(b"+0000000006.seg.png"),
                "dog/x2.json": txn.get(b"+0000000006.json"),
            }
            assert txn.get(b"+0000000007.seg.png") is None
        env.close()
    assert stored == {n: (src / n).read_bytes() for n in stored}


def test_fields_count_in_the_up_to_date_check(tmp_path):
    src = _captioned(tmp_path / "src", n=2)
    out = str(tmp_path / "out")
    pack(str(src), out)
    assert pack(str(src), out).up_to_date
    caption = src / "cat" / "x1.txt"
    caption.write_text("another caption, longer than the first")
    assert not pack(str(src), out, overwrite=True).up_to_date


def test_a_sidecar_without_its_image_is_an_error_naming_file_and_key(tmp_path):
    src = _captioned(tmp_path / "src", n=2)
    (src / "cat" / "lost.txt").write_text("no picture")
    with pytest.raises(InputError, match=r"cat/lost\.txt: no image with key 'cat/lost'"):
        pack(str(src), str(tmp_path / "out"), on_error="raise")
    assert not os.path.exists(tmp_path / "out" / "manifest.json")
    with pytest.warns(UserWarning, match="skipped 1"):
        report = pack(str(src), str(tmp_path / "out2"), on_error="skip")
    assert report.samples == 4 and report.errors == 1
    assert [s.path for s in read_manifest(str(tmp_path / "out2")).skipped] == ["cat/lost.txt"]


def test_unparseable_json_and_odd_field_names_name_the_file_and_key(tmp_path):
    src = _captioned(tmp_path / "src", n=2)
    (src / "dog" / "x1.json").write_text("{not json")
    with pytest.raises(InputError, match=r"dog/x1\.jpg: field file dog/x1\.json: not valid JSON"):
        pack(str(src), str(tmp_path / "out"), on_error="raise", shuffle=False)
    (src / "cat" / "x0.cls").write_text("3")
    with pytest.raises(InputError, match=r"cat/x0\.cls: field of key 'cat/x0': 'cls' cannot be"):
        pack(str(src), str(tmp_path / "out"), on_error="raise", shuffle=False)
    assert not os.path.exists(tmp_path / "out" / "manifest.json")
    with pytest.warns(UserWarning, match="skipped 2"):
        report = pack(str(src), str(tmp_path / "out2"), shuffle=False)
    skipped = {s.path: s.reason for s in read_manifest(str(tmp_path / "out2")).skipped}
    assert "cannot be a field name" in skipped["cat/x0.cls"]
    assert "key 'cat/x0'" in skipped["cat/x0.cls"]
    assert "not valid JSON" in skipped["dog/x1.jpg"]
    assert report.samples == 3


def _table_set(root):
    (root / "img").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 6), (60 * i, 0, 0)).save(root / "img" / f"p{i}.jpg")
    return root


@pytest.mark.parametrize("suffix", ["csv", "tsv", "jsonl"])
def test_a_table_packs_captions_and_columns(tmp_path, suffix):
    root = _table_set(tmp_path / "set")
    rows = [("img/p0.jpg", "a red square", "cat", "x"), ("img/p2.jpg", "bright", "dog", "y")]
    table = root / f"t.{suffix}"
    if suffix == "jsonl":
        table.write_text(
            "".join(
                json.dumps({"image": p, "caption": c, "label": lab, "src": s}) + "\n"
                for p, c, lab, s in rows
            )
        )
    else:
        sep = "," if suffix == "csv" else "\t"
        lines = [sep.join(("image", "caption", "label", "src"))] + [sep.join(r) for r in rows]
        table.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    report = pack(str(table), str(out), shuffle=False)
    assert report.samples == 2 and report.classes == 2
    m = read_manifest(str(out))
    assert m.classes == ["cat", "dog"] and m.fields == {"json": 2, "txt": 2}
    with tarfile.open(str(out / m.shards[0].path)) as tf:
        members = {n: tf.extractfile(n).read() for n in tf.getnames()}
    assert members["img/p2.txt"] == b"bright" and members["img/p2.cls"] == b"1"
    assert json.loads(members["img/p0.json"]) == {"src": "x"}
    assert members["img/p0.jpg"] == (root / "img" / "p0.jpg").read_bytes()
    assert pack(str(table), str(out), shuffle=False).up_to_date
    table.write_text(table.read_text().replace("bright", "dim"))
    assert not pack(str(table), str(out), shuffle=False, overwrite=True).up_to_date


def test_a_table_without_labels_gives_samples_without_a_label(tmp_path):
    root = _table_set(tmp_path / "set")
    (root / "t.csv").write_text("path,text\nimg/p1.jpg,one\nimg/missing.jpg,none\n")
    with pytest.raises(InputError, match=r"img/missing\.jpg: .*t\.csv:3: no such image file"):
        pack(str(root / "t.csv"), str(tmp_path / "o1"), on_error="raise")
    with pytest.warns(UserWarning, match="skipped 1"):
        report = pack(str(root / "t.csv"), str(tmp_path / "out"))
    assert report.samples == 1
    m = read_manifest(str(tmp_path / "out"))
    assert m.classes == [] and m.fields == {"txt": 1}
    with tarfile.open(str(tmp_path / "out" / m.shards[0].path)) as tf:
        assert tf.getnames() == ["img/p1.jpg", "img/p1.txt"]


@pytest.mark.parametrize("where", ["../outside.jpg", "ABS", "img/link.jpg"])
def test_a_row_naming_a_file_outside_the_tables_folder_is_refused(tmp_path, where):
    root = _table_set(tmp_path / "set")
    outside = tmp_path / "outside.jpg"
    Image.new("RGB", (8, 6)).save(outside)
    os.symlink(outside, root / "img" / "link.jpg")
    path = str(outside) if where == "ABS" else where
    (root / "t.csv").write_text(f"image,caption\nimg/p0.jpg,ok\n{path},out\n")
    with pytest.raises(InputError, match=r"t\.csv:3: image path .* leads outside"):
        pack(str(root / "t.csv"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()
    # a root that holds the file allows it; an absolute path is taken relative to the root
    again = {"ABS": str(outside), "../outside.jpg": "outside.jpg"}.get(where, f"set/{where}")
    (root / "t.csv").write_text(f"image,caption\nset/img/p0.jpg,ok\n{again},out\n")
    report = pack(str(root / "t.csv"), str(tmp_path / "out"), root=str(tmp_path))
    assert report.samples == 2
    assert {k for _, _, k in ShardDataset(str(tmp_path / "out"), with_keys=True)} == {
        "set/img/p0", "outside" if where != "img/link.jpg" else "set/img/link"
    }  # fmt: skip


def test_absolute_image_paths_pack_under_root_slash(tmp_path):
    root = _table_set(tmp_path / "set")
    (root / "t.csv").write_text(f"image,caption\n{root / 'img' / 'p1.jpg'},abs\n")
    r = CliRunner().invoke(main, ["pack", str(root / "t.csv"), str(tmp_path / "o"), "--root", "/"])
    assert r.exit_code == 0, r.output
    ds = ShardDataset(str(tmp_path / "o"), decode="raw", with_keys=True, fields=("txt",))
    ((data, label, key, caption),) = list(ds)
    assert key == str(root / "img" / "p1")[1:] and caption == b"abs" and label == -1
    assert data == (root / "img" / "p1.jpg").read_bytes()
    # without --root an absolute path under the table's folder is inside it
    (root / "u.csv").write_text(f"image\n{root / 'img' / 'p2.jpg'}\n")
    assert pack(str(root / "u.csv"), str(tmp_path / "u")).samples == 1


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fmt, size", [("tar", "16kB"), ("lmdb", "80kB")])
def test_planned_tasks_carry_the_fields_and_write_the_same_shards(tmp_path, fmt, size):
    from shardkit.fsutil import DirLock
    from shardkit.write.commit import commit_pack
    from shardkit.write.plan import plan_pack
    from shardkit.write.planfile import load_task, save_tasks
    from shardkit.write.task import run_task

    src = _captioned(tmp_path / "src", n=6)
    ref = str(tmp_path / "ref")
    pack(str(src), ref, format=fmt, shard_size=size, progress=False)
    m = read_manifest(ref)
    limit = 16_000 if fmt == "tar" else 80_000
    assert all(s.bytes <= limit for s in m.shards)  # the plan's roll counts the fields
    if fmt == "tar":
        assert len(m.shards) > 2
    out = str(tmp_path / "out")
    options = PackOptions(shard_size=size, format=fmt, shuffle=True, seed=0, progress=False)
    plan = plan_pack(str(src), out, options)
    os.makedirs(out)
    save_tasks(plan.tasks(2), str(tmp_path / "plan"), "commit")  # through the plan file
    tasks = [load_task(str(tmp_path / "plan"), i)[0] for i in range(len(plan.tasks(2)))]
    receipts = [r for t in tasks for r in run_task(t)]
    with DirLock(out):
        commit_pack(plan, receipts)
    got = read_manifest(out)
    assert [s.sha256 for s in got.shards] == [s.sha256 for s in m.shards]
    assert got.fields == m.fields == {"json": 12, "seg.png": 6, "txt": 12}


def test_append_and_merge_add_up_the_field_counts(tmp_path):
    from shardkit.write.merge import merge

    a = _captioned(tmp_path / "a", n=2)
    b = _captioned(tmp_path / "b", n=3, stem="y")  # other keys: a dataset's keys are unique
    pack(str(a), str(tmp_path / "out"), progress=False)
    pack(str(b), str(tmp_path / "out"), append=True, progress=False)
    assert read_manifest(str(tmp_path / "out")).fields == {"json": 10, "seg.png": 6, "txt": 10}
    pack(str(_captioned(tmp_path / "c", n=3, stem="z")), str(tmp_path / "other"), progress=False)
    merge([str(tmp_path / "out"), str(tmp_path / "other")], str(tmp_path / "merged"))
    assert read_manifest(str(tmp_path / "merged")).fields == {
        "json": 16, "seg.png": 10, "txt": 16
    }  # fmt: skip


def test_an_image_label_table_whose_labels_change_is_packed_again(tmp_path):
    root = _table_set(tmp_path / "set")
    table, out = root / "t.csv", str(tmp_path / "out")
    table.write_text("image,label\nimg/p0.jpg,cat\nimg/p1.jpg,dog\n")
    pack(str(table), out, shuffle=False)
    assert pack(str(table), out, shuffle=False).up_to_date
    table.write_text("image,label\nimg/p0.jpg,dog\nimg/p1.jpg,cat\n")  # the same class names
    with pytest.raises(OutputError, match="pass overwrite=True"):  # not "up to date"
        pack(str(table), out, shuffle=False)
    assert not pack(str(table), out, shuffle=False, overwrite=True).up_to_date
    got = {k: label for _, label, k in ShardDataset(out, decode="raw", with_keys=True)}
    assert got == {"img/p0": 1, "img/p1": 0}


def test_excel_csv_and_long_captions_pack(tmp_path):
    root = _table_set(tmp_path / "set")
    long = "a caption " * 20_000  # 200,000 characters: past the csv module's own limit
    table = root / "t.csv"  # Excel's "CSV UTF-8" starts with a byte-order mark
    table.write_bytes(b"\xef\xbb\xbf" + f'image,caption\nimg/p0.jpg,"{long}"\n'.encode())
    (root / "t.jsonl").write_bytes(b'\xef\xbb\xbf{"image": "img/p1.jpg", "caption": "x"}\n')
    pack(str(table), str(tmp_path / "out"))
    ((_, _, caption),) = list(ShardDataset(str(tmp_path / "out"), fields=("txt",)))
    assert caption == long
    assert pack(str(root / "t.jsonl"), str(tmp_path / "j")).samples == 1


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("t.csv", "image,caption,src\nimg/p0.jpg,a,b\nimg/p1.jpg,a,b,c\n", r"t\.csv:3: 4 cells "
         r"under a header of 3 \('image', 'caption', 'src'\); give every row one cell per column"
         r", in double quotes where it holds the separator ','"),
        ("t.tsv", "image\tcaption\nimg/p0.jpg\n", r"t\.tsv:2: 1 cell under a header of 2"),
        ("t.csv", 'image,caption\nimg/p0.jpg,"' + "x" * (3 << 20) + '"\n', r"t\.csv:2: not a "
         r"readable table row \(field larger than field limit .*2 MiB"),
        ("t.jsonl", '{"image": "img/p0.jpg"}\n{"image": "img/p\\u0000.jpg"}\n', r"t\.jsonl:2: a "
         r"NUL character in the image path in column 'image'; remove or fix it"),
        ("t.jsonl", '{"image": "img/p0.jpg", "label": "a\\u0000"}\n', r"t\.jsonl:1: label 'a\\x00'"
         r" holds a NUL character"),
        ("t.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", r"t\.jsonl:1: not a JSON object"),
    ],
)  # fmt: skip
def test_table_rows_that_cannot_be_packed_are_one_line_naming_file_and_line(
    tmp_path, monkeypatch, name, text, message
):
    monkeypatch.setattr(scan.spans, "MAX_TABLE_CELL", 2 << 20)  # a small test file
    root = _table_set(tmp_path / "set")
    (root / name).write_text(text)
    r = CliRunner().invoke(main, ["pack", str(root / name), str(tmp_path / "o"), "--on-error",
                                  "raise"])  # fmt: skip
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert re.search(message, r.output), r.output
    assert not (tmp_path / "o" / "manifest.json").exists()


def _parquet(path, columns, row_group_size=None):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)


def test_a_parquet_table_packs_to_the_bytes_of_the_same_csv(tmp_path, monkeypatch):
    root = _table_set(tmp_path / "set")
    rows = [("img/p0.jpg", "a red square", "cat", "x"), ("img/p2.jpg", "bright", "dog", "y")]
    rows += [("img/p1.jpg", 'q, "x"', "cat", "z"), ("img/p0.jpg", "again", "dog", "w")]
    with open(root / "t.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("image", "caption", "label", "src"), *rows])
    names = ("image", "caption", "label", "src")
    cols = {name: [r[k] for r in rows] for k, name in enumerate(names)}
    _parquet(root / "t.parquet", cols, row_group_size=1)
    monkeypatch.setattr(scan.spans, "PARQUET_BATCH", 1)  # a batch per row: the rows stream through
    with pytest.warns(UserWarning, match="listed again"):
        from_csv = pack(str(root / "t.csv"), str(tmp_path / "a"), shuffle=False, progress=False)
    with pytest.warns(UserWarning, match="listed again"):
        from_pq = pack(str(root / "t.parquet"), str(tmp_path / "b"), shuffle=False, progress=False)
    assert from_csv.samples == from_pq.samples == 3
    shards = [read_manifest(str(tmp_path / d)).shards for d in "ab"]
    for a, b in zip(*shards, strict=True):
        assert (tmp_path / "a" / a.path).read_bytes() == (tmp_path / "b" / b.path).read_bytes()
    assert pack(str(root / "t.parquet"), str(tmp_path / "b"), shuffle=False).up_to_date


def test_parquet_cells_json_cannot_hold_and_unreadable_files_are_one_line(tmp_path):
    import datetime

    root = _table_set(tmp_path / "set")
    when = [datetime.date(2020, 1, 1)] * 2
    _parquet(root / "dated.parquet", {"image": ["img/p0.jpg", "img/p1.jpg"], "when": when})
    (root / "junk.parquet").write_bytes(b"not parquet at all")
    for name, message in [
        ("dated.parquet", r"dated\.parquet:1: a cell that JSON cannot hold \(.*date"),
        ("junk.parquet", r"junk\.parquet: not a readable Parquet table"),
    ]:
        r = CliRunner().invoke(main, ["pack", str(root / name), str(tmp_path / "o")])
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert re.search(message, r.output), r.output
        assert not (tmp_path / "o" / "manifest.json").exists()


def test_a_parquet_table_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    from shardkit import extras

    root = _table_set(tmp_path / "set")
    (root / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(extras.EXTRAS, "parquet", ("no_such_module_for_this_test",))
    r = CliRunner().invoke(main, ["pack", str(root / "t.parquet"), str(tmp_path / "o")])
    assert r.exit_code != 0 and "pip install 'shardkit[parquet]'" in r.output, r.output


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_an_img2dataset_shard_table_names_its_images_by_key(tmp_path, suffix):
    # img2dataset --output_format files: 00000.parquet beside 00000/<key>.jpg (+ .txt, .json)
    out_dir = tmp_path / "laion"
    (out_dir / "00000").mkdir(parents=True)
    for k in (0, 1):
        Image.new("RGB", (8, 6), (90 * k, 0, 0)).save(out_dir / "00000" / f"00000000{k}.jpg")
        (out_dir / "00000" / f"00000000{k}.txt").write_text(f"caption {k}")
    cols = {
        "url": ["http://a/0.jpg", "http://a/1.jpg", "http://a/2.jpg"],
        "caption": ["caption 0", "caption 1", "caption 2"],
        "key": ["000000000", "000000001", "000000002"],
        "status": ["success", "success", "failed_to_download"],
        "error_message": [None, None, "HTTP 404"],
    }
    table = out_dir / f"00000.{suffix}"
    if suffix == "parquet":
        _parquet(table, cols)
    else:
        table.write_text(
            "".join(
                json.dumps(dict(zip(cols, r, strict=True))) + "\n"
                for r in zip(*cols.values(), strict=True)
            )
        )
    report = pack(str(table), str(tmp_path / "out"), shuffle=False, progress=False)
    assert report.samples == 2 and report.not_images == 0 and report.failed_downloads == 1
    m = read_manifest(str(tmp_path / "out"))
    assert [(s.path, "failed download" in s.reason) for s in m.skipped] == [
        ("00000/000000002", True)
    ]
    with tarfile.open(str(tmp_path / "out" / m.shards[0].path)) as tf:
        members = {n: tf.extractfile(n).read() for n in tf.getnames()}
    # img2dataset's own key, as its tars and `shardkit index` of them have it
    assert members["000000001.txt"] == b"caption 1"
    assert json.loads(members["000000001.json"])["url"] == "http://a/1.jpg"
    assert "000000000.cls" not in members  # no label column: no label


def _golden_fields(root):
    """Two classes of fixed-byte images with captions and JSON beside some, fixed mtimes."""
    for c in ("cat", "dog"):
        (root / c / "sub").mkdir(parents=True)
        for i in range(12):
            d = root / c / ("sub" if i % 3 == 0 else "")
            files = [(f"x{i}.jpg", 40 + 5 * i)]
            files += [(f"x{i}.txt", i)] if i % 2 else []
            files += [(f"x{i}.json", 0)] if i % 5 == 0 else []
            for k, (name, size) in enumerate(files):
                data = b"\xff\xd8" + bytes([i]) * size if name.endswith(".jpg") else b"t" * size
                (d / name).write_bytes(b'{"i": 1}' if name.endswith(".json") else data)
                os.utime(d / name, ns=(10**18, 10**18 + 10 * i + k))
    return root


def test_a_folder_with_fields_plans_to_the_fingerprint_it_always_had(tmp_path):
    # The fingerprint and shard starts of shardkit's plan when it kept each sample's field
    # stats as Python tuples: the stats as arrays hash to the same bytes.
    from shardkit.write.plan import plan_pack

    plan = plan_pack(
        str(_golden_fields(tmp_path / "src")),
        str(tmp_path / "out"),
        PackOptions(shard_size="16kB", seed=1, validate="none", progress=False),
    )
    assert len(plan.scan.sidecars.blob) and len(plan.starts) > 3
    digest = "2e31c232af5c3794d7da0b9b9cc40590457e0d1f9a062ab6064fc7f202f69b91"
    assert plan.fingerprint == f"sha256:{digest}"
    assert plan.starts.tolist() == [0, 4, 9, 14, 18, 22, 24]
