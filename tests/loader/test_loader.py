"""ShardLoader: worker processes decoding into a reused shared-memory ring, with every
ShardDataset guarantee."""

from __future__ import annotations

import gc
import io
import json
import multiprocessing
import os
import tarfile
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import gloo_rank, run_ranks
from PIL import Image

from shardkit import CenterCrop, Decode, Order, RandomResizedCrop, ShardDataset, ShardLoader, pack
from shardkit.errors import InputError, SampleError, ShardFormatError, TransformError
from shardkit.remote.storage import RemoteStorage
from shardkit.stream import worker_span
from shardkit.stream.world import World

# Most tests iterate epoch 0 more than once on purpose (a reference pass, then the loader).
pytestmark = pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning")

N = 23  # odd and prime: no rank, worker or batch count divides it
W, H = 20, 14


def _image(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, (H, W, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """23 JPEGs of one size (one of them a PNG) in 3 classes, packed into several tar shards."""
    base = tmp_path_factory.mktemp("loader")
    for i in range(N):
        d = base / "src" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(_image(i))
        if i == 5:
            img.save(d / f"im{i:02d}.png")
        else:
            img.save(d / f"im{i:02d}.jpg", quality=90)
    pack(str(base / "src"), str(base / "tar"), shard_size=6000, progress=False)
    return str(base / "tar")


ALL_KEYS = sorted(f"c{i % 3}/im{i:02d}" for i in range(N))


def _ds(path, **kw):
    kw.setdefault("decode", "tensor")
    kw.setdefault("with_keys", True)
    return ShardDataset(path, **kw)


def _run(loader):
    """(batch sizes, keys in order, images by key) of one epoch."""
    sizes, keys, images = [], [], {}
    for x, _, k in loader:
        sizes.append(len(x))
        keys += k
        images.update(zip(k, x.clone(), strict=True))
    return sizes, keys, images


def _workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("shardkit-worker")]


def _fds():
    gc.collect()  # datasets of earlier tests hold shared-memory files until collected
    return len(os.listdir("/proc/self/fd"))


# --- splitting, length, order ------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_the_caller_let_go_of_is_refilled_in_place(shards, workers, monkeypatch):
    """A slot whose batch the caller no longer holds is filled again in the same memory; only a
    batch still held (the loop variable of the last one, at the epoch's end) gets a fresh one.
    Handing back the batch the caller still held made every batch a fresh mapping: page faults
    on every write, 10% of a 2-core epoch."""
    from shardkit.loader import ring as ring_mod

    fresh = []
    replace = ring_mod.Ring.replace

    def counted(self, worker, slot):
        fresh.append((worker, slot))
        return replace(self, worker, slot)

    monkeypatch.setattr(ring_mod.Ring, "replace", counted)
    loader = ShardLoader(
        _ds(shards, decode=Decode(crop=CenterCrop(16, 16))), 2, num_workers=workers
    )  # 12 batches an epoch
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = sum(1 for _ in loader)
        assert batches == len(loader) >= 10
    assert len(fresh) <= 2  # at most the one held at each epoch's end
    loader.close()


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 4, 5, 23, 30])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_is_exactly_the_batches_yielded(shards, workers, batch_size, drop_last):
    loader = ShardLoader(_ds(shards), batch_size, num_workers=workers, drop_last=drop_last)
    sizes, keys, _ = _run(loader)
    assert len(sizes) == len(loader)
    assert len(loader) == (N // batch_size if drop_last else -(-N // batch_size))
    assert all(s == batch_size for s in sizes[:-1])  # only the last batch may be short
    if not drop_last:
        assert sorted(keys) == ALL_KEYS  # every sample once


@pytest.mark.parametrize("equalize", ["pad", "drop", "none"])
def test_three_ranks_with_two_workers_take_equal_steps_and_cover_the_epoch(shards, equalize):
    results = []
    for rank in range(3):
        ds = _ds(shards, rank=rank, world_size=3, order=Order(equalize=equalize))
        loader = ShardLoader(ds, 3, num_workers=2)
        sizes, keys, _ = _run(loader)
        assert len(sizes) == len(loader) and sum(sizes) == len(ds)
        results.append((len(sizes), keys))
    steps = [s for s, _ in results]
    keys = [k for _, ks in results for k in ks]
    if equalize == "none":
        assert Counter(keys) == Counter(ALL_KEYS)  # exactly once over all ranks
    else:
        assert len(set(steps)) == 1  # DDP-safe: every rank steps the same number of times
        assert set(keys) == set(ALL_KEYS) if equalize == "pad" else len(set(keys)) == len(keys)


def test_batches_are_the_dataloader_workers_streams_in_turn(shards):
    """Worker w reads what DataLoader worker w reads (the dataset's own per-worker stream, cut
    at batch multiples); batch k comes from worker k % num_workers."""
    ds = _ds(shards, seed=3)
    ds.set_epoch(2)
    _, keys, _ = _run(ShardLoader(ds, 4, num_workers=3))
    streams = [[r.key for r in ds.records(World(0, 1, w, 3), 2, 4)] for w in range(3)]
    batches = [[s[i : i + 4] for i in range(0, len(s), 4)] for s in streams]
    expect = []
    for k in range(max(map(len, batches))):
        for b in batches:
            if k < len(b):
                expect += b[k]
    assert keys == expect


def test_worker_parts_are_cut_at_batch_multiples():
    for length in range(1, 60):
        for bs in (1, 4, 7):
            for nw in (1, 2, 3, 5):
                spans = [worker_span(length, w, nw, bs) for w in range(nw)]
                assert spans[0][0] == 0 and spans[-1][1] == length
                assert all(spans[w][1] == spans[w + 1][0] for w in range(nw - 1))
                short = [(hi - lo) % bs for lo, hi in spans if (hi - lo) % bs]
                assert len(short) <= 1  # only one worker holds a short batch
                assert sum(-(-(hi - lo) // bs) for lo, hi in spans) == -(-length // bs)


def test_same_epoch_repeats_and_a_new_epoch_reorders(shards):
    ds = _ds(shards, seed=7)
    loader = ShardLoader(ds, 4, num_workers=2)
    loader.set_epoch(1)
    _, a, images_a = _run(loader)
    _, b, images_b = _run(loader)
    ds.set_epoch(2)  # on the dataset works as on the loader
    _, c, _ = _run(loader)
    assert a == b and a != c and sorted(c) == ALL_KEYS
    assert all(torch.equal(images_a[k], images_b[k]) for k in a)


def test_iterating_the_same_epoch_again_warns_as_the_dataset_does(shards):
    loader = ShardLoader(_ds(shards), 8, num_workers=2)
    _run(loader)
    with pytest.warns(RuntimeWarning, match="iterated epoch 0 again"):
        _run(loader)


# --- pixels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_images_are_what_the_dataset_decodes(shards, workers, channels_last):
    """Also the PNG among them: non-JPEG samples take the Pillow path into the same buffers."""
    ds = _ds(shards)
    reference = {k: img for img, _, k in ds}
    loader = ShardLoader(ds, 4, num_workers=workers, channels_last=channels_last)
    for x, y, keys in loader:
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, H, W) and y.dtype == torch.int64
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert x.is_contiguous(memory_format=fmt)
        for img, key in zip(x, keys, strict=True):
            assert torch.equal(img, reference[key])
    png = reference["c2/im05"]
    assert torch.equal(png, torch.from_numpy(_image(5)).permute(2, 0, 1))  # lossless: exact


class _Corner:
    """A user's crop policy (module level: spawned workers unpickle it)."""

    size = 8
    interpolation = "bicubic"

    def box(self, height, width, uniforms):
        side = min(height, width) - int(next(uniforms) * 4)
        return 0, int(next(uniforms) * (width - side + 1)), side, side


@pytest.mark.parametrize("workers", [0, 2])
def test_crop_objects_and_hooks_run_in_the_workers_as_in_the_dataset(shards, workers):
    from shardkit import CenterCrop, RandomCrop, RandomResizedCrop

    crops = [
        RandomResizedCrop(8, scale=(0.9, 1.0), interpolation="bicubic"),
        RandomCrop(8, resize_short=(8, 12)),
        CenterCrop(8, resize_short=10),
        _Corner(),
    ]
    for crop in crops:
        ds = _ds(shards, decode=Decode(crop=crop, flip=True), seed=9)
        reference = {k: img for img, _, k in ds}
        _, keys, images = _run(ShardLoader(ds, 5, num_workers=workers))
        assert sorted(keys) == ALL_KEYS
        assert all(torch.equal(images[k], reference[k]) for k in keys), crop
        assert images[keys[0]].shape == (3, 8, 8)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """16 samples of one size in a hand-written tar (no manifest): plain JPEGs among a PNG, a
    CMYK and a grayscale JPEG, one of other settings, a damaged JPEG (im09) and, at im13, a
    label that is not a number (a read error of the stream itself)."""
    base = tmp_path_factory.mktemp("mixed")
    members = []
    for i in range(16):
        img = Image.fromarray(_image(i))
        buf = io.BytesIO()
        if i == 2:
            img.save(buf, "PNG")
        elif i == 4:
            img.convert("CMYK").save(buf, "JPEG", quality=90)
        elif i == 6:
            img.convert("L").save(buf, "JPEG", quality=90)
        elif i == 8:
            img.save(buf, "JPEG", quality=40, subsampling=0)
        else:
            img.save(buf, "JPEG", quality=90)
        data = buf.getvalue()
        if i == 9:
            data = data[:200] + bytes(len(data) - 202) + data[-2:]
        ext = "png" if i == 2 else "jpg"
        members += [(f"im{i:02d}.{ext}", data), (f"im{i:02d}.cls", b"x" if i == 13 else b"1")]
    with tarfile.open(base / "mixed.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(base / "mixed.tar")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_batch_of_mixed_images_is_what_the_dataset_gives(mixed, workers, channels_last):
    """Whole images decode a batch's plain JPEGs in one native call; each other sample still
    goes its own way, in order: the same pixels, skips and errors as ShardDataset, whichever
    comes first (the sample's error before the stream's, in stream order)."""
    ds = _ds(mixed, on_error="skip", order=Order(shuffle=False))
    want_keys, want = [], {}
    with pytest.raises(ShardFormatError, match="im13"), pytest.warns(RuntimeWarning):
        for img, _, key in ds:
            want_keys.append(key)
            want[key] = img
    assert "im09" not in want and len(want_keys) == 12
    loader = ShardLoader(
        _ds(mixed, on_error="skip", order=Order(shuffle=False)), 16, num_workers=workers
    )
    with pytest.raises(ShardFormatError, match="im13"):
        next(iter(loader))  # the one batch holds im13's read error
    loader = ShardLoader(
        _ds(mixed, on_error="skip", order=Order(shuffle=False)), 4, num_workers=workers,
        channels_last=channels_last,
    )  # fmt: skip
    got_keys, got = [], {}
    with pytest.raises(ShardFormatError, match="im13"), pytest.warns(RuntimeWarning):
        for x, _, keys in loader:
            got_keys += keys
            got.update(zip(keys, x.clone(), strict=True))
    if workers == 0:  # (two workers deliver the same samples in their own order)
        assert got_keys == want_keys[: len(got_keys)] and len(got_keys) >= 8
    assert got_keys and set(got_keys) <= set(want_keys)
    for key in got_keys:
        assert torch.equal(got[key], want[key]), key
    # on_error="raise": the damaged image (im09) is named, not the label read after it
    loader = ShardLoader(_ds(mixed, order=Order(shuffle=False)), 16, num_workers=workers)
    with pytest.raises(SampleError, match="im09"):
        list(loader)


def test_labels_are_the_class_indices(shards):
    for _, y, keys in ShardLoader(_ds(shards), 5, num_workers=2):
        assert y.tolist() == [int(k[1]) for k in keys]


@pytest.mark.parametrize("channels_last", [False, True])
def test_normalised_batch_equals_the_formula_on_the_uint8_batch(shards, channels_last):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    ds = _ds(shards)
    _, _, raw = _run(ShardLoader(ds, 4, num_workers=2))
    loader = ShardLoader(
        ds, 4, num_workers=2, device="cpu", normalize=(mean, std), channels_last=channels_last
    )
    m, s = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
    for x, _, keys in loader:
        assert x.dtype == torch.float32
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert x.is_contiguous(memory_format=fmt)
        for img, key in zip(x, keys, strict=True):
            want = (raw[key].float() / 255 - m) / s
            torch.testing.assert_close(img, want, atol=1e-5, rtol=0)


def test_geometry_batches_have_the_fixed_size(shards):
    ds = _ds(shards, decode=Decode(crop=RandomResizedCrop(8), flip=True))
    sizes, keys, images = _run(ShardLoader(ds, 6, num_workers=2))
    assert sorted(keys) == ALL_KEYS and all(v.shape == (3, 8, 8) for v in images.values())
    reference = {k: img for img, _, k in ds}  # same (seed, epoch, rank, key): same crop
    assert all(torch.equal(images[k], reference[k]) for k in keys)


def test_kept_batches_stay_valid(shards):
    """Slots are reused only when nothing outside refers to them; a kept one gets fresh memory."""
    ds = _ds(shards)
    kept = list(ShardLoader(ds, 2, num_workers=2, prefetch_factor=1))
    reference = {k: img for img, _, k in ds}
    assert sum(len(x) for x, _, _ in kept) == N
    for x, _, keys in kept:
        for img, key in zip(x, keys, strict=True):
            assert torch.equal(img, reference[key])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_loop_reuses_its_buffers(shards, workers):
    """No allocation per batch: 23 batches of 1 come out of each worker's ring slots
    (prefetch_factor + 2: the batches ready ahead, the one yielded and the one before it)."""
    storages = set()
    for x, _, _ in ShardLoader(_ds(shards), 1, num_workers=workers, prefetch_factor=1):
        storages.add(x.untyped_storage().data_ptr())
    assert len(storages) <= max(1, workers) * 3


def test_batches_differ_in_size_without_size_raises_naming_the_key(tmp_path):
    for i, wh in enumerate([(20, 14), (20, 14), (30, 14)]):
        d = tmp_path / "src" / "c"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((wh[1], wh[0], 3), np.uint8)).save(d / f"im{i}.jpg")
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), progress=False)
    loader = ShardLoader(_ds(str(tmp_path / "tar"), order=Order(shuffle=False)), 3, num_workers=1)
    message = r"sample 'c/im\d' is \d+x14 but its batch holds \d+x14 images; pass decode=Decode"
    with pytest.raises(InputError, match=message):
        list(loader)


