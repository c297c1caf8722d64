"""shardkit bench on folders as real users have them: mixed sizes, PNG, CMYK, a zero-byte file.

Real files, real shards, real DataLoader and ShardLoader worker processes; the bench is asked
for a few short runs (no timing is asserted). The folder and the shards must read the same
samples, every mode must run, and refusals must come before anything is packed.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from shardkit import CenterCrop, Decode, FolderDataset
from shardkit.bench import BenchConfig, run_bench
from shardkit.cli import main
from shardkit.synth import make_imagenet
from shardkit.write.packer import pack

SIZES = [(64, 48), (48, 64), (80, 60), (50, 50)]


@pytest.fixture(scope="module")
def messy(tmp_path_factory):
    """3 classes of JPEGs in four sizes, plus a PNG, a CMYK JPEG and a zero-byte .jpg."""
    src = tmp_path_factory.mktemp("messy") / "src"
    rng = np.random.default_rng(0)
    for c in range(3):
        (src / f"class{c}").mkdir(parents=True)
        for i in range(20):
            w, h = SIZES[i % len(SIZES)]
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(src / f"class{c}" / f"img{i:02d}.jpg", quality=85)
    pixels = rng.integers(0, 256, size=(40, 70, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(src / "class0" / "photo.png")
    Image.fromarray(pixels).convert("CMYK").save(src / "class1" / "cmyk.jpg", quality=85)
    (src / "class2" / "empty.jpg").write_bytes(b"")
    return src


def _config(src, tmp, **kw) -> BenchConfig:
    base = dict(
        data=str(src),
        shards=str(tmp / "shards-{format}"),
        workers=(0, 2),
        batch_size=8,
        batches=2,
        repeats=1,
        cold=False,
        ceiling_seconds=0.02,
    )
    base.update(kw)
    return BenchConfig(**base)


def test_folder_and_pack_agree_on_what_a_sample_is(messy, tmp_path):
    """The zero-byte file is no sample on either side; the PNG and the CMYK JPEG are."""
    report = pack(str(messy), str(tmp_path / "out"), progress=False)
    folder = FolderDataset(str(messy), decode=Decode("tensor", crop=CenterCrop(32, 32)))
    assert report.samples == len(folder) == 3 * 20 + 2
    assert [s.path for s in report.skipped] == ["class2/empty.jpg"]
    relpaths = {folder.relpath(i) for i in range(len(folder))}
    assert "class2/empty.jpg" not in relpaths
    assert {"class0/photo.png", "class1/cmyk.jpg"} <= relpaths
    sizes = {tuple(folder[i][0].shape) for i in range(len(folder))}
    assert sizes == {(3, 32, 32)}


@pytest.mark.parametrize("mode", ["raw", "decode", "augment"])
def test_every_mode_runs_on_mixed_sizes_and_counts_what_was_read(messy, tmp_path, mode):
    formats = ("folder", "tar", "lmdb") + (("loader",) if mode == "decode" else ())
    out = tmp_path / "b.json"
    cfg = _config(messy, tmp_path, mode=mode, formats=formats, json_path=str(out))
    result = run_bench(cfg)
    assert result.num_samples == dict.fromkeys(formats, 62)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["format"], r["workers"]) for r in rows} == {(f, w) for f in formats for w in (0, 2)}
    assert all(r["timed_samples_runs"] == [2 * 8] for r in rows)
    sized = [n for n in result.notes if "centre-cropped to 224x224" in n]
    assert len(sized) == (mode == "decode")


def test_size_zero_on_mixed_sizes_is_refused_before_packing(messy, tmp_path):
    res = CliRunner().invoke(
        main,
        ["bench", "--data", str(messy), "--shards", str(tmp_path / "s-{format}"), "--size", "0"],
    )
    assert res.exit_code != 0
    assert res.output.startswith("error: ") and len(res.output.splitlines()) == 1
    assert "images differ in size" in res.output and "pass --size N" in res.output
    assert not os.path.exists(tmp_path / "s-tar")


def test_too_few_samples_is_refused_naming_flags_before_the_estimate_and_packing(messy, tmp_path):
    res = CliRunner().invoke(
        main, ["bench", "--data", str(messy), "--shards", str(tmp_path / "s-{format}")]
    )
    assert res.exit_code != 0
    assert res.output.splitlines() == [res.output.strip()]  # no estimate line before it
    assert "lower --batch-size or --workers" in res.output
    assert "batch_size" not in res.output
    assert not os.path.exists(tmp_path / "s-tar")


def test_a_timeline_of_a_format_not_benched_is_refused_before_packing(messy, tmp_path):
    res = CliRunner().invoke(
        main,
        ["bench", "--data", str(messy), "--shards", str(tmp_path / "s-{format}")]
        + ["--formats", "folder,tar", "--workers", "0", "--batch-size", "8"]
        + ["--timeline-config", "lmdb:0"],
    )
    assert res.exit_code != 0 and "lmdb is not among the benchmarked formats" in res.output
    assert not os.path.exists(tmp_path / "s-tar")


def test_loader_with_another_mode_is_refused_before_packing(messy, tmp_path):
    res = CliRunner().invoke(
        main,
        ["bench", "--data", str(messy), "--shards", str(tmp_path / "s-{format}")]
        + ["--formats", "tar,loader", "--mode", "raw"],
    )
    assert res.exit_code != 0 and "use --mode decode" in res.output
    assert not os.path.exists(tmp_path / "s-tar")


def test_synth_imagenet_benches_with_the_default_size_through_the_cli(tmp_path):
    data = tmp_path / "inet"
    make_imagenet(str(data), classes=2, images_per_class=24)
    plot = tmp_path / "b.png"
    res = CliRunner().invoke(
        main,
        ["bench", "--data", str(data), "--workers", "0,2", "--batch-size", "8", "--batches", "1"]
        + ["--repeats", "1", "--warm", "--formats", "folder,tar,lmdb,loader", "-q"]
        + ["--plot", str(plot)],
    )
    assert res.exit_code == 0, res.output
    assert "note: decode: every image resized and centre-cropped to 224x224" in res.output
    with Image.open(plot) as img:
        assert img.format == "PNG"


def test_a_folder_smaller_than_min_samples_benches_with_runs_ending_at_the_data(messy, tmp_path):
    """62 samples, far below --min-samples: each run times what the epoch holds, and says so."""
    result = run_bench(_config(messy, tmp_path, mode="raw", batches=None, formats=("folder",)))
    runs = [run for row in result.rows for run in row.runs]
    assert {run.stopped for run in runs} == {"data"}
    assert all(run.timed_samples > 0 for run in runs)


def test_the_ceiling_and_main_process_runs_use_one_torch_thread_like_a_worker():
    import torch

    from shardkit.bench.runner import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_warnings_during_the_bench_are_plain_warning_lines(messy, tmp_path):
    res = CliRunner().invoke(
        main,
        ["bench", "--data", str(messy), "--shards", str(tmp_path / "s-{format}"), "--warm"]
        + ["--mode", "raw", "--formats", "folder,tar", "--workers", "0", "--batch-size", "8"]
        + ["--batches", "1", "--repeats", "1"],
    )
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "warning: skipped 1 bad or unreadable image(s) of 63;" in "\n".join(lines)
    assert not any("Warning:" in line or ".py:" in line for line in lines)
