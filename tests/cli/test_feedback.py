"""What a user is told: missing paths, wrong kinds of path, missing buckets, progress off a
terminal, one-sample shards, PIL batches; and that pack reads each file through one open."""

from __future__ import annotations

import os
import warnings

import pytest
from conftest import image_tree, run_cli
from remote_servers import free_env

from shardkit import FolderDataset, ShardDataset, pack
from shardkit.errors import InputError, OutputError, StorageError
from shardkit.remote.storage import RemoteStorage
from shardkit.write.writer import ShardSizeWarning


@pytest.fixture()
def packed(tmp_path, packed_tree):
    return packed_tree(12, 3, ["tar"], shard_size=4000)


# --- missing paths and wrong kinds of path -------------------------------------------------------


def test_shard_dataset_missing_path_says_so(tmp_path):
    with pytest.raises(InputError, match="out/lfx: no such file or directory") as err:
        ShardDataset(str(tmp_path / "out" / "lfx"))
    assert "shard format" not in str(err.value)


@pytest.mark.slow  # the CLI in a child process
def test_info_missing_directory(tmp_path):
    proc = run_cli("info", tmp_path / "nope")
    assert proc.returncode != 0
    assert proc.stderr.startswith("error: ")
    assert "nope: no such file or directory" in proc.stderr
    assert "manifest" not in proc.stderr


@pytest.mark.slow  # the CLI in a child process
def test_info_and_verify_on_a_shard_name_the_directory(packed):
    shard = os.path.join(packed["tar"], "shard-000000.tar")
    for cmd in ("info", "verify"):
        proc = run_cli(cmd, shard)
        assert proc.returncode != 0
        assert "is a shard, not a dataset" in proc.stderr
        assert f"({packed['tar']}/)" in proc.stderr
        assert "JSON" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # the CLI in a child process
def test_python_callers_are_told_the_parameter_not_the_flag(tmp_path, packed):
    with pytest.raises(OutputError) as err:
        pack(packed["src"], packed["tar"], progress=False)
    assert "overwrite=True" in str(err.value)
    assert "--overwrite" not in str(err.value)
    proc = run_cli("pack", packed["src"], packed["tar"])
    assert "--overwrite" in proc.stderr and "overwrite=True" not in proc.stderr


@pytest.mark.slow
def test_missing_bucket_found_before_any_work(tmp_path, s3):
    src = image_tree(tmp_path / "src", 6)
    env = {**free_env(), "AWS_ENDPOINT_URL": s3.endpoint}
    url = "s3://no-such-bucket/lfw/"
    for args in (("pack", src, url, "--shard-size", "1KB"), ("info", url), ("verify", url)):
        proc = run_cli(*args, env=env)
        assert proc.returncode != 0, args
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith("error: s3://no-such-bucket/: no such bucket"), proc.stderr
        assert "shardkit-pack-" not in proc.stderr and "/tmp" not in proc.stderr
    assert not [e for e in s3.log.entries if e[0] == "PUT"]  # nothing was uploaded
    with pytest.raises(StorageError, match="no such bucket"):
        ShardDataset(url, storage=RemoteStorage(storage_options=s3.options(s3.endpoint)))


# --- progress ------------------------------------------------------------------------------------


@pytest.mark.slow  # the CLI in a child process
def test_progress_off_a_terminal_prints_plain_lines(tmp_path):
    src = image_tree(tmp_path / "src", 40)
    env = {**os.environ, "SHARDKIT_PROGRESS_INTERVAL": "0"}
    proc = run_cli("pack", src, tmp_path / "out", "--shard-size", "2KB", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("pack: ")]
    assert lines and "\r" not in proc.stderr
    assert lines[-1].startswith("pack: 40/40 img (100%)")
    proc = run_cli("verify", tmp_path / "out", env=env)
    assert any(x.startswith("verify: ") and " shard" in x for x in proc.stderr.splitlines())
    quiet = run_cli("verify", tmp_path / "out", "-q", env=env)
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.slow  # the CLI in a child process
def test_progress_off_a_terminal_is_silent_for_short_steps(tmp_path):
    src = image_tree(tmp_path / "src", 10)
    proc = run_cli(
        "pack", src, tmp_path / "out", env={**os.environ, "SHARDKIT_PROGRESS_INTERVAL": "3600"}
    )
    assert proc.returncode == 0
    assert proc.stderr == ""


@pytest.mark.slow
def test_synth_shows_progress_and_takes_quiet(tmp_path):
    env = {**os.environ, "SHARDKIT_PROGRESS_INTERVAL": "0"}
    proc = run_cli("synth", "lfw", tmp_path / "a", "--scale", "0.01", "--threads", "1", env=env)
    assert proc.returncode == 0, proc.stderr
    assert any(x.startswith("synth ") and " img" in x for x in proc.stderr.splitlines())
    proc = run_cli("synth", "lfw", tmp_path / "b", "--scale", "0.01", "-q", env=env)
    assert proc.returncode == 0 and proc.stderr == ""