# --- errors and cleanup ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory):
    """12 images, one of them a JPEG whose data is garbage after the header."""
    base = tmp_path_factory.mktemp("corrupt")
    for i in range(12):
        d = base / "src" / "c"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_image(i)).save(d / f"im{i:02d}.jpg")
    buf = io.BytesIO()
    Image.fromarray(_image(99)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    data[200:-2] = b"\x00" * (len(data) - 202)  # header intact, entropy data destroyed
    (base / "src" / "c" / "im07.jpg").write_bytes(bytes(data))
    pack(str(base / "src"), str(base / "tar"), shard_size=4000, on_error="skip", progress=False)
    return str(base / "tar")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_jpeg_raises_in_the_caller_naming_shard_and_key(corrupt, workers):
    ds = _ds(corrupt)  # before counting: its epoch state is a shared-memory file
    before = _fds()
    with pytest.raises(SampleError, match=r"shard-\d+\.tar: sample 'c/im07'") as info:
        list(ShardLoader(ds, 4, num_workers=workers))
    assert info.value.key == "c/im07" and info.value.shard.endswith(".tar")
    assert _workers() == [] and _fds() == before


def test_on_error_skip_counts_and_goes_on(corrupt):
    ds = _ds(corrupt, on_error="skip")
    with pytest.warns(RuntimeWarning, match="skipped: .*c/im07"):
        _, keys, _ = _run(ShardLoader(ds, 4, num_workers=2))
    assert ds.skipped == 1 and len(keys) == 11 and "c/im07" not in keys


@pytest.mark.parametrize("workers", [0, 2])
def test_break_and_exceptions_leave_no_thread_process_or_fd_behind(shards, workers):
    ds = _ds(shards)
    gc.collect()
    fds, threads = _fds(), threading.active_count()
    for _ in range(3):
        for _ in ShardLoader(ds, 2, num_workers=workers):
            break
    assert _workers() == [] and threading.active_count() == threads

    def failing_step():
        for i, _ in enumerate(ShardLoader(ds, 2, num_workers=workers)):
            if i == 1:
                raise ZeroDivisionError("the training step failed")

    with pytest.raises(ZeroDivisionError):
        failing_step()
    assert _workers() == [] and threading.active_count() == threads
    loader = ShardLoader(ds, 2, num_workers=workers)
    it = iter(loader)
    next(it)
    loader.close()  # explicit, while the iterator is still referenced
    assert _workers() == []
    with pytest.raises(StopIteration):
        next(it)
    assert _fds() == fds and multiprocessing.active_children() == []


def test_a_new_iteration_abandons_the_previous_one_and_keeps_the_workers(shards):
    loader = ShardLoader(_ds(shards), 2, num_workers=2)
    first = iter(loader)
    next(first)
    pids = loader.worker_pids
    second = iter(loader)
    with pytest.raises(StopIteration):
        next(first)  # abandoned
    assert sorted(k for _, _, keys in second for k in keys) == ALL_KEYS
    assert loader.worker_pids == pids and len(_workers()) == 2  # persistent
    loader.close()
    assert _workers() == [] and loader.worker_pids == []


def test_workers_are_processes_that_persist_across_epochs_until_close(shards):
    loader = ShardLoader(_ds(shards, seed=1), 4, num_workers=2)
    assert loader.worker_pids == [] and "not allocated" in repr(loader)
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)  # reaches the running workers
        it = iter(loader)
        orders.append([k for _, _, keys in it for k in keys])
        if epoch == 0:
            pids = loader.worker_pids
            assert len(pids) == 2 and os.getpid() not in pids
            assert {p.pid for p in _workers()} == set(pids)
        assert loader.worker_pids == pids
    assert orders[0] != orders[1] != orders[2] and sorted(orders[2]) == ALL_KEYS
    assert "2 workers x 4 slots" in repr(loader) and "MiB shared" in repr(loader)
    loader.close()
    assert _workers() == []


