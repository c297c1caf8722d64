"""shardkit bench on a tiny real dataset: real files, real shards, real DataLoader workers.

No wall-clock thresholds: these tests check that every configuration is measured and reported,
that cold runs really evict (page residency read back with mincore), that latency is charged per
open as documented (opens counted), and that bad arguments fail with one clear line.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import replace

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
from shardkit.bench.estimate import estimate
from shardkit.bench.pagecache import evict, resident_fraction
from shardkit.bench.results import BenchResult, Load, Row, RunResult
from shardkit.bench.sources import make_dataset
from shardkit.bench.stats import student_t_sf2, welch
from shardkit.bench.workloads import Collate, TimedMap, stack_images
from shardkit.cli import main
from shardkit.errors import InputError
from shardkit.stream.world import World
from shardkit.write.packer import pack

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
    with pytest.raises(InputError, match="lower batches=, batch_size= or workers="):
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
    assert "folder: fastest mean at 4 workers" in text and "faster than 0 workers" in text
    assert "tar vs folder, each at its best: 4.6x" in text
    assert "folder: input-bound" in text and "switch to shards (tar" in text
    assert "more workers" in text  # folder still rose at the largest count tried
    assert "tar: not input-bound" in text and "0 workers already keep the wait under 5%" in text


def test_verdict_separates_waiting_on_transfer_from_waiting_on_loading():
    cfg = BenchConfig(workers=(2,), step_ms=20.0, mode="decode", batch_size=64)
    cfg = cfg.resolved()
    rows = [_row("tar", 2, [2000, 2000], 0.3, stall=0.02)]
    text = "\n".join(verdict(BenchResult(cfg, rows, {}, {}, 2, None, None, {}, 1.0)))
    assert "tar: input-bound by transfer, not loading" in text and "more workers do not" in text


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
    from shardkit.stream.dataset import FolderDataset

    ds = FolderDataset(str(tiny / "src"), decode="tensor")
    loader = DataLoader(TimedMap(ds), batch_size=8, num_workers=1, collate_fn=Collate("decode"))
    images, labels, (worker, start, end) = next(iter(loader))
    assert worker == 0 and start <= end
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(8)]))
    assert labels.tolist() == [ds[i][1] for i in range(8)]


# --- estimate, progress, load ---------------------------------------------------------------


@pytest.mark.slow  # the CLI in a child process
def test_cli_prints_an_estimate_then_one_progress_line_per_run_to_a_pipe(tiny, tmp_path):
    """stderr is a pipe here (not a terminal): still one plain line per run, no \\r bars."""
    from conftest import run_cli

    args = [
        "bench",
        "--data",
        tiny / "src",
        "--shards",
        tiny / "shards-{format}",
        "--workers",
        "0,2",
        "--formats",
        "folder,tar",
        "--batch-size",
        "8",
        "--batches",
        "2",
        "--repeats",
        "2",
        "--warm",
        "--mode",
        "raw",
        "--max-seconds",
        "2",
    ]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert "\r" not in res.stderr
    # 2 formats x 2 worker counts x 2 repeats, each bounded by max_seconds + the allowance.
    # 2 s timed + 0.5 s + 0.5 s per worker (at least one): 3.0 s at 0 workers, 3.5 at 2.
    assert lines[0].startswith(
        "estimate: 8 runs (folder,tar x workers 0,2 x 2 repeats) x up to 3.2 s each (timed up "
        "to 2 s, plus start-up) = up to"
    )
    assert "; load " in lines[0] and " cores" in lines[0]
    progress = [line for line in lines if line.startswith("[")]
    assert [p.split("]")[0] for p in progress] == [f"[{i}/8" for i in range(1, 9)]
    assert all("samples/s" in p and "elapsed" in p and "left" in p for p in progress)
    assert lines[-1].startswith("done in ") and "(estimate: up to " in lines[-1]
    assert "load 1/5/15 min: " in res.stdout  # the table header

    quiet = run_cli(*args, "-q")
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert "load 1/5/15 min: " in quiet.stdout


def test_estimate_is_runs_times_the_per_run_bound_plus_preparation(tmp_path):
    cfg = BenchConfig(workers=(0, 2, 4, 8), repeats=5, max_seconds=3.0, mode="raw", cold=False)
    cfg = cfg.resolved()
    est = estimate(cfg, [], ("folder", "tar", "lmdb"))
    # 3 s timed + 0.5 s + 0.5 s x max(1, workers): 4, 4.5, 5.5, 7.5 s -> 5.375 s on average
    assert est.runs == 60 and est.per_run_s == pytest.approx(5.375)
    assert est.total_s == pytest.approx(60 * 5.375 + est.fixed_s)
    assert est.line(cfg, ["folder", "tar", "lmdb"]).startswith(
        "estimate: 60 runs (folder,tar,lmdb x workers 0,2,4,8 x 5 repeats) x up to 5.4 s each"
    )
    # Packing is estimated from the bytes to pack; making the default set from its measured time.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(b"x" * 8_000_000)
    est = estimate(
        cfg,
        [
            ("making the default LFW-shaped set", None),
            ("packing src into src-shards-tar", str(src)),
        ],
        ("folder", "tar", "lmdb"),
    )
    assert [s for s, _ in est.prep] == [
        "making the default LFW-shaped set",
        "packing src into src-shards-tar",
    ]
    assert est.prep[1][1] > 0
    assert est.total_s == pytest.approx(60 * 5.375 + est.fixed_s + sum(s for _, s in est.prep))
    line = est.line(cfg, ["folder", "tar", "lmdb"])
    assert (
        "plus ~" in line and "making the default LFW-shaped set" in line and "total up to" in line
    )
    assert BenchConfig(max_seconds=None).resolved().run_bound_s(2) is None
    # Cold: the folder's eviction before each of its runs is added (1.5 s over 20 of 60 runs).
    cold = replace(cfg, cold=True)
    assert estimate(cold, [], ("folder", "tar", "lmdb")).per_run_s == pytest.approx(5.875)
    assert estimate(cold, [], ("tar", "lmdb")).per_run_s == pytest.approx(5.375)


def test_bench_records_load_and_cpu_count_before_and_after(tiny, tmp_path):
    out = tmp_path / "b.json"
    result = run_bench(_config(tiny, formats=("tar",), workers=(0,), json_path=str(out)))
    data = json.loads(out.read_text())
    for when in ("before", "after"):
        load = data["load"][when]
        assert set(load) == {"load_1m", "load_5m", "load_15m", "cores", "cpu_count"}
        assert load["cpu_count"] == os.cpu_count() and load["load_1m"] >= 0
    header = format_table(result).splitlines()[1]
    assert header.startswith("load 1/5/15 min: ") and " before, " in header and " after; " in header
    assert data["estimate_s"] > 0 and data["rows"][0]["stopped_runs"] == ["target"]


def _result(rows, cores=2, workers=(0, 2, 4), repeats=5, **kw) -> BenchResult:
    cfg = BenchConfig(workers=workers, mode="raw", repeats=repeats).resolved()
    return BenchResult(cfg, rows, {}, {}, cores, None, None, {}, 1.0, **kw)


def test_load_above_the_cores_is_one_warning_line_in_the_table():
    rows = [_row("tar", 0, [100, 110], 1.0)]
    busy = _result(rows, load_before=Load(6.37, 7.0, 7.2, 2, 2), load_after=Load(1.5, 6, 7, 2, 2))
    table = format_table(busy).splitlines()
    assert (
        table[1]
        == "load 1/5/15 min: 6.37/7.00/7.20 before, 1.50/6.00/7.00 after; 2 cores (cpu_count 2)"
    )
    assert table[2].startswith("warning: load average 6.37 before the bench exceeded its 2 cores")
    assert sum(line.startswith("warning:") for line in table) == 1
    idle = _result(rows, load_before=Load(0.3, 0.2, 0.1, 2, 2), load_after=Load(1.9, 1, 1, 2, 2))
    assert idle.load_warning() is None and "warning" not in format_table(idle)


# --- the verdict's significance test ---------------------------------------------------------


def _planted(mean: float, std: float, n: int = 5) -> list[float]:
    """n rates with exactly this mean and sample standard deviation."""
    z = np.linspace(-1.0, 1.0, n)
    return list(mean + std * z / z.std(ddof=1))


def test_student_t_tail_matches_tables_and_scipy():
    assert student_t_sf2(2.228, 10) == pytest.approx(0.05, abs=2e-4)  # t table, 95%, df 10
    assert student_t_sf2(12.706, 1) == pytest.approx(0.05, abs=2e-4)
    assert student_t_sf2(0.0, 4) == 1.0
    stats = pytest.importorskip("scipy.stats")  # a test-only cross-check; core needs no scipy
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.normal(100, 20, 5), rng.normal(120, 35, 4)
        expected = stats.ttest_ind(a, b, equal_var=False).pvalue
        assert welch(a.tolist(), b.tolist()).p == pytest.approx(expected, rel=1e-9)


def test_welch_untestable_with_one_run_and_exact_with_no_spread():
    assert welch([5.0], [1.0, 2.0]).p is None and not welch([5.0], [1.0, 2.0]).real
    assert welch([3.0, 3.0], [3.0, 3.0]).p == 1.0
    assert welch([3.0, 3.0], [4.0, 4.0]).real


def test_verdict_calls_1_2x_with_overlapping_spreads_a_tie():
    """ "tar vs folder 1.2x (408 ± 223 vs 336 ± 188)" over 5 repeats is a tie, not a win."""
    rows = [_row("folder", 2, _planted(336, 188), 1.0), _row("tar", 2, _planted(408, 223), 1.0)]
    text = "\n".join(verdict(_result(rows, workers=(2,))))
    assert (
        "tar vs folder, each at its best: 1.2x (408 ± 223 vs 336 ± 188 samples/s): within noise (p="
        in text
    )
    assert "a real difference" not in text


def test_runs_too_short_to_judge_are_never_called_a_real_difference():
    """A 3x gap over runs timed well under a millisecond is timer noise, not a verdict."""
    rows = [_row("folder", 2, _planted(1e6, 1e4), 1.0), _row("tar", 2, _planted(3e6, 1e4), 1.0)]
    lines = verdict(_result(rows, workers=(2,)))
    text = "\n".join(lines)
    assert "tar vs folder, each at its best: 3.0x" in text
    assert "real" not in lines[-3] and "too short to judge: a run timed 0.2" in text
    assert "10 of 10 runs were timed under 0.1 s" in text and "--min-seconds" in text
    two = [_row("tar", 0, _planted(1e6, 1e4), 1.0), _row("tar", 2, _planted(3e6, 1e4), 1.0)]
    line = verdict(_result(two, workers=(0, 2)))[0]
    assert line.startswith("tar: fastest mean at 2 workers") and "within noise" not in line
    assert "; not compared with 0 workers (1,000,000 ± 10,000) (too short to judge" in line


def test_verdict_calls_a_planted_3x_gap_real_and_a_planted_tie_noise():
    rows = [
        _row("folder", 0, _planted(1000, 60), 1.0),
        _row("folder", 2, _planted(1040, 80), 1.0),
        _row("folder", 4, _planted(1010, 90), 1.0),
        _row("tar", 0, _planted(1500, 100), 1.0),
        _row("tar", 2, _planted(3100, 150), 1.0),
        _row("tar", 4, _planted(3000, 200), 1.0),
    ]
    lines = verdict(_result(rows))
    text = "\n".join(lines)
    assert (
        "tar vs folder, each at its best: 3.0x (3,100 ± 150 vs 1,040 ± 80 samples/s, p<0.001: "
        "a real difference)." in text
    )
    # folder: 2 workers has the fastest mean, but the repeats cannot tell 0, 2 and 4 apart.
    folder = next(line for line in lines if line.startswith("folder:"))
    assert folder.startswith(
        "folder: fastest mean at 2 workers, 1,040 ± 80 samples/s; within noise of 0 workers "
        "(1,000 ± 60, p="
    )
    assert "4 workers (1,010 ± 90, p=" in folder and "so 0 workers do as well" in folder
    assert "faster than" not in folder
    tar = next(line for line in lines if line.startswith("tar:"))
    assert "within noise of 4 workers" in tar and "faster than 0 workers (1,500, p<0.001)" in tar
    assert "overlap waiting" not in text  # no explanation the run did not measure
    assert any(line.startswith("Differences are called real when Welch's t-test") for line in lines)


# --- plots ------------------------------------------------------------------------------------


def _result_with(rows, workers, sources, num_samples, load_before):
    cfg = BenchConfig(workers=workers, mode="raw", repeats=5).resolved()
    return BenchResult(
        cfg,
        rows,
        sources,
        {},
        2,
        None,
        None,
        {},
        1.0,
        num_samples=num_samples,
        load_before=load_before,
    )


def test_throughput_plot_names_the_data_marks_the_best_and_keeps_the_legend_outside(tmp_path):
    pytest.importorskip("matplotlib")
    from shardkit.bench.plot import plot_throughput, throughput_figure

    rows = [
        _row("folder", 0, _planted(1000, 60), 1.0),
        _row("folder", 2, _planted(1040, 80), 1.0),
        _row("tar", 0, _planted(1500, 100), 1.0),
        _row("tar", 2, _planted(3100, 150), 1.0),
    ]
    result = _result_with(
        rows,
        (0, 2),
        {"folder": "data/lfw", "tar": "data/lfw-shards-tar"},
        {"folder": 13233, "tar": 13233},
        Load(3.1, 2, 1, 2, 2),
    )
    fig = throughput_figure(result)
    ax = fig.axes[0]
    assert "data/lfw (13,233 samples)" in ax.get_title()
    best = {
        line.get_gid(): (line.get_xdata()[0], line.get_ydata()[0])
        for line in ax.lines
        if (line.get_gid() or "").startswith("best-")
    }
    assert best == {"best-folder": (2, pytest.approx(1040)), "best-tar": (2, pytest.approx(3100))}
    tied = {
        line.get_gid(): list(line.get_xdata())
        for line in ax.lines
        if (line.get_gid() or "").startswith("tied-")
    }
    assert tied == {"tied-folder": [0]}  # tar at 0 workers is really slower: no ring
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    axes = ax.get_window_extent(renderer)
    assert legend.x0 >= axes.x1  # right of the axes: it cannot cover a point
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "fastest mean of the format" in labels and any("within noise" in x for x in labels)
    plot_throughput(result, str(tmp_path / "t.png"))
    with Image.open(tmp_path / "t.png") as img:
        assert img.format == "PNG"


def test_timeline_legend_explains_every_colour_and_the_numbering(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from shardkit.bench.plot import plot_timeline, timeline_figure

    result = run_bench(_config(tiny, formats=("tar",), workers=(2,), step_ms=1.0, batches=4))
    fig = timeline_figure(result.timeline, result)
    ax = fig.axes[0]
    drawn = {to_hex(c) for coll in ax.collections for c in coll.get_facecolors()}
    legend = ax.get_legend()
    explained = {
        to_hex(h.get_facecolor()) for h in legend.legend_handles if hasattr(h, "get_facecolor")
    }
    assert drawn and drawn <= explained, drawn - explained
    labels = [t.get_text() for t in legend.get_texts()]
    assert any("white number: the order the loop consumed it" in x for x in labels)
    assert any(x.startswith("timing starts") for x in labels)  # the dotted line
    assert [t.get_text() for t in ax.texts] == [str(n) for n in range(len(result.timeline.batches))]
    plot_timeline(result.timeline, str(tmp_path / "tl.png"), result)
    with Image.open(tmp_path / "tl.png") as img:
        assert img.format == "PNG"


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
