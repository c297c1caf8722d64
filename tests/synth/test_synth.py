"""The embedded datasets: layouts, class-size shapes, determinism, photo-like pixels, reuse."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from shardkit import synth
from shardkit.cli import main
from shardkit.errors import InputError, OutputError
from shardkit.synth import (
    LFW_IMAGES,
    LFW_PEOPLE,
    MARKER,
    imagenet_wnids,
    lfw_counts,
    lfw_names,
    make_imagenet,
    make_lfw,
)
from shardkit.synth import build as synth_build

REPO = Path(__file__).resolve().parents[2]
TINY = 0.005  # 29 people, 66 images


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (the marker included) by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def images(root: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree(root).items() if k != MARKER}


@pytest.fixture(scope="module")
def lfw(tmp_path_factory) -> tuple[Path, synth.SynthReport]:
    out = tmp_path_factory.mktemp("lfw") / "lfw"
    return out, make_lfw(out, scale=0.01, seed=0)


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory) -> tuple[Path, synth.SynthReport]:
    out = tmp_path_factory.mktemp("imagenet") / "imagenet"
    return out, make_imagenet(out, classes=3, images_per_class=5, seed=0)


# --- class-size shapes and names (no pixels) ---------------------------------------------------


def test_full_lfw_shape_is_lfws():
    counts = lfw_counts(1.0)
    names = lfw_names(1.0)
    assert len(counts) == len(names) == LFW_PEOPLE == 5749
    assert sum(counts) == LFW_IMAGES == 13233
    assert counts.count(1) == 4069
    assert sum(1 for c in counts if c >= 2) == 1680
    assert dict(zip(names[:5], counts[:5], strict=True)) == {
        "George_W_Bush": 530,
        "Colin_Powell": 236,
        "Tony_Blair": 144,
        "Donald_Rumsfeld": 121,
        "Gerhard_Schroeder": 109,
    }
    assert counts == sorted(counts, reverse=True)
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Z][A-Za-z]*(_[A-Za-z]+)+", n) for n in names)


@pytest.mark.parametrize(
    "scale, people, imgs", [(0.01, 57, 132), (0.1, 575, 1323), (0.5, 2875, 6617)]
)
def test_scaled_counts_follow_the_scale_and_keep_the_long_tail(scale, people, imgs):
    counts = lfw_counts(scale)
    assert (len(counts), sum(counts)) == (people, imgs)
    ones = counts.count(1) / len(counts)
    assert 0.6 < ones < 0.8  # LFW: 4069 / 5749 = 0.71 have one image
    assert max(counts) >= 10 * float(np.median(counts))
    assert len(set(lfw_names(scale))) == people


@pytest.mark.parametrize("scale", [1e-6, 1e-4, 0.0004])
def test_tiny_scales_still_give_two_folders(scale):
    counts = lfw_counts(scale)
    assert len(counts) >= 2 and all(c >= 1 for c in counts)


@pytest.mark.parametrize("scale", [0, -0.5, 1.5, float("nan")])
def test_bad_scale_is_refused(tmp_path, scale):
    with pytest.raises(InputError, match="scale="):
        make_lfw(tmp_path / "x", scale=scale)
    assert not (tmp_path / "x").exists()


def test_wnids_look_like_imagenets_and_follow_the_seed():
    ids = imagenet_wnids(50, seed=0)
    assert len(set(ids)) == 50 and ids == sorted(ids)
    assert all(re.fullmatch(r"n\d{8}", i) and "n01440764" <= i <= "n15075141" for i in ids)
    assert imagenet_wnids(50, seed=0) == ids
    assert imagenet_wnids(50, seed=1) != ids


@pytest.mark.slow  # a fresh interpreter
def test_sources_are_found_without_importing_skimage():
    code = (
        "import sys, shardkit.synth as s; src = s.photo_sources(); "
        "print(len(src), 'skimage' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.split()
    assert int(out[0]) >= 5 and out[1] == "False"


# --- LFW tree -------------------------------------------------------------------------------


def test_lfw_layout_matches_counts_and_report(lfw):
    out, report = lfw
    counts = dict(zip(lfw_names(0.01), lfw_counts(0.01), strict=True))
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == sorted(counts)
    for name in folders:
        files = sorted(p.name for p in (out / name).iterdir())
        assert files == [f"{name}_{i:04d}.jpg" for i in range(1, counts[name] + 1)]
    sizes = [len(b) for b in images(out).values()]
    assert report.images == len(sizes) == 132 and report.folders == 57
    assert report.total_bytes == sum(sizes)
    assert report.mean_bytes == pytest.approx(sum(sizes) / len(sizes))
    assert not report.reused
    marker = json.loads((out / MARKER).read_text())
    assert marker["params"]["kind"] == "lfw" and marker["images"] == 132
    assert "average" in report.summary() and "KB/file" in report.summary()


def test_lfw_images_are_photo_like_jpegs(lfw):
    out, report = lfw
    stds, corrs, sizes = [], [], []
    for rel, data in images(out).items():
        im = Image.open(io.BytesIO(data))
        assert im.format == "JPEG" and im.size == (250, 250), rel
        a = np.asarray(im.convert("RGB"), dtype=np.float64)
        stds.append(a.std())
        g = a.mean(axis=2)
        # Neighbouring pixels of a photograph agree; those of noise do not.
        corrs.append(np.corrcoef(g[:, :-1].ravel(), g[:, 1:].ravel())[0, 1])
        sizes.append(len(data))
    assert min(stds) > 3 and np.median(stds) > 15  # not flat colour
    assert np.median(corrs) > 0.8  # not noise
    assert len(set(sizes)) > 0.9 * len(sizes)  # sizes vary like photos', not one constant
    assert 5_000 < report.mean_bytes < 30_000  # real LFW: ~13 KB per 250x250 JPEG


def test_same_seed_same_bytes_whatever_the_workers(tmp_path, lfw):
    out, _ = lfw
    again = make_lfw(tmp_path / "again", scale=0.01, seed=0, workers=1)
    assert not again.reused
    assert tree(tmp_path / "again") == tree(out)
    make_lfw(tmp_path / "four", scale=0.01, seed=0, workers=4)
    assert tree(tmp_path / "four") == tree(out)


def test_another_seed_other_pixels_same_layout(tmp_path, lfw):
    out, _ = lfw
    make_lfw(tmp_path / "s1", scale=0.01, seed=1)
    a, b = images(out), images(tmp_path / "s1")
    assert a.keys() == b.keys()
    assert sum(a[k] != b[k] for k in a) == len(a)


def test_size_option(tmp_path):
    report = make_lfw(tmp_path / "small", scale=TINY, size=64)
    for data in images(tmp_path / "small").values():
        assert Image.open(io.BytesIO(data)).size == (64, 64)
    assert report.images == sum(lfw_counts(TINY))


# --- reuse, refusal, atomicity -------------------------------------------------------------


def test_rerun_reuses_without_touching_files(tmp_path):
    out = tmp_path / "lfw"
    first = make_lfw(out, scale=TINY)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    second = make_lfw(out, scale=TINY, workers=1)
    assert second.reused and not first.reused
    assert (second.images, second.total_bytes) == (first.images, first.total_bytes)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps


def test_other_parameters_replace_an_old_synth_tree(tmp_path):
    out = tmp_path / "lfw"
    make_lfw(out, scale=TINY, seed=0)
    report = make_lfw(out, scale=TINY, seed=3)
    assert not report.reused
    assert json.loads((out / MARKER).read_text())["params"]["seed"] == 3
    assert images(out) == images(make_lfw(tmp_path / "ref", scale=TINY, seed=3).path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lfw", "ref"]  # no temporaries left


def test_incomplete_tree_is_rebuilt(tmp_path):
    out = tmp_path / "lfw"
    make_lfw(out, scale=TINY)
    victim = next(out.rglob("*.jpg"))
    original = victim.read_bytes()
    victim.unlink()
    report = make_lfw(out, scale=TINY)
    assert not report.reused and victim.read_bytes() == original


def test_foreign_non_empty_directory_is_refused(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    with pytest.raises(OutputError, match=re.escape(str(out))) as err:
        make_lfw(out, scale=TINY)
    assert "delete it" in str(err.value)
    assert [p.name for p in out.iterdir()] == ["thesis.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_existing_empty_directory_is_filled(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    report = make_lfw(out, scale=TINY)
    assert report.images == len(images(out)) > 0


def test_file_in_the_way_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        make_lfw(tmp_path / "f", scale=TINY)


def test_failed_run_leaves_nothing_under_the_final_name(tmp_path, monkeypatch):
    calls = []
    real = synth_build._render_range

    def fail_on_second_chunk(job, start, stop):
        calls.append(start)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")  # what a full disk would raise
        return real(job, start, stop)

    monkeypatch.setattr(synth_build, "_render_range", fail_on_second_chunk)
    with pytest.raises(OSError, match="No space"):
        make_lfw(tmp_path / "lfw", scale=0.02, workers=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a child process
def test_temporaries_of_dead_runs_are_cleared(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".lfw.synth-tmp-{dead.pid}-0123abcd"
    (stale / "Some_One").mkdir(parents=True)
    make_lfw(tmp_path / "lfw", scale=TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lfw"]


@pytest.mark.slow  # a live child process
def test_temporaries_of_live_runs_are_kept(tmp_path):
    """The one stale-temp policy (fsutil): a concurrent synth's temporaries are never touched."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        building = tmp_path / f".lfw.synth-tmp-{live.pid}-0123abcd"
        replaced = tmp_path / f".lfw.synth-old-{live.pid}-4567abcd"
        for d in (building, replaced):
            (d / "Some_One").mkdir(parents=True)
        make_lfw(tmp_path / "lfw", scale=TINY)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted(["lfw", building.name, replaced.name])
    finally:
        live.kill()
        live.wait()


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(InputError, match="seed="):
        make_lfw(tmp_path / "a", scale=TINY, seed=-1)
    with pytest.raises(InputError, match="size="):
        make_lfw(tmp_path / "a", scale=TINY, size=0)
    with pytest.raises(InputError, match="workers="):
        make_lfw(tmp_path / "a", scale=TINY, workers=0)
    with pytest.raises(InputError, match="classes="):
        make_imagenet(tmp_path / "a", classes=0)
    assert list(tmp_path.iterdir()) == []