def test_break_and_garbage_collection_stop_the_workers(shards):
    ds = _ds(shards)
    for _ in ShardLoader(ds, 2, num_workers=2):
        assert len(_workers()) == 2
        break
    gc.collect()
    assert _workers() == []


def test_the_cuda_batch_order_with_one_worker_and_one_slot_ahead_finishes(shards):
    """With a batch staged ahead (the CUDA path's order, forced here on the CPU), one worker
    and prefetch_factor=1 used to wait forever for a slot the consumer held."""
    for workers in (0, 1):
        loader = ShardLoader(_ds(shards), 2, num_workers=workers, prefetch_factor=1)
        loader._ahead = 1
        assert sorted(k for _, _, keys in loader for k in keys) == ALL_KEYS
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_transform_runs_on_each_decoded_image(shards, workers):
    ds = _ds(shards, transform=lambda img: 255 - img)
    reference = {k: img for img, _, k in _ds(shards)}
    _, keys, images = _run(ShardLoader(ds, 4, num_workers=workers))
    assert sorted(keys) == ALL_KEYS
    assert all(torch.equal(images[k], 255 - reference[k]) for k in keys)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_returning_another_shape_names_the_sample(shards, workers):
    ds = _ds(shards, transform=lambda img: img.float())
    with pytest.raises(InputError, match=r"shard-\d+\.tar: sample 'c\d/im\d+': the dataset's tran"):
        list(ShardLoader(ds, 4, num_workers=workers))
    ds = _ds(shards, decode=Decode(crop=CenterCrop(8, 8)), transform=lambda img: img[:, :4])
    with pytest.raises(InputError, match=r"shape \(3, 4, 8\).*shape \(3, 8, 8\)"):
        list(ShardLoader(ds, 4, num_workers=workers))
    assert _workers() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_transform_is_its_own_error_not_a_skipped_sample(shards, workers):
    def transform(img):
        raise ZeroDivisionError("the transform's bug")

    ds = _ds(shards, transform=transform, on_error="skip")
    with pytest.raises(TransformError, match="ZeroDivisionError: the transform's bug") as info:
        list(ShardLoader(ds, 4, num_workers=workers))
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert ds.skipped == 0 and _workers() == []


