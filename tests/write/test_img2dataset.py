"""img2dataset's output as it lies on disk: per shard ``00000.tar`` (``000000407.jpg`` + ``.txt``
+ ``.json`` members), ``00000.parquet`` (one row per URL: key, url, caption, status ...) and
``00000_stats.json``. Both routes into shardkit (``index`` of the tars, ``pack`` of the tables)
must give each sample one key, so that a split by key hash is the same either way."""

from __future__ import annotations

import io
import json
import re
import tarfile

import pytest
from click.testing import CliRunner
from conftest import ReversedSpans, assert_same_scan
from PIL import Image

from shardkit import Order, ShardDataset, Source, pack
from shardkit.cli import main
from shardkit.errors import InputError, OutputError
from shardkit.manifest import read_manifest
from shardkit.scan import scan_source

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8 + i % 5, 6), (i * 7 % 256, 40, 90)).save(buf, "JPEG")
    return buf.getvalue()


def _img2dataset(out_dir, shards=2, per_shard=40, failed_every=7):
    """img2dataset --output_format webdataset: keys are the shard number (5 digits) then the
    row in the shard (4 digits), unique across shards; a failed download has a table row (status
    ``failed_to_download``) and no tar members. Returns the keys of the images, in order."""
    out_dir.mkdir(parents=True)
    keys = []
    for s in range(shards):
        cols = {k: [] for k in ("url", "caption", "key", "status", "error_message", "width")}
        with tarfile.open(out_dir / f"{s:05d}.tar", "w") as tf:
            for r in range(per_shard):
                key, ok = f"{s:05d}{r:04d}", r % failed_every != 3
                caption = f"a photo number {s}-{r}"
                meta = {"url": f"http://img.example/{key}.jpg", "caption": caption, "key": key}
                cols["url"].append(meta["url"])
                cols["caption"].append(caption)
                cols["key"].append(key)
                cols["status"].append("success" if ok else "failed_to_download")
                cols["error_message"].append(None if ok else "HTTP Error 404")
                cols["width"].append(8 + r % 5 if ok else None)
                if not ok:
                    continue
                keys.append(key)
                meta.update(status="success", error_message=None, width=8 + r % 5)
                for ext, data in (
                    ("jpg", _jpeg(r)),
                    ("txt", caption.encode()),
                    ("json", json.dumps(meta).encode()),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        pq.write_table(pa.table(cols), str(out_dir / f"{s:05d}.parquet"))
        stats = {"count": per_shard, "successes": len(keys), "failed_to_download": 0}
        (out_dir / f"{s:05d}_stats.json").write_text(json.dumps(stats))
    return keys


def _keys(src, **source):
    """The sorted keys ``src`` gives, through ``Source(src, **source)`` if given."""
    src = Source(str(src), **source) if source else str(src)
    ds = ShardDataset(src, decode="raw", with_keys=True, order=Order(shuffle=False))
    return sorted(k for _, _, k in ds)


def _as_files(i2d, out_dir):
    """The same downloads as ``img2dataset --output_format files`` writes them: 00000.parquet
    beside a folder 00000/ of 000000407.jpg/.txt/.json."""
    out_dir.mkdir()
    for tar in sorted(i2d.glob("*.tar")):
        with tarfile.open(tar) as tf:
            tf.extractall(out_dir / tar.stem, filter="data")
        for name in (f"{tar.stem}.parquet", f"{tar.stem}_stats.json"):
            (out_dir / name).write_bytes((i2d / name).read_bytes())


def test_index_of_the_tars_and_pack_of_the_tables_give_one_key_and_one_split(tmp_path):
    i2d = tmp_path / "i2d"
    keys = _img2dataset(i2d)
    r = CliRunner().invoke(main, ["index", "-q", str(i2d)])  # the tars as they are
    assert r.exit_code == 0, r.output
    files = tmp_path / "files"
    _as_files(i2d, files)
    packed = tmp_path / "packed"
    pack(str(files / "00000.parquet"), str(packed), shuffle=False, progress=False)
    pack(str(files / "00001.parquet"), str(packed), progress=False, append=True)
    assert _keys(i2d) == _keys(packed) == sorted(keys)  # img2dataset's own keys, both routes
    for kw in ({"split": "val", "val_fraction": 0.3}, {"split": "train", "val_fraction": 0.3}):
        assert _keys(i2d, **kw) == _keys(packed, **kw)
    # the folder of files and tables in one pack: the same keys again
    pack(str(files), str(tmp_path / "whole"), progress=False)
    assert _keys(tmp_path / "whole") == sorted(keys)


def test_pack_of_an_img2dataset_folder_reads_every_shard_from_its_tar(tmp_path):
    i2d = tmp_path / "i2d"
    keys = _img2dataset(i2d)
    packed = tmp_path / "packed"
    report = pack(str(i2d), str(packed), shuffle=False, progress=False)  # one command, all shards
    assert report.samples == len(keys) and report.failed_downloads == 12
    assert report.not_images == 0 and "12 failed download(s)" in report.summary()
    r = CliRunner().invoke(main, ["index", "-q", str(i2d)])  # the tars as they are
    assert r.exit_code == 0, r.output
    assert _keys(i2d) == _keys(packed) == sorted(keys)  # img2dataset's own keys, both routes
    for kw in ({"split": "val", "val_fraction": 0.3}, {"split": "train", "val_fraction": 0.3}):
        assert _keys(i2d, **kw) == _keys(packed, **kw)
    # one table at a time, appended: the same keys again
    one = tmp_path / "one"
    pack(str(i2d / "00000.parquet"), str(one), shuffle=False, progress=False)
    pack(str(i2d / "00001.parquet"), str(one), shuffle=False, progress=False, append=True)
    assert _keys(one) == sorted(keys)
    # the images are the tars' bytes; the caption and the other columns come from the table
    ds = ShardDataset(str(packed), decode="raw", with_keys=True, fields=["txt", "json"])
    with tarfile.open(i2d / "00001.tar") as tf:
        for image, _, key, txt, meta in ds:
            if key == "000010005":
                assert image == tf.extractfile("000010005.jpg").read()
                assert txt == b"a photo number 1-5"
                assert json.loads(meta)["url"] == "http://img.example/000010005.jpg"


def test_the_failed_downloads_are_listed_as_such_and_info_says_unlabelled(tmp_path):
    i2d = tmp_path / "i2d"
    _img2dataset(i2d, shards=1, per_shard=11)
    r = CliRunner().invoke(main, ["pack", "-q", str(i2d), str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    m = read_manifest(str(tmp_path / "out"))
    assert m.pack["failed_downloads"] == 2 and m.pack["non_image_files"] == {}
    assert [s.reason.split(": ", 1)[1] for s in m.skipped] == [
        "failed download (img2dataset status 'failed_to_download'), no image"
    ] * 2
    info = CliRunner().invoke(main, ["info", str(tmp_path / "out")])
    assert info.exit_code == 0, info.output
    assert "classes:  none (unlabelled; captioned: field txt)" in info.output, info.output


def test_a_table_beside_its_tar_reads_the_images_from_it(tmp_path):
    i2d = tmp_path / "i2d"
    keys = _img2dataset(i2d, shards=1, per_shard=12)
    r = CliRunner().invoke(main, ["pack", "-q", str(i2d / "00000.parquet"), str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert _keys(tmp_path / "o") == sorted(keys)
    # packing again finds it up to date; a changed tar is a changed source
    again = pack(str(i2d / "00000.parquet"), str(tmp_path / "o"), progress=False)
    assert again.up_to_date
    with tarfile.open(i2d / "00000.tar", "a") as tf:
        info = tarfile.TarInfo("x.txt")
        tf.addfile(info, io.BytesIO(b""))
    with pytest.raises(OutputError, match="overwrite"):
        pack(str(i2d / "00000.parquet"), str(tmp_path / "o"), progress=False)


def test_a_table_whose_images_are_nowhere_names_where_they_were_looked_for(tmp_path):
    i2d = tmp_path / "i2d"
    _img2dataset(i2d, shards=1, per_shard=5)
    (i2d / "00000.tar").rename(tmp_path / "elsewhere.tar")
    r = CliRunner().invoke(
        main, ["pack", "--on-error", "raise", str(i2d / "00000.parquet"), str(tmp_path / "o")]
    )
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "no image 000000000.jpg in 00000/ or 00000.tar beside the table" in r.output
    assert "shardkit index" in r.output


def test_a_folder_of_tars_alone_points_at_index(tmp_path):
    i2d = tmp_path / "i2d"
    _img2dataset(i2d, shards=1, per_shard=5)
    (i2d / "00000.parquet").unlink()
    r = CliRunner().invoke(main, ["pack", str(i2d), str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f"`shardkit index {i2d}`" in r.output
    r = CliRunner().invoke(main, ["pack", str(i2d / "00000.tar"), str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "is a tar shard" in r.output and "`shardkit index`" in r.output


@pytest.mark.parametrize(
    "suffix, cell, what",
    [("parquet", 5, "int"), ("parquet", b"\xff\xd8\xff", "bytes"), ("jsonl", 5, "int")],
)
def test_an_image_cell_that_is_not_text_is_one_line(tmp_path, suffix, cell, what):
    table = tmp_path / f"t.{suffix}"
    if suffix == "parquet":
        pq.write_table(pa.table({"image": [cell, cell], "caption": ["a", "b"]}), str(table))
    else:
        table.write_text(json.dumps({"image": cell, "caption": "a"}) + "\n")
    r = CliRunner().invoke(main, ["pack", str(table), str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert re.search(rf"t\.{suffix}:1: column 'image' holds {what} \(", r.output), r.output
    assert "make it the text path of each image file" in r.output
    with pytest.raises(InputError):
        pack(str(table), str(tmp_path / "o2"), progress=False)


def test_a_tar_rewritten_after_the_scan_gives_an_error_not_another_members_bytes(tmp_path):
    from shardkit.scan import scan_source
    from shardkit.write.read import read_file, stat_pair

    i2d = tmp_path / "i2d"
    _img2dataset(i2d, shards=1, per_shard=6)
    scan = scan_source(str(i2d))
    first = str(i2d / scan.files[0])
    with tarfile.open(i2d / "00000.tar") as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf if m.isreg()]
    assert read_file(first)[0] == members[0][1]
    assert stat_pair(first)[0] == len(members[0][1])
    with tarfile.open(i2d / "00000.tar", "w") as tf:  # the same members, another order
        for m, data in reversed(members):
            tf.addfile(m, io.BytesIO(data))
    with pytest.raises(OSError, match="changed since the scan"):
        read_file(first)


def test_folder_dataset_of_an_img2dataset_folder_points_at_pack_and_index(tmp_path):
    from shardkit import FolderDataset

    i2d = tmp_path / "i2d"
    _img2dataset(i2d, shards=1, per_shard=4)
    with pytest.raises(InputError, match="img2dataset's output.*shardkit pack.*shardkit index"):
        FolderDataset(str(i2d))


def test_a_key_met_again_follows_the_tables_repeated_image_rule(tmp_path):
    # two img2dataset downloads in one folder: both start at key 000000000
    i2d = tmp_path / "i2d"
    _img2dataset(i2d, shards=1, per_shard=4)
    for ext in ("tar", "parquet"):
        (i2d / f"00001.{ext}").write_bytes((i2d / f"00000.{ext}").read_bytes())
    once = pack(str(i2d), str(tmp_path / "once"), progress=False)
    assert once.samples == 3 and once.duplicates == 3
    assert sum("more than one row" in s.reason for s in once.skipped) == 3
    both = pack(str(i2d), str(tmp_path / "both"), progress=False, allow_duplicates=True)
    assert both.samples == 6
    assert _keys(tmp_path / "both") == sorted(
        [f"00000000{r}" for r in (0, 1, 2)] + [f"00000000{r}~2" for r in (0, 1, 2)]
    )


def test_a_caption_cell_of_bytes_and_a_tar_linked_from_outside_are_one_line(tmp_path):
    table = tmp_path / "t.parquet"
    Image.new("RGB", (4, 4)).save(tmp_path / "a.jpg")
    pq.write_table(pa.table({"image": ["a.jpg"], "caption": [b"\x00\x01"]}), str(table))
    r = CliRunner().invoke(main, ["pack", str(table), str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "t.parquet:1: column 'caption' holds a cell that JSON cannot hold" in r.output
    # a member path through a tar that links outside the table's folder is refused
    _img2dataset(tmp_path / "far", shards=1, per_shard=2)
    inside = tmp_path / "in"
    inside.mkdir()
    (inside / "x.tar").symlink_to(tmp_path / "far" / "00000.tar")
    (inside / "t.csv").write_text("image\nx.tar@512+100/000000000.jpg\n")
    r = CliRunner().invoke(main, ["pack", str(inside / "t.csv"), str(tmp_path / "o2")])
    assert r.exit_code == 2 and "leads outside" in r.output, r.output


def test_a_class_tree_beside_a_table_of_its_name_is_still_a_class_tree(tmp_path):
    # cats/ and cats.parquet in SRC, no tar, no _stats.json: not img2dataset's output
    src = tmp_path / "src"
    for c in ("cats", "dogs"):
        (src / c).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(src / c / "x.jpg")
    pq.write_table(pa.table({"image": ["cats/x.jpg"]}), str(src / "cats.parquet"))
    report = pack(str(src), str(tmp_path / "o"), progress=False)
    assert report.samples == 2 and report.classes == 2


def test_info_of_a_caption_table_says_unlabelled_not_zero_classes(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "a.jpg")
    (tmp_path / "t.csv").write_text("image,caption\na.jpg,a black square\n")
    pack(str(tmp_path / "t.csv"), str(tmp_path / "o"), progress=False)
    r = CliRunner().invoke(main, ["info", str(tmp_path / "o")])
    assert r.exit_code == 0 and "classes:  none (unlabelled; captioned: field txt)" in r.output
    assert "classes:  0 ()" not in r.output


def test_an_img2dataset_folder_scanned_in_spans_is_the_scan_of_one_process(tmp_path):
    i2d = tmp_path / "i2d"
    _img2dataset(i2d, shards=3, per_shard=10)
    (i2d / "00003.tar").write_bytes((i2d / "00000.tar").read_bytes())  # keys met again
    (i2d / "00003.parquet").write_bytes((i2d / "00000.parquet").read_bytes())
    alone = scan_source(str(i2d))
    engine = ReversedSpans(4)
    spanned = scan_source(str(i2d), engine=engine)
    assert engine.spans == 4 and spanned.keyed and spanned.failed_downloads == 4
    assert_same_scan(spanned, alone)