# --- shard size, PIL batches ---------------------------------------------------------------------


@pytest.mark.slow  # the CLI in a child process
def test_one_sample_shards_warn_once(tmp_path):
    src = image_tree(tmp_path / "src", 8, size=(64, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pack(str(src), str(tmp_path / "tiny"), shard_size=600, progress=False)
    sized = [w for w in caught if issubclass(w.category, ShardSizeWarning)]
    assert len(sized) == 1 and "one sample per shard" in str(sized[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pack(str(src), str(tmp_path / "fine"), shard_size="1MB", progress=False)
    assert not [w for w in caught if issubclass(w.category, ShardSizeWarning)]
    proc = run_cli("pack", src, tmp_path / "cli", "--shard-size", "600", "-q")
    warned = [x for x in proc.stderr.splitlines() if x.startswith("warning: ")]
    assert len(warned) == 1 and "one sample per shard" in warned[0]


def test_pil_batches_get_a_hint(packed):
    from torch.utils.data import DataLoader

    for ds in (ShardDataset(packed["tar"]), FolderDataset(packed["src"])):
        with pytest.raises(InputError, match='decode="tensor"'):
            next(iter(DataLoader(ds, batch_size=4)))
    images, labels = next(
        iter(DataLoader(ShardDataset(packed["tar"], decode="tensor"), batch_size=4))
    )
    assert images.shape[0] == 4


# --- one open per file ---------------------------------------------------------------------------


def test_pack_opens_each_file_once(tmp_path, monkeypatch):
    src = image_tree(tmp_path / "src", 100)
    root = os.path.abspath(src)
    opened: dict[str, int] = {}
    real_open = os.open

    def counting_open(path, *args, **kw):
        p = os.fspath(path)
        if p.startswith(root) and p.endswith(".jpg"):
            opened[p] = opened.get(p, 0) + 1
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", counting_open)
    # One reader thread: with two, a thread can read a file before the other's hint for it
    # opens it (a documented, harmless race that opens that file twice).
    report = pack(str(src), str(tmp_path / "out"), workers=1, progress=False)
    monkeypatch.undo()
    assert report.samples == 100
    assert len(opened) == 100 and set(opened.values()) == {1}
    still_open = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            still_open.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert not [p for p in still_open if p.startswith(root)]  # no hinted descriptor left open


def test_verify_in_parallel_reports_every_bad_shard_in_order(packed_tree):
    from shardkit.write.verify import verify

    paths = packed_tree(30, 3, ["tar"], shard_size=3000)
    shards = sorted(n for n in os.listdir(paths["tar"]) if n.endswith(".tar"))
    assert len(shards) >= 4
    with open(os.path.join(paths["tar"], shards[1]), "r+b") as f:  # flip a byte
        f.seek(600)
        b = f.read(1)[0]
        f.seek(600)
        f.write(bytes([b ^ 1]))
    with open(os.path.join(paths["tar"], shards[3]), "r+b") as f:  # cut the end off
        f.truncate(700)
    report = verify(paths["tar"], threads=3)
    assert [b.path for b in report.bad] == [shards[1], shards[3]]
    assert "sha256 differs from the manifest" in report.bad[0].problems
    assert any(p.startswith("size 700 bytes") for p in report.bad[1].problems)
    assert verify(paths["tar"], threads=1).bad == report.bad


def test_strtable_concat_matches_one_table():
    from shardkit.scan import StrTable

    parts = [["a/b.jpg", "é/x"], [], ["zz"]]
    joined = StrTable.concat([StrTable(p) for p in parts])
    assert joined == StrTable([s for p in parts for s in p])
    assert list(joined) == ["a/b.jpg", "é/x", "zz"]
    assert len(StrTable.concat([])) == 0


@pytest.mark.slow  # the CLI in a child process
def test_scan_shows_progress_off_a_terminal(tmp_path):
    src = image_tree(tmp_path / "src", 9, classes=3)
    env = {**os.environ, "SHARDKIT_PROGRESS_INTERVAL": "0"}
    proc = run_cli("pack", src, tmp_path / "out", env=env)
    scans = [x for x in proc.stderr.splitlines() if x.startswith("scan ")]
    assert scans and scans[-1].startswith(f"scan {src}: 3/3 class (100%)")
    quiet = run_cli("pack", src, tmp_path / "out2", "-q", env=env)
    assert quiet.returncode == 0 and quiet.stderr == ""
