"""``shardkit ls`` and ``shardkit show``: listing, printing and writing samples of shards that
may be hostile (keys that climb out of folders, control characters in keys and text)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from click.testing import CliRunner
from conftest import run_cli

from shardkit.cli import main
from shardkit.stream.show import escape, safe_name

HOSTILE = [
    ("../../escape.jpg", b"\xff\xd8up"),
    ("../../escape.cls", b"1"),
    ("/abs/olute.jpg", b"\xff\xd8abs"),
    ("dir/..%2F..%2Fx.jpg", b"\xff\xd8pct"),
    ("red\x1b[31mkey.jpg", b"\xff\xd8esc"),
    ("red\x1b[31mkey.txt", "caption \x1b]0;pwned\x07 \u202eevil".encode()),
    ("..hidden.jpg", b"\xff\xd8dot"),
]


@pytest.fixture()
def hostile(tmp_path):
    """A foreign tar (no manifest) whose member names try to climb out and to drive the
    terminal, written member by member with exactly these names."""
    out = tmp_path / "hostile"
    out.mkdir()
    with tarfile.open(out / "shard-000000.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in HOSTILE:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_ls_lists_keys_labels_members_escaped(hostile):
    res = _cli("ls", hostile)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) == 4  # "..hidden.jpg" has an empty key: not a sample
    (said,) = res.stderr.splitlines()  # foreign tars, no digests: read unchecked, said once
    assert said.startswith("warning: ") and "no per-sample digests" in said
    assert "\x1b" not in res.output and "\u202e" not in res.output
    assert lines[0] == "0  ../../escape  label 1  jpg 4 B, cls 1 B"
    assert lines[2] == "2  dir/  label -1  .%2f..%2fx.jpg 5 B"  # the key ends at the first dot
    assert lines[3].startswith("3  red\\x1b[31mkey  label -1  jpg 5 B, txt ")
    assert _cli("ls", hostile, "--head", "2").stdout.count("\n") == 2


def test_show_prints_fields_with_control_characters_escaped(hostile):
    res = _cli("show", hostile, "red\x1b[31mkey")
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.output and "\x07" not in res.output and "\u202e" not in res.output
    assert "key:    red\\x1b[31mkey" in res.output
    assert "txt: caption \\x1b]0;pwned\\x07 \\u202eevil" in res.output


@pytest.mark.parametrize("key", ["../../escape", "/abs/olute", "dir/"])
def test_show_writes_only_inside_the_folder_it_is_given(hostile, tmp_path, key):
    box = tmp_path / "box" / "inner"
    res = _cli("show", hostile, key, "--to", box)
    assert res.exit_code == 0, res.output
    inside = sorted(p.name for p in box.iterdir())
    assert inside and all(not n.startswith(".") and "/" not in n for n in inside)
    outside = {p for p in tmp_path.rglob("*") if p.is_file()} - set(box.iterdir())
    assert {p.name for p in outside} == {"shard-000000.tar"}  # nothing landed anywhere else
    assert not (tmp_path / "escape.jpg").exists() and not (tmp_path.parent / "escape.jpg").exists()


def test_show_refuses_to_replace_a_file(hostile, tmp_path):
    box = tmp_path / "box"
    assert _cli("show", hostile, "../../escape", "--to", box).exit_code == 0
    res = _cli("show", hostile, "../../escape", "--to", box)
    assert res.exit_code != 0 and "exists" in res.output


def test_safe_name_and_escape():
    assert safe_name("../../x", "jpg") == "_.._x.jpg"
    assert safe_name("/etc/passwd", "") == "_etc_passwd.bin"
    assert safe_name("...", "../x") == "sample._x"
    assert escape("a\x1b[0mb\n") == "a\\x1b[0mb\\n"
    assert escape("caf\udce9") == "caf\\xe9"  # an undecodable byte, as surrogateescape keeps it
    assert escape("plain ü") == "plain ü"


@pytest.mark.slow  # the CLI in a child process
def test_unknown_key_and_bad_path_are_one_line_errors(hostile, tmp_path):
    proc = run_cli("show", hostile, "nope")
    assert proc.returncode != 0
    assert (
        proc.stderr.startswith("error: no sample with key 'nope'") and proc.stderr.count("\n") == 1
    )
    proc = run_cli("ls", tmp_path / "missing")
    assert proc.returncode != 0 and proc.stderr.startswith("error: ")


def test_show_to_with_a_very_long_key_or_a_folder_it_cannot_make(tmp_path):
    long_a, long_b = "k" * 5000, "k" * 4999 + "j"
    out = tmp_path / "long"
    out.mkdir()
    with tarfile.open(out / "shard-000000.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in [(f"{long_a}.jpg", b"\xff\xd8a"), (f"{long_a}.txt", b"a"),
                           (f"{long_b}.jpg", b"\xff\xd8b")]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    box = tmp_path / "box"
    for key in (long_a, long_b):
        res = _cli("show", out, key, "--to", box)
        assert res.exit_code == 0, res.output
    names = sorted(p.name for p in box.iterdir())
    assert len(names) == 3 and all(len(n) <= 200 for n in names)
    stem = {n.rsplit(".", 1)[0] for n in names if n.startswith(safe_name(long_a, "jpg")[:-4])}
    assert len(stem) == 1  # one sample's members share a name, the other key has its own
    assert {(box / n).read_bytes() for n in names} == {b"\xff\xd8a", b"a", b"\xff\xd8b"}
    (tmp_path / "file").write_text("x")
    for folder in (tmp_path / "file" / "sub", tmp_path / "file"):
        res = _cli("show", out, long_a, "--to", folder)
        assert res.exit_code != 0 and res.output.count("\n") == 1, res.output
        assert res.output.startswith("error: ") and str(folder) in res.output


def test_ls_show_and_show_to_give_an_lmdb_dataset_its_fields_as_tar(tmp_path):
    """A folder with captions and JSON beside its images, packed as tar and as LMDB: ``ls``,
    ``show`` and ``show --to`` say and write the same members for both."""
    from conftest import image_tree

    src = image_tree(tmp_path / "src", 4, classes=2)
    for i in range(4):
        stem = src / f"class{i % 2}" / f"img{i:03d}"
        stem.with_suffix(".txt").write_text(f"caption {i}")
        stem.with_suffix(".json").write_text(f'{{"i": {i}}}')
    out: dict[str, tuple[str, str, list]] = {}
    for fmt in ("tar", "lmdb"):
        ds = tmp_path / fmt
        assert _cli("pack", src, ds, "--format", fmt).exit_code == 0
        box = tmp_path / f"box-{fmt}"
        listing, shown = _cli("ls", ds).output, _cli("show", ds, "class1/img001").output
        assert _cli("show", ds, "class1/img001", "--to", box).exit_code == 0
        files = sorted((p.name, p.read_bytes()) for p in box.iterdir())
        out[fmt] = (listing, shown.replace(f"{fmt}/shard-000000.{fmt}", "SHARD"), files)
    assert "txt 9 B" in out["lmdb"][0] and "json 8 B" in out["lmdb"][0]
    assert 'json:\n  {\n    "i": 1\n  }\n' in out["lmdb"][1] and "txt: caption 1" in out["lmdb"][1]
    assert ("class1_img001.txt", b"caption 1") in out["lmdb"][2]
    assert out["lmdb"] == out["tar"]


def _fielded(tmp_path, n: int = 6):
    from shardkit.write.writer import ShardWriter

    out = tmp_path / "fielded"
    with ShardWriter(str(out), shard_size="12kB", classes=["a", "b"]) as w:
        for i in range(n):
            meta = {"caption": f"line one\nline {i}", "n": i, "nested": {"x": [1, 2]}}
            w.add(f"{'ab'[i % 2]}/k{i}", "jpg", b"\xff\xd8" + bytes(500), i % 2, {"json": meta})
    return out


def test_ls_offset_limit_prefix_and_json(tmp_path):
    out = _fielded(tmp_path)
    every = _cli("ls", out).output.splitlines()
    assert len(every) == 6 and every[0].startswith("0  a/k0  label 0 (a)  jpg 502 B, cls 1 B")
    assert _cli("ls", out, "--offset", "2", "--limit", "3").output.splitlines() == every[2:5]
    assert _cli("ls", out, "--prefix", "b/").output.splitlines() == every[1::2]
    assert _cli("ls", out, "--prefix", "b/", "--limit", "1").output.splitlines() == every[1:2]
    docs = [json.loads(line) for line in _cli("ls", out, "--json").output.splitlines()]
    assert {k: v for k, v in docs[3].items() if k != "members"} == {
        "index": 3,
        "key": "b/k3",
        "label": 1,
        "class": "b",
    }
    assert [m[0] for m in docs[3]["members"]] == ["jpg", "cls", "json"]
    assert docs[3]["members"][:2] == [["jpg", 502], ["cls", 1]]


def test_show_takes_a_position_and_pretty_prints_json(tmp_path):
    out = _fielded(tmp_path)
    by_key = _cli("show", out, "b/k3").output
    assert _cli("show", out, "#3").output == by_key == _cli("show", out, "--index", "3").output
    assert "index:  3" in by_key and '    "caption": "line one\\nline 3",' in by_key
    assert '  "nested": {' in by_key and "\\n" not in by_key.replace("\\nline", "")
    res = _cli("show", out, "#6")
    assert res.exit_code != 0 and "no sample at position 6" in res.output and "(0..5)" in res.output
    res = _cli("show", out)
    assert res.exit_code != 0 and "--index N" in res.output


def test_a_key_that_looks_like_a_position_is_shown_with_key(tmp_path):
    from shardkit.write.writer import ShardWriter

    out = tmp_path / "hashed"
    with ShardWriter(str(out), shard_size="1MB") as w:
        for i, key in enumerate(["a", "b", "c", "d", "#1"]):
            w.add(key, "jpg", b"\xff\xd8" + bytes([i]) * 10, i)
    literal = _cli("show", out, "--key", "#1")
    assert literal.exit_code == 0, literal.output
    key, index = literal.output.splitlines()[:2]
    assert key == "key:    " + "#1" and index == "index:  4"
    assert "key:    b" in _cli("show", out, "#1").output  # #N is the position, as documented
    assert "key:    a" in _cli("show", out, "--key", "a").output
    res = _cli("show", out, "b", "--key", "#1")
    assert res.exit_code != 0 and "give one of KEY, --key KEY or --index N" in res.output
    res = _cli("show", out, "--key", "#9")
    assert res.exit_code != 0 and "'#9'" in res.output  # named, not read as position 9


def test_info_shows_field_counts(tmp_path):
    out = _fielded(tmp_path)
    assert "fields:   json 6 (samples carrying each)" in _cli("info", out).output
    assert json.loads(_cli("info", out, "--json").output)["fields"] == {"json": 6}


def test_ls_and_show_give_the_same_with_and_without_the_index(tmp_path):
    import os

    out = _fielded(tmp_path, 12)
    bare = tmp_path / "bare"
    bare.mkdir()
    for n in os.listdir(out):
        if not n.endswith(".idx"):
            os.link(out / n, bare / n)
    assert any(n.endswith(".idx") for n in os.listdir(out))
    said = ""
    for args in (("ls",), ("ls", "--json", "--offset", "5"), ("show", "#7"), ("show", "a/k4")):
        a, b = _cli(args[0], out, *args[1:]), _cli(args[0], bare, *args[1:])
        assert a.exit_code == b.exit_code == 0
        assert a.stdout.replace(str(out), "OUT") == b.stdout.replace(str(bare), "OUT")
        assert not a.stderr
        said += b.stderr
    assert said.count("no per-sample digests") == 1  # unchecked: said, once in this process


def test_ls_lists_members_and_sizes_from_the_index_and_headers(tmp_path):
    import os
    import shutil

    from conftest import as_previous_release

    from shardkit.formats.sample_index import decode_index, index_path

    out = _fielded(tmp_path, 12)
    want = _cli("ls", out, "--json").output
    text = _cli("ls", out).output
    old = tmp_path / "old"  # the previous release's indexes (no members): the shards are read
    shutil.copytree(out, old)
    as_previous_release(old)
    assert _cli("ls", old, "--json").stdout == want and _cli("ls", old).stdout == text
    for n in os.listdir(out):  # every member's data but the labels' zeroed: ls checks each
        if n.endswith(".tar"):  # sample it lists against its digest, and names the damage
            shard = str(out / n)
            members = decode_index(open(index_path(shard), "rb").read(), shard).members
            with open(shard, "r+b") as f:
                for ext, at, size in (m for j in range(len(members.labels)) for m in members.of(j)):
                    if ext != "cls":
                        os.pwrite(f.fileno(), bytes(size), at)
    for args in (("--json",), ()):
        got = _cli("ls", out, *args).output
        assert "shard-000000.tar: sample 0 (key 'a/k0') is not the bytes packed" in got
    docs = [json.loads(line) for line in want.splitlines()]
    assert docs[5]["members"] == [["jpg", 502], ["cls", 1], ["json", 64]]
