"""The first hour's messages: what skipped files were, sizes people can read, flags named once."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner
from PIL import Image

from shardkit.cli import main
from shardkit.sizes import size_text


def _tree(root):
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (16, 16), (c * 90, i * 40, 0)).save(root / f"c{c}" / f"{i}.jpg")
    (root / "c0" / "empty.jpg").write_bytes(b"")
    (root / "c1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")
    (root / "c1" / "notes.txt").write_text("not an image")


def test_info_lists_the_skipped_files_and_their_reasons_and_prints_small_sizes_readably(tmp_path):
    _tree(tmp_path / "src")
    runner = CliRunner()
    assert (
        runner.invoke(main, ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "-q"]).exit_code
        == 0
    )
    plain = runner.invoke(main, ["info", str(tmp_path / "out")])
    assert "skipped:  3 (--skipped lists them)" in plain.output
    assert "0.0 MB" not in plain.output and " kB)" in plain.output
    listed = runner.invoke(main, ["info", str(tmp_path / "out"), "--skipped"])
    assert listed.exit_code == 0
    assert "  c0/empty.jpg: empty file" in listed.output.splitlines()
    assert "  c1/notes.txt: not an image" in listed.output.splitlines()
    assert any(
        line.startswith("  c1/broken.jpg: truncated JPEG") for line in listed.output.splitlines()
    )
    as_json = json.loads(
        runner.invoke(main, ["info", str(tmp_path / "out"), "--json", "--skipped"]).output
    )
    assert {s["path"] for s in as_json["skipped_files"]} == {
        "c0/empty.jpg",
        "c1/broken.jpg",
        "c1/notes.txt",
    }


def test_size_text_never_prints_zero_megabytes():
    assert size_text(199_489_536) == "199.5 MB"
    assert size_text(30_720) == "30.7 kB"
    assert size_text(512) == "512 bytes"


def test_shard_size_zero_says_why(tmp_path):
    res = CliRunner().invoke(
        main, ["pack", str(tmp_path), str(tmp_path / "o"), "--shard-size", "0"]
    )
    assert res.exit_code == 2
    assert "'0' is 0 bytes: a shard needs room for at least one sample" in res.output
    assert "is not a size" not in res.output


def test_index_names_overwrite_once(tmp_path):
    _tree(tmp_path / "src")
    runner = CliRunner()
    runner.invoke(main, ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "-q"])
    foreign = tmp_path / "foreign"  # tars without a pack's manifest: index writes one
    foreign.mkdir()
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".tar"):
            os.link(tmp_path / "out" / name, foreign / name)
    assert runner.invoke(main, ["index", str(foreign), "-q"]).exit_code == 0
    res = runner.invoke(main, ["index", str(foreign), "-q"])
    assert res.exit_code != 0
    assert "already exists and lists every shard given: nothing new to index" in res.output
    assert "added by --append; --overwrite reads every shard again" in res.output
    assert "(--overwrite)" not in res.output and res.output.count("--overwrite") == 1


def test_a_tiny_shard_size_is_one_warning_line_not_one_per_shard(tmp_path):
    """Runs of one-sample shards, broken by pairs of small images: the writer warns per run."""
    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    for i in range(15):
        if i % 5 < 3:  # ~20 kB of noise: a shard of its own
            img = Image.effect_noise((128, 128), 80).convert("RGB")
        else:  # a few hundred bytes: two share a shard
            img = Image.new("RGB", (8, 8), (i, 0, 0))
        img.save(src / f"{i:02d}.jpg", quality=95)
    res = CliRunner().invoke(
        main,
        ["pack", str(src.parent), str(tmp_path / "out"), "--shard-size", "8kB", "--no-shuffle"]
        + ["-q"],
    )
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].endswith("(2 more like it)")


def test_what_a_killed_pack_left_is_mentioned_by_info_verify_and_pack(tmp_path):
    import subprocess

    _tree(tmp_path / "src")
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(main, ["pack", str(tmp_path / "src"), str(out), "-q"]).exit_code == 0
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = out / f".partial-{gone.pid}-0123456789ab"
    left.mkdir()
    (left / "shard-000000.tar").write_bytes(b"half")
    for args in (["info", str(out)], ["verify", str(out), "-q"]):
        res = runner.invoke(main, args)
        assert res.exit_code == 0, res.output
        assert f"note: {left} was left by an interrupted pack" in res.output
    res = runner.invoke(main, ["pack", str(tmp_path / "src"), str(out), "-q", "--overwrite"])
    assert res.exit_code == 0 and f"note: {left} was left" in res.output
    assert not left.exists()
    assert "interrupted" not in runner.invoke(main, ["info", str(out)]).output


def test_batch_size_zero_has_one_wording(tmp_path):
    import pytest

    from shardkit import ShardDataset, ShardLoader
    from shardkit.bench import BenchConfig
    from shardkit.errors import InputError

    _tree(tmp_path / "src")
    CliRunner().invoke(main, ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "-q"])
    wording = "batch_size=0 must be a whole number >= 1"
    with pytest.raises(InputError, match=wording):
        ShardDataset(str(tmp_path / "out"), batch_size=0)
    with pytest.raises(InputError, match=wording):
        ShardLoader(ShardDataset(str(tmp_path / "out"), decode="tensor"), batch_size=0)
    with pytest.raises(InputError, match=wording):
        BenchConfig(batch_size=0).resolved()


def test_packing_again_with_other_options_or_changed_files_says_what_differs(tmp_path):
    import os

    _tree(tmp_path / "src")
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    runner = CliRunner()
    assert runner.invoke(main, ["pack", src, out, "-q"]).exit_code == 0
    res = runner.invoke(main, ["pack", src, out, "-q", "--seed", "3", "--no-shuffle"])
    assert res.exit_code != 0
    assert (
        f"error: {out} holds a pack made with other options: --shuffle -> --no-shuffle, "
        "--seed 0 -> 3; pass --overwrite to replace it" in res.output
    )
    os.utime(tmp_path / "src" / "c0" / "0.jpg", (1, 1))
    res = runner.invoke(main, ["pack", src, out, "-q"])
    assert res.exit_code != 0
    assert "the same options, but the source's files changed since" in res.output