def test_the_spawn_start_method_gives_the_same_batches(shards):
    ds = _ds(shards, seed=5)
    _, forked, _ = _run(ShardLoader(ds, 4, num_workers=2, start_method="fork"))
    loader = ShardLoader(ds, 4, num_workers=2, start_method="spawn")
    _, spawned, images = _run(loader)
    assert spawned == forked
    reference = {k: img for img, _, k in ds}
    assert all(torch.equal(images[k], reference[k]) for k in spawned)
    loader.close()


def test_arguments_are_checked(shards):
    with pytest.raises(InputError, match='decode="tensor"'):
        ShardLoader(_ds(shards, decode="pil"), 4)
    with pytest.raises(InputError, match="start_method"):
        ShardLoader(_ds(shards), 4, start_method="thread")
    with pytest.raises(InputError, match="batch_size"):
        ShardLoader(_ds(shards), 0)
    with pytest.raises(InputError, match="fields=: 'seg.png' is image-shaped"):
        ShardLoader(_ds(shards, fields=("seg.png",)), 4, decode_on="auto")
    with pytest.raises(InputError, match="normalize"):
        ShardLoader(_ds(shards), 4, normalize=((0.5,), (0.5,)))
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            ShardLoader(_ds(shards), 4, device="cuda")


# --- CUDA (skipped without a GPU) ----------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_batches_match_the_cpu_path(shards, channels_last):
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    ds = _ds(shards)
    kw = dict(num_workers=2, normalize=(mean, std), channels_last=channels_last)
    cpu = {}
    for x, _, keys in ShardLoader(ds, 4, device="cpu", **kw):
        cpu.update(zip(keys, x, strict=True))
    for x, y, keys in ShardLoader(ds, 4, device="cuda", **kw):
        assert x.is_cuda and y.is_cuda and x.dtype == torch.float32
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert x.is_contiguous(memory_format=fmt)
        for img, key in zip(x.cpu(), keys, strict=True):
            torch.testing.assert_close(img, cpu[key], atol=1e-5, rtol=0)


