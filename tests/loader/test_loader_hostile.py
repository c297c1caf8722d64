"""ShardLoader against callers and data that try to break it: what a caller does with a yielded
tensor, corrupt samples around a checkpoint, concurrent iteration, bad arguments, decompression
bombs and failing transforms. Each case here once gave wrong data, a hang or a raw error."""

from __future__ import annotations

import io
import os
import resource
import struct
import threading
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from shardkit import CenterCrop, Decode, Order, ShardDataset, ShardLoader, pack
from shardkit.errors import InputError, SampleError, ShardkitError, TransformError

pytestmark = pytest.mark.filterwarnings(
    "ignore:ShardDataset iterated epoch:RuntimeWarning", "ignore:skipped:RuntimeWarning"
)

N = 30
W, H = 16, 12


def _image(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (H, W, 3), dtype=np.uint8)


def _corrupt_jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_image(i)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    data[200:-2] = b"\x00" * (len(data) - 202)  # header intact, entropy data destroyed
    return bytes(data)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    for i in range(N):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_image(i)).save(d / f"im{i:02d}.jpg", quality=90)
    pack(str(base / "src"), str(base / "tar"), shard_size=20_000, progress=False)
    return str(base / "tar")


#: Samples whose entropy data is destroyed: undecodable, skipped under on_error="skip".
BAD = {3, 4, 11, 17, 22, 23, 24}