# --- ImageNet tree ---------------------------------------------------------------------------


def test_imagenet_layout_and_sizes(imagenet):
    out, report = imagenet
    wnids = imagenet_wnids(3, seed=0)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == wnids
    dims, sizes = set(), []
    for wnid in wnids:
        files = sorted((out / wnid).iterdir())
        assert len(files) == 5
        for f in files:
            assert re.fullmatch(rf"{wnid}_[1-9]\d*\.JPEG", f.name), f.name
            im = Image.open(f)
            assert im.format == "JPEG" and im.mode == "RGB"
            assert 32 <= min(im.size) and max(im.size) <= 1600
            dims.add(im.size)
            a = np.asarray(im, dtype=np.float64)
            assert a.std() > 3
            sizes.append(f.stat().st_size)
    assert len(dims) >= 2 and len(set(sizes)) == len(sizes)
    assert (report.images, report.folders, report.total_bytes) == (15, 3, sum(sizes))
    assert 30_000 < report.mean_bytes < 400_000  # real ImageNet: ~110 KB on average


def test_imagenet_is_deterministic(tmp_path, imagenet):
    out, _ = imagenet
    make_imagenet(tmp_path / "again", classes=3, images_per_class=5, seed=0, workers=1)
    assert tree(tmp_path / "again") == tree(out)
    make_imagenet(tmp_path / "other", classes=3, images_per_class=5, seed=1)
    assert images(tmp_path / "other").keys().isdisjoint(images(out).keys())


