"""shardkit bench on a tiny real dataset: real files, real shards, real DataLoader workers.

No wall-clock thresholds: these tests check that every configuration is measured and reported,
that cold runs really evict (page residency read back with mincore), that latency is charged per
open as documented (opens counted), and that bad arguments fail with one clear line.
"""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch.utils.data import DataLoader

from shardkit.bench import (
    Augment,
    BenchConfig,
    CountingStorage,
    format_table,
    parse_formats,
    parse_workers,
    run_bench,
    verdict,
)
from shardkit.bench.results import BenchResult, Row, RunResult
from shardkit.bench.sources import make_dataset
from shardkit.bench.workloads import Collate, TimedMap, stack_images
from shardkit.cli import main
from shardkit.errors import InputError
from shardkit.packer import pack
from shardkit.pagecache import evict, resident_fraction
from shardkit.world import World

CLASSES, PER_CLASS = 4, 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A class-per-folder tree of 120 small JPEGs, packed as tar and LMDB (several shards)."""
    root = tmp_path_factory.mktemp("bench")
    src = root / "src"
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        (src / f"class{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(src / f"class{c}" / f"img{i:03d}.jpg", quality=85)
    for fmt in ("tar", "lmdb"):
        pack(str(src), str(root / f"shards-{fmt}"), format=fmt, shard_size="150kB", progress=False)
    os.sync()  # written pages must be clean before DONTNEED can drop them
    return root


def _config(tiny, **kw) -> BenchConfig:
    base = dict(
        data=str(tiny / "src"),
        shards=str(tiny / "shards-{format}"),
        workers=(0, 2),
        batch_size=8,
        batches=3,
        repeats=1,
        cold=False,
        mode="raw",
        ceiling_seconds=0.05,
    )
    base.update(kw)
    return BenchConfig(**base)


def test_tiny_bench_writes_every_row_json_plot_and_timeline(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = _config(
        tiny,
        mode="decode",
        formats=("folder", "tar", "lmdb", "memory"),
        repeats=2,
        step_ms=1.0,
        json_path=str(out / "bench.json"),
        plot_path=str(out / "bench.png"),
        timeline_path=str(out / "timeline.png"),
    )
    result = run_bench(cfg)

    data = json.loads((out / "bench.json").read_text())
    got = {(r["format"], r["workers"]) for r in data["rows"]}
    assert got == {(f, w) for f in ("folder", "tar", "lmdb", "memory") for w in (0, 2)}
    for row in data["rows"]:
        assert len(row["runs"]) == 2  # the repeat count is honoured
        assert row["mean_samples_per_s"] == pytest.approx(np.mean(row["runs"]))
        assert row["std_samples_per_s"] == pytest.approx(np.std(row["runs"], ddof=1))
        assert row["mean_samples_per_s"] > 0 and row["mb_per_s"] > 0
        assert row["first_batch_s"] > 0 and 0 < row["wait_fraction"] <= 1
        assert 0 < row["ceiling_fraction"]
        assert row["timed_samples_runs"] == [3 * 8, 3 * 8]
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"] == torch.__version__
    assert data["machine"]["python"] and data["machine"]["ram_bytes"] > 0
    assert data["config"]["mode"] == "decode" and data["config"]["repeats"] == 2
    assert data["decode_ceiling_single_process"] > 0
    assert data["verdict"] and any("vs folder" in line for line in data["verdict"])
    assert any(line.startswith("memory reference") for line in data["verdict"])
    memory = [r for r in data["rows"] if r["format"] == "memory"]
    assert all(r["opens_runs"] == [None, None] for r in memory)  # no storage behind it

    for name in ("bench.png", "timeline.png"):
        with Image.open(out / name) as img:
            assert img.format == "PNG" and img.size[0] > 300
            img.verify()

    # The timeline is the first shard format at the most workers, stamped in both workers on the
    # same clock as the main loop: a batch is collated before the loop receives it.
    tl = result.timeline
    assert (tl.format, tl.workers, tl.repeat) == ("tar", 2, 0)
    assert {b[0] for b in tl.batches} == {0, 1}
    assert len(tl.batches) == len(tl.waits) == len(tl.steps) == 2 + 3
    for _worker, start, end, received in tl.batches:
        assert 0 <= start <= end <= received
    assert "tar" in format_table(result) and "± " in format_table(result)


def test_cold_run_evicts_the_files_it_reads_before_every_run(tiny):
    probe = tiny / "probe.bin"
    probe.write_bytes(os.urandom(1 << 20))
    os.sync()
    with open(probe, "rb") as f:
        f.read()
    evict(str(probe))
    if resident_fraction(str(probe)) > 0.5:
        pytest.skip("this filesystem keeps pages despite POSIX_FADV_DONTNEED (tmpfs?)")

    seen = []

    def before_run(ctx):
        # Right after the cache step, right before the DataLoader starts.
        seen.append((ctx.format, ctx.workers, [resident_fraction(p) for p in ctx.paths]))

    for path in (tiny / "src", tiny / "shards-tar", tiny / "shards-lmdb"):
        for f in path.rglob("*"):
            if f.is_file():
                f.read_bytes()  # every file starts fully cached
    assert resident_fraction(str(tiny / "src")) > 0.9
    result = run_bench(_config(tiny, cold=True, repeats=2, before_run=before_run))

    assert len(seen) == 3 * 2 * 2
    for fmt, workers, fractions in seen:
        assert fractions and all(f == 0.0 for f in fractions), (fmt, workers, fractions)
    for row in result.rows:
        assert [r.resident_before for r in row.runs] == [0.0, 0.0]
    # The runs read the files back in, so each eviction above had pages to drop.
    assert resident_fraction(str(tiny / "src")) > 0


def _count(batch: list) -> int:
    return len(batch)


def _drain(ds, workers: int) -> None:
    loader = DataLoader(ds, batch_size=8, num_workers=workers, collate_fn=_count)
    assert sum(loader) == len(ds)


@pytest.mark.parametrize("fmt", ["folder", "tar", "lmdb"])
def test_latency_is_charged_once_per_image_for_folder_and_per_slice_for_shards(tiny, fmt):
    path = str(tiny / "src") if fmt == "folder" else str(tiny / f"shards-{fmt}")
    cfg = _config(tiny, mode="raw", latency_ms=1.0)
    cfg = cfg.resolved()
    storage = CountingStorage(latency_ms=1.0)
    ds = make_dataset(fmt, path, cfg, storage)
    assert ds.storage is storage and storage.latency_ms == 1.0
    _drain(ds, workers=2)  # real worker processes: the counter lives in shared memory
    if fmt == "folder":
        assert storage.opens() == CLASSES * PER_CLASS  # one charge per image read
    else:
        slices = [ds.plan(World(0, 1, w, 2)) for w in range(2)]
        assert storage.opens() == sum(len(s) for s in slices)  # one charge per shard slice
        assert len(ds.urls) > 1 and storage.opens() <= len(ds.urls) + 1


def test_bench_reports_opens_per_run_with_the_latency_it_was_given(tiny):
    latencies = []
    cfg = _config(
        tiny,
        latency_ms=0.5,
        formats=("folder", "tar"),
        workers=(0,),
        before_run=lambda ctx: latencies.append(ctx.dataset.storage.latency_ms),
    )
    result = run_bench(cfg)
    assert latencies == [0.5, 0.5]
    folder, tar = result.row("folder", 0).runs[0], result.row("tar", 0).runs[0]
    # num_workers=0 reads exactly the consumed batches: 4 batches of 8 images, one open each.
    assert folder.opens == 4 * 8
    assert 1 <= tar.opens <= len(make_dataset("tar", result.sources["tar"], cfg, None).urls)
    assert any("opens/sample" in line for line in verdict(result))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--formats", "folder,zip"], "Invalid value for '--formats': unknown format 'zip'"),
        (["--workers", "0,,2"], "Invalid value for '--workers': '0,,2' is malformed"),
        (["--workers", "two"], "is malformed"),
        (["--workers", "0,-1"], "out of range"),
        (["--timeline-config", "tar"], "Invalid value for '--timeline-config'"),
        (["--shard-size", "12XB"], "Invalid value for '--shard-size': '12XB' is not a size"),
        (["--data", "/nonexistent/shardkit-bench"], "no such directory"),
        (["--shards", "/nonexistent/s", "--formats", "tar,lmdb"], "put {format} in it"),
        (["--shards", "/nonexistent/s", "--formats", "folder,tar"], "needs the image folder"),
        (["--shards", "/nonexistent/s", "--formats", "tar"], "no packed dataset there"),
        (["--mode", "fast"], "Invalid value for '--mode'"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_clear_line(args, message):
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code != 0
    assert message in res.output
    assert "Traceback" not in res.output
    assert len(res.output.splitlines()) == 1 and res.output.startswith("error: ")


def test_folder_without_images_is_a_clear_error(tmp_path):
    (tmp_path / "empty_class").mkdir()
    res = CliRunner().invoke(main, ["bench", "--data", str(tmp_path), "--formats", "folder"])
    assert res.exit_code != 0 and "no images" in res.output


def test_too_few_samples_for_the_runs_is_a_clear_error(tiny):
    with pytest.raises(InputError, match="lower batches or batch_size"):
        run_bench(_config(tiny, batch_size=64, formats=("folder",)))


def test_parsers():
    assert parse_workers("0, 2,4,2") == (0, 2, 4)
    assert parse_formats("TAR,folder") == ("tar", "folder")
    for bad in ("", "1,", "a"):
        with pytest.raises(InputError):
            parse_workers(bad)
    with pytest.raises(InputError):
        parse_formats("folder,,tar")


def test_augment_is_picklable_and_makes_224_uint8_chw():
    aug = pickle.loads(pickle.dumps(Augment()))
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (250, 250, 3), np.uint8))
    torch.manual_seed(3)
    out = aug(img)
    assert out.shape == (3, 224, 224) and out.dtype == torch.uint8
    assert not torch.equal(out, aug(img))  # random per call


def _row(fmt, workers, rates, wait, stall=None):
    runs = [
        RunResult(
            repeat=i,
            samples_per_s=r,
            mb_per_s=None,
            first_batch_s=0.1,
            wait_fraction=wait,
            stall_fraction=wait if stall is None else stall,
            timed_batches=10,
            timed_samples=640,
            timed_s=640 / r,
            opens=None,
            resident_before=None,
        )
        for i, r in enumerate(rates)
    ]
    return Row(fmt, workers, runs)


def test_verdict_says_input_bound_and_what_to_change():
    cfg = BenchConfig(workers=(0, 4), step_ms=20.0, mode="raw", batch_size=64)
    cfg = cfg.resolved()
    rows = [
        _row("folder", 0, [900, 1000], 0.6),
        _row("folder", 4, [2000, 2100], 0.3),
        _row("tar", 0, [9000, 9100], 0.02),
        _row("tar", 4, [9500, 9400], 0.01),
    ]
    result = BenchResult(cfg, rows, {}, {}, 2, None, None, {}, 1.0)
    text = "\n".join(verdict(result))
    assert "folder: best at 4 workers" in text
    assert "tar vs folder, each at its best: 4.6x" in text
    assert "folder: INPUT-BOUND" in text and "switch to shards (tar" in text
    assert "more workers" in text  # folder still rose at the largest count tried
    assert "tar: not input-bound" in text and "0 workers already keep the wait under 10%" in text


def test_verdict_separates_waiting_on_transfer_from_waiting_on_loading():
    cfg = BenchConfig(workers=(2,), step_ms=20.0, mode="decode", batch_size=64)
    cfg = cfg.resolved()
    rows = [_row("tar", 2, [2000, 2000], 0.3, stall=0.02)]
    text = "\n".join(verdict(BenchResult(cfg, rows, {}, {}, 2, None, None, {}, 1.0)))
    assert "tar: INPUT-BOUND by transfer, not loading" in text and "more workers do not" in text


def test_stack_images_keeps_values_and_shapes():
    hwc = [torch.randint(0, 255, (5, 7, 3), dtype=torch.uint8) for _ in range(4)]
    views = [t.permute(2, 0, 1) for t in hwc]  # what decode="tensor" yields
    out = stack_images(views)
    assert out.shape == (4, 3, 5, 7) and torch.equal(out, torch.stack(views))
    assert out.is_contiguous(memory_format=torch.channels_last)
    chw = [v.contiguous() for v in views]
    out = stack_images(chw)
    assert torch.equal(out, torch.stack(chw)) and out.is_contiguous()


def test_decode_batches_from_a_worker_equal_the_decoded_images(tiny):
    from shardkit.dataset import FolderDataset

    ds = FolderDataset(str(tiny / "src"), decode="tensor")
    loader = DataLoader(TimedMap(ds), batch_size=8, num_workers=1, collate_fn=Collate("decode"))
    images, labels, (worker, start, end) = next(iter(loader))
    assert worker == 0 and start <= end
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(8)]))
    assert labels.tolist() == [ds[i][1] for i in range(8)]


def test_the_loader_contender_runs_on_the_tar_shards(tiny, tmp_path):
    """--formats loader: ShardLoader threads over the tar shards, stamped like DataLoader rows."""
    out = str(tmp_path / "b.json")
    run_bench(_config(tiny, mode="decode", formats=("tar", "loader"), json_path=out))
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    loader = {r["workers"]: r for r in rows if r["format"] == "loader"}
    assert set(loader) == {0, 2}
    assert all(r["timed_samples_runs"] == [3 * 8] and r["mean_samples_per_s"] > 0 for r in rows)
    with pytest.raises(InputError, match="--formats loader.*--mode decode"):
        run_bench(_config(tiny, mode="raw", formats=("loader",)))