@pytest.fixture(scope="module")
def with_bad(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad")
    for i in range(N):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        if i in BAD:
            (d / f"im{i:02d}.jpg").write_bytes(_corrupt_jpeg(i))
        else:
            Image.fromarray(_image(i)).save(d / f"im{i:02d}.jpg", quality=90)
    pack(str(base / "src"), str(base / "tar"), shard_size=3000, on_error="skip", progress=False)
    return str(base / "tar")


def _ds(path, **kw):
    kw.setdefault("decode", "tensor")
    kw.setdefault("with_keys", True)
    return ShardDataset(path, **kw)


def _reference(path, **kw) -> dict[str, torch.Tensor]:
    return {k: img for img, _, k in _ds(path, **kw)}


def _assert_batch(x, keys, reference):
    assert len(x) == len(keys)
    for img, key in zip(x, keys, strict=True):
        assert torch.equal(img, reference[key]), f"stale pixels for {key}"


# --- what a caller may do with a yielded batch -------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_share_memory_on_a_batch_leaves_every_later_batch_correct(shards, workers):
    """share_memory_() moves a batch's storage to new memory: the slot must not be mistaken
    for free while it is still the loader's, nor kept forever."""
    reference = _reference(shards)
    moved = []
    loader = ShardLoader(_ds(shards), 2, num_workers=workers, prefetch_factor=1)
    for i, (x, _, keys) in enumerate(loader):
        _assert_batch(x, keys, reference)
        if i % 3 < 2:
            x.share_memory_()  # kept or dropped: either must leave later batches right
        if i % 3 == 0:
            moved.append((x, keys))
    for x, keys in moved:
        _assert_batch(x, keys, reference)
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_kept_storage_keeps_its_bytes(shards, workers):
    reference = _reference(shards)
    kept = []
    loader = ShardLoader(_ds(shards), 2, num_workers=workers, prefetch_factor=1)
    for x, _, keys in loader:
        kept.append((x.untyped_storage(), tuple(x.shape), keys))
    assert sum(len(k) for _, _, k in kept) == N
    for storage, shape, keys in kept:
        x = torch.empty(0, dtype=torch.uint8).set_(storage)[: int(np.prod(shape))].view(shape)
        _assert_batch(x, keys, reference)
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_numpy_views_and_slices_of_batches_keep_their_bytes(shards, workers):
    reference = _reference(shards)
    kept = []
    loader = ShardLoader(_ds(shards), 3, num_workers=workers, prefetch_factor=1)
    for x, _, keys in loader:
        kept.append((x[1:].numpy(), keys[1:]))
    for arr, keys in kept:
        _assert_batch(torch.from_numpy(arr), keys, reference)
    loader.close()


# --- resume with skipped samples ---------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1, 2, 3, 4])
def test_resume_after_skipped_samples_replays_nothing(with_bad, workers):
    good = sorted(f"c{i % 2}/im{i:02d}" for i in range(N) if i not in BAD)
    bs = 3
    full = ShardLoader(_ds(with_bad, on_error="skip"), bs, num_workers=workers)
    steps = len([1 for _ in full])
    full.close()
    for stop in range(1, steps):
        before = []
        loader = ShardLoader(_ds(with_bad, on_error="skip"), bs, num_workers=workers)
        for i, (_, _, keys) in enumerate(loader):
            before += keys
            if i + 1 == stop:
                break
        state = loader.state_dict()
        loader.close()
        resumed = ShardLoader(_ds(with_bad, on_error="skip"), bs, num_workers=workers)
        resumed.load_state_dict(state)
        after = [k for _, _, keys in resumed for k in keys]
        resumed.close()
        assert len(before) + len(after) == len(set(before + after)), f"replayed at {stop}"
        assert sorted(before + after) == good, f"lost samples at {stop}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workers", "drop_last", "bs"), [(2, False, 6), (2, True, 10), (0, True, 10)]
)
def test_a_part_ending_on_skipped_samples_warns_counts_and_ends_its_epoch(
    with_bad, workers, drop_last, bs
):
    """Worker parts (unshuffled, cut at whole batches) that end on skipped samples only, or on a
    short batch ``drop_last`` drops: every skipped sample is warned about and counted, and a
    checkpoint after the last batch continues with the next epoch."""
    ds = _ds(with_bad, on_error="skip", order=Order(shuffle=False))
    loader = ShardLoader(ds, bs, num_workers=workers, drop_last=drop_last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        images = sum(len(x) for x, _, _ in loader)
    state = loader.state_dict()
    loader.close()
    assert images == (20 if drop_last else N - len(BAD))  # 2 batches of 10, or every good one
    assert sum("skipped:" in str(w.message) for w in caught) == len(BAD) == ds.skipped
    resumed = _ds(with_bad, on_error="skip", order=Order(shuffle=False))
    resumed.load_state_dict(state)
    assert resumed.epoch == 1


# --- concurrent iteration ----------------------------------------------------------------------


def test_a_second_thread_iterating_the_same_loader_is_an_error_not_a_hang(shards):
    loader = ShardLoader(_ds(shards), 2, num_workers=2)
    started, go_on = threading.Event(), threading.Event()
    result: dict = {}

    def first():
        keys = []
        for i, (_, _, k) in enumerate(loader):
            keys += k
            if i == 0:
                started.set()
                go_on.wait(30)
        result["keys"] = keys

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(30)
    with pytest.raises(ShardkitError, match="another thread"):
        iter(loader)
    go_on.set()
    t.join(60)
    assert not t.is_alive()
    assert len(result["keys"]) == N  # the first iteration is whole
    assert sum(len(x) for x, _, _ in loader) == N  # and the loader works afterwards
    loader.close()


# --- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 2.0}, "batch_size"),
        ({"num_workers": 2.5}, "num_workers"),
        ({"num_workers": "2"}, "num_workers"),
        ({"prefetch_factor": 1.5}, "prefetch_factor"),
        ({"prefetch_factor": True}, "prefetch_factor"),
        ({"timeout": "5"}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"drop_last": "no"}, "drop_last"),
        ({"channels_last": 1}, "channels_last"),
    ],
)
def test_bad_arguments_are_input_errors_naming_the_argument(shards, kwargs, name):
    kwargs = {"batch_size": 4, **kwargs}
    bs = kwargs.pop("batch_size")
    with pytest.raises(InputError, match=rf"^{name}"):
        ShardLoader(_ds(shards), bs, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "value"),
    [("dataset", None), ("batch_size", 3), ("channels_last", True), ("drop_last", True)],
)
def test_a_setting_changed_under_running_workers_is_refused(shards, name, value):
    """The workers fill slots laid out from the loader's settings when they started: a loader
    given another dataset handed out the old one's samples, another batch size lost samples,
    channels_last garbled every image. Such a change is an InputError; the loader goes on."""
    reference = _reference(shards, order=Order(shuffle=False))
    loader = ShardLoader(_ds(shards, order=Order(shuffle=False)), 4, num_workers=2)
    list(loader)
    if name == "dataset":
        value = _ds(shards, order=Order(shuffle=False), rank=1, world_size=2)
    with pytest.raises(InputError, match=rf"ShardLoader\.{name} cannot change"):
        setattr(loader, name, value)
    seen = 0
    for x, _, keys in loader:
        _assert_batch(x, keys, reference)
        seen += len(keys)
    assert seen == N and len(loader) == 8
    loader.close()