# --- CLI and the tools script ---------------------------------------------------------------


def test_cli_lfw_prints_the_average_and_reuses(tmp_path):
    out = str(tmp_path / "lfw")
    runner = CliRunner()
    first = runner.invoke(main, ["synth", "lfw", out, "--scale", str(TINY), "--seed", "2"])
    assert first.exit_code == 0, first.output
    n = sum(lfw_counts(TINY))
    assert re.search(rf"{n} images in \d+ folders, .* average \d+\.\d KB/file", first.output)
    second = runner.invoke(main, ["synth", "lfw", out, "--scale", str(TINY), "--seed", "2"])
    assert second.exit_code == 0 and "reused" in second.output


def test_cli_imagenet_and_its_errors(tmp_path):
    runner = CliRunner()
    out = tmp_path / "inet"
    ok = runner.invoke(
        main, ["synth", "imagenet", str(out), "--classes", "2", "--images-per-class", "2"]
    )
    assert ok.exit_code == 0, ok.output
    assert "4 images in 2 folders" in ok.output and "KB/file" in ok.output
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "a.txt").write_text("x")
    bad = runner.invoke(main, ["synth", "imagenet", str(tmp_path / "foreign")])
    assert bad.exit_code == 2
    assert bad.output.startswith("error: ") and str(tmp_path / "foreign") in bad.output
    assert len(bad.output.strip().splitlines()) == 1


@pytest.mark.slow  # a script in a child process
def test_tools_script_makes_a_set(tmp_path):
    out = tmp_path / "data" / "lfw"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "make_default_data.py"),
            str(out),
            "--scale",
            "0.002",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "average" in proc.stdout and (out / MARKER).is_file()
    refused = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_default_data.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert refused.returncode == 2 and refused.stderr.startswith("error: ")


@pytest.mark.slow
def test_ctrl_c_leaves_nothing_behind(tmp_path):
    out = tmp_path / "lfw"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardkit.cli", "synth", "lfw", str(out), "--threads", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # SIGINT as a terminal's job has it, even under a runner that ignores it (nohup, &)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        text=True,
        cwd=REPO,
    )
    try:
        # Wait until images are being written into the temporary sibling, then interrupt.
        for _ in range(6000):
            temps = [p for p in tmp_path.iterdir() if ".synth-tmp-" in p.name]
            if temps and any(temps[0].glob("*/*.jpg")):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert list(tmp_path.iterdir()) == []