# --- a real 3-rank DDP run --------------------------------------------------------------------


def _rank(rank: int, port: int, data_dir: str, out_dir: str) -> None:
    with gloo_rank(rank, port, 3) as dist:
        ds = ShardDataset(data_dir, decode="tensor", with_keys=True, order=Order(equalize="drop"))
        loader = ShardLoader(ds, 2, num_workers=2)
        steps, keys = 0, []
        for x, _, k in loader:
            total = x.float().sum()
            dist.all_reduce(total)  # every rank must take part in every step
            steps += 1
            keys += k
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": steps, "len": len(loader), "keys": keys}, f)


@pytest.mark.slow  # real ranks: spawned processes over gloo
def test_three_real_ranks_step_together(shards, tmp_path):
    run_ranks(_rank, 3, shards, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert {r["steps"] for r in results} == {r["len"] for r in results} == {4}  # 7 each, by 2
    keys = [k for r in results for k in r["keys"]]
    assert len(keys) == len(set(keys)) == 21


# --- remote shards --------------------------------------------------------------------------


@pytest.mark.slow
def test_remote_shards_stream_through_the_workers(shards, s3):
    """Over a loopback S3 server each worker process opens its own storage and prefetches its
    own shards: every epoch still delivers every sample once, and no worker is left."""
    from remote_servers import S3Server

    bucket = "loader-" + os.urandom(4).hex()
    s3.upload_dir(bucket, "tar", shards)
    ds = ShardDataset(
        f"s3://{bucket}/tar/",
        storage=RemoteStorage(storage_options=S3Server.options(s3.endpoint)),
        decode="tensor",
        with_keys=True,
    )
    assert type(ds.storage).__name__ == "RemoteStorage"  # not the stateless local one
    loader = ShardLoader(ds, 4, num_workers=3)
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sorted(k for _, _, keys in loader for k in keys) == ALL_KEYS
    loader.close()
    assert _workers() == []