def test_a_ring_over_the_descriptor_limit_is_refused_naming_the_setting(shards):
    def fds():
        return len(os.listdir("/proc/self/fd"))

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 400), hard))
    try:
        ds = _ds(shards)
        before = fds()
        for _ in range(3):
            loader = ShardLoader(ds, 2, num_workers=2, prefetch_factor=1000)
            with pytest.raises(InputError, match=r"prefetch_factor=1000.*descriptor.*400"):
                iter(loader)
            loader.close()
        assert fds() == before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_failing_worker_start_leaks_no_descriptor(shards):
    """spawn pickles the dataset: a lambda transform cannot travel, every time."""
    ds = _ds(shards, transform=lambda img: img)
    before = None
    for _ in range(4):  # the first start opens multiprocessing's own resource tracker, once
        loader = ShardLoader(ds, 2, num_workers=2, start_method="spawn")
        with pytest.raises(Exception, match="pickle|lambda"):
            iter(loader)
        with pytest.raises(Exception, match="pickle|lambda"):
            iter(loader)  # retried on the same loader
        loader.close()
        before = before or len(os.listdir("/proc/self/fd"))
    assert len(os.listdir("/proc/self/fd")) == before


# --- transforms --------------------------------------------------------------------------------


class _Unpicklable(Exception):
    def __init__(self, msg, handle):
        super().__init__(msg)
        self.handle = handle

    def __reduce__(self):
        raise TypeError("cannot pickle this")


def _failing(img):
    raise ValueError("bad augmentation")


def _unpicklable(img):
    raise _Unpicklable("held a lock", threading.Lock())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_error_names_shard_and_key_and_keeps_its_type(shards, workers):
    ds = _ds(shards, transform=_failing, on_error="skip", order=Order(shuffle=False))
    with pytest.raises(TransformError, match=r"shard-\d+\.tar: sample 'c\d/im\d+'") as info:
        list(ShardLoader(ds, 4, num_workers=workers))
    err = info.value
    assert err.key and err.shard.endswith(".tar")
    assert "ValueError: bad augmentation" in str(err)
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "bad augmentation"
    assert ds.skipped == 0


def test_an_unpicklable_transform_error_still_names_its_type(shards):
    ds = _ds(shards, transform=_unpicklable)
    with pytest.raises(TransformError, match=r"sample 'c\d/im\d+'.*_Unpicklable: held a lock"):
        list(ShardLoader(ds, 4, num_workers=2))


# --- decompression bombs -----------------------------------------------------------------------


def _declaring(width: int, height: int) -> bytes:
    """A small JPEG whose header declares ``width`` x ``height``."""
    buf = io.BytesIO()
    Image.fromarray(_image(0)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    base = tmp_path_factory.mktemp("bomb")
    d = base / "src" / "c"
    d.mkdir(parents=True)
    (d / "a0.jpg").write_bytes(_declaring(60000, 60000))
    for i in range(1, 6):
        Image.fromarray(_image(i)).save(d / f"b{i}.jpg")
    pack(str(base / "src"), str(base / "tar"), progress=False, on_error="skip")
    return str(base / "tar")


@pytest.mark.parametrize("size", [None, 8])
def test_a_decompression_bomb_is_refused_from_its_header(bomb, size):
    decode = Decode("tensor", crop=None if size is None else CenterCrop(size, size))
    ds = _ds(bomb, decode=decode, order=Order(shuffle=False))
    with pytest.raises(SampleError, match=r"'c/a0'.*60000x60000.*max_pixels="):
        list(ShardLoader(ds, 2, num_workers=0))
    with pytest.raises(SampleError, match=r"60000x60000.*max_pixels="):
        list(ds)  # the same decoder without the loader
    skipping = _ds(
        bomb,
        decode=decode,
        order=Order(shuffle=False),
        on_error="skip",
    )
    keys = [k for _, _, ks in ShardLoader(skipping, 2, num_workers=0) for k in ks]
    assert "c/a0" not in keys and len(keys) == 5 and skipping.skipped == 1


def test_the_pixel_limit_is_adjustable(shards):
    with pytest.raises(SampleError, match=r"16x12 = 192 pixels.*max_pixels=100"):
        list(ShardLoader(_ds(shards, decode=Decode("tensor", max_pixels=100)), 4, num_workers=0))
    assert (
        sum(
            len(x)
            for x, _, _ in ShardLoader(_ds(shards, decode=Decode("tensor", max_pixels=192)), 4)
        )
        == N
    )
    with pytest.raises(InputError, match="max_pixels"):
        _ds(shards, decode=Decode("tensor", max_pixels=0))


# --- shards changed under a running dataset ----------------------------------------------------


def test_a_shard_replaced_by_another_pack_mid_epoch_is_an_error_naming_it(tmp_path):
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(12):
        Image.fromarray(_image(i)).save(src / f"im{i:02d}.jpg")
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), shard_size=4000, progress=False)
    ds = _ds(str(tmp_path / "tar"), order=Order(shuffle=False))  # read shard by shard
    loader = ShardLoader(ds, 2, num_workers=0)
    it = iter(loader)
    next(it)
    for i in range(12, 20):  # more images: the same shard names hold other bytes now
        Image.fromarray(_image(i)).save(src / f"im{i:02d}.jpg")
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), shard_size=4000, progress=False,
         overwrite=True)  # fmt: skip
    with pytest.raises(ShardkitError, match=r"manifest\.json: the dataset was re-packed"):
        for _ in it:
            pass
    loader.close()


def test_a_shard_of_another_size_than_its_manifest_says_is_an_error_naming_it(tmp_path):
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(12):
        Image.fromarray(_image(i)).save(src / f"im{i:02d}.jpg")
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), shard_size=4000, progress=False)
    last = sorted((tmp_path / "tar").glob("shard-*.tar"))[-1]
    last.write_bytes(last.read_bytes() + bytes(10240))  # a shard swapped in, manifest kept
    longer = rf"{last.name}: \d+ bytes, longer than its manifest says"
    with pytest.raises(ShardkitError, match=longer):
        list(ShardLoader(_ds(str(tmp_path / "tar"), order=Order(shuffle=False)), 2, num_workers=0))


@pytest.fixture(scope="module")
def lmdb_one_shard(tmp_path_factory):
    """60 images in one LMDB shard (a worker reads it front to back, a few batches ahead)."""
    base = tmp_path_factory.mktemp("lmdb")
    for i in range(60):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_image(i)).save(d / f"im{i:02d}.jpg")
    pack(str(base / "src"), str(base / "lmdb"), format="lmdb", progress=False)
    return str(base / "lmdb")


@pytest.mark.slow  # worker processes
def test_an_lmdb_shard_truncated_under_a_worker_is_an_error_naming_it(lmdb_one_shard, tmp_path):
    import shutil

    out = shutil.copytree(lmdb_one_shard, tmp_path / "ds")
    shard = out / "shard-000000.lmdb"
    loader = ShardLoader(
        _ds(str(out), order=Order(shuffle=False)), 2, num_workers=1, prefetch_factor=1
    )
    it = iter(loader)
    next(it)  # the worker holds the shard open, a few batches ahead
    os.truncate(shard, shard.stat().st_size // 3)
    with pytest.raises(
        ShardkitError, match=r"shard-000000\.lmdb: the LMDB shard changed .*truncated"
    ):
        for _ in it:
            pass
    loader.close()


@pytest.mark.slow  # worker processes
def test_lmdb_shards_open_in_the_training_process_read_in_forked_workers(lmdb_one_shard):
    from torch.utils.data import DataLoader

    from shardkit import ShardView

    view = ShardView(lmdb_one_shard, decode="raw", with_keys=True)
    first = view[0][2]  # a reader open here
    ds = _ds(lmdb_one_shard, order=Order(shuffle=False))
    next(iter(ds))  # and a stream, left open
    loader = ShardLoader(ds, 4, num_workers=2, start_method="fork")
    assert sorted(k for *_, keys in loader for k in keys) == sorted(view.keys())
    loader.close()
    plain = ShardDataset(lmdb_one_shard, decode="raw", with_keys=True, order=Order(shuffle=False))
    dl = DataLoader(plain, batch_size=None, num_workers=2, multiprocessing_context="fork")
    keys = [k for _, _, k in dl]
    assert sorted(keys) == sorted(view.keys()) and len(keys) == 60
    assert view[0][2] == first


# --- CUDA (skipped without a GPU) ----------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_batches_are_right_whatever_the_caller_keeps(shards, workers):
    """A slot goes back once its copy's event completed: batches kept on the device, moved back
    and shared, or dropped, all hold the right pixels, and no slot is overwritten mid-copy."""
    reference = _reference(shards)
    kept = []
    loader = ShardLoader(_ds(shards), 2, num_workers=workers, prefetch_factor=1, device="cuda")
    for i, (x, _, keys) in enumerate(loader):
        assert x.is_cuda
        if i % 2:
            kept.append((x, keys))
        else:
            cpu = x.cpu()
            cpu.share_memory_()
            _assert_batch(cpu, keys, reference)
    torch.cuda.synchronize()
    for x, keys in kept:
        _assert_batch(x.cpu(), keys, reference)
    loader.close()
