"""ShardDataset and FolderDataset through real DataLoader worker processes."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tarfile
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, get_worker_info

from shardkit import CenterCrop, Decode, Order, RandomResizedCrop, Source
from shardkit.errors import InputError, SampleError, ShardFormatError, StorageError
from shardkit.formats import get_format
from shardkit.stream.dataset import FolderDataset, ShardDataset
from shardkit.stream.storage import LocalStorage, url_of
from shardkit.write.packer import pack

# Two cores are enough: three workers are deliberate (fewer shards than workers).
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 22  # not divisible by 2 or 3, so pad and drop differ


@pytest.fixture(scope="module")
def data(packed_tree):
    """A 22-image tree, packed as several tar shards, several LMDB shards and one tar shard."""
    out = packed_tree(N, 3, {"tar": 12000, "lmdb": 12000})
    out["one"] = os.path.join(os.path.dirname(out["src"]), "one")
    pack(out["src"], out["one"], shard_size=10**9, progress=False)
    return out


ALL_KEYS = sorted(f"class{i % 3}/img{i:03d}" for i in range(N))


def _keys(ds, num_workers=0, batch_size=4, **loader_kw):
    loader = DataLoader(ds, batch_size=batch_size, num_workers=num_workers, **loader_kw)
    return [k for batch in loader for k in batch[2]]


def test_shape_of_the_data(data):
    assert len(os.listdir(data["tar"])) >= 5  # several shards plus manifest
    assert sorted(os.listdir(data["one"])) == [
        "manifest.json",
        "manifest.keys",  # its key file (growth reads it)
        "shard-000000.tar",
        "shard-000000.tar.idx",  # its sample index
    ]


# --- exactly once -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_every_sample_once_per_epoch_for_any_worker_count(data, fmt, num_workers):
    ds = ShardDataset(data[fmt], with_keys=True, decode="raw", order=Order(buffer_size=5))
    keys = _keys(ds, num_workers)
    assert sorted(keys) == ALL_KEYS
    assert len(ds) == N


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("equalize", ["pad", "drop", "none"])
def test_simulated_ranks_split_the_epoch(data, world_size, equalize):
    per_rank = []
    for rank in range(world_size):
        ds = ShardDataset(
            data["tar"],
            with_keys=True,
            decode="raw",
            order=Order(equalize=equalize),
            rank=rank,
            world_size=world_size,
            seed=7,
        )
        ds.set_epoch(3)
        keys = _keys(ds)
        assert len(keys) == len(ds)
        per_rank.append(keys)
    counts = Counter(k for keys in per_rank for k in keys)
    lens = [len(k) for k in per_rank]
    if equalize == "pad":
        assert lens == [-(-N // world_size)] * world_size
        assert sorted(counts) == ALL_KEYS
        assert sum(counts.values()) - N == lens[0] * world_size - N
    elif equalize == "drop":
        assert lens == [N // world_size] * world_size
        assert set(counts.values()) == {1}
    else:
        assert sorted(counts.elements()) == ALL_KEYS
        assert max(lens) - min(lens) <= 1


def test_ranks_with_workers_cover_everything_once(data):
    keys = []
    for rank in range(2):
        ds = ShardDataset(
            data["lmdb"],
            with_keys=True,
            decode="raw",
            order=Order(equalize="none"),
            rank=rank,
            world_size=2,
        )
        keys += _keys(ds, num_workers=2)
    assert sorted(keys) == ALL_KEYS


def _worker_id(img):
    return get_worker_info().id


def test_one_shard_three_workers_all_yield(data):
    ds = ShardDataset(data["one"], with_keys=True, decode="raw", transform=_worker_id)
    loader = DataLoader(ds, batch_size=None, num_workers=3)
    seen = list(loader)
    assert sorted(k for _, _, k in seen) == ALL_KEYS
    per_worker = Counter(w for w, _, _ in seen)
    assert sorted(per_worker.values()) == [7, 7, 8]


@pytest.mark.slow  # spawned worker interpreters
def test_spawned_persistent_workers_follow_set_epoch(data):
    ds = ShardDataset(data["tar"], with_keys=True, decode="tensor", order=Order(buffer_size=4))
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
    )
    orders = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        orders.append([k for batch in loader for k in batch[2]])
    assert sorted(orders[0]) == sorted(orders[1]) == ALL_KEYS
    assert orders[0] != orders[1]


def test_dataset_pickles_without_open_handles(data):
    ds = ShardDataset(data["lmdb"], with_keys=True, decode="raw")
    list(ds)  # having iterated leaves nothing open in the object
    clone = pickle.loads(pickle.dumps(ds))
    clone.set_epoch(1)
    assert sorted(k for _, _, k in clone) == ALL_KEYS


# --- epochs and order ---------------------------------------------------------------------------


def test_orders_change_with_epoch_and_repeat_with_seed(data):
    def order(seed, epoch, workers=0):
        ds = ShardDataset(
            data["tar"], with_keys=True, decode="raw", seed=seed, order=Order(buffer_size=4)
        )
        ds.set_epoch(epoch)
        return _keys(ds, workers)

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    assert order(1, 2, workers=2) == order(1, 2, workers=2)


def test_shard_to_worker_assignment_changes_between_epochs(data):
    ds = ShardDataset(data["tar"], decode="raw")
    from shardkit.stream.world import World

    plans = {e: ds.plan(World(0, 1, 0, 2), epoch=e) for e in range(4)}
    assert len({tuple(p) for p in plans.values()}) > 1


def test_set_epoch_reaches_persistent_workers(data):
    ds = ShardDataset(data["tar"], with_keys=True, decode="raw", order=Order(buffer_size=4))
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in (0, 1, 0):
        ds.set_epoch(epoch)
        orders.append([k for batch in loader for k in batch[2]])
    assert all(sorted(o) == ALL_KEYS for o in orders)
    assert orders[0] != orders[1]
    assert orders[0] == orders[2]


def test_repeating_an_epoch_warns_once(data):
    ds = ShardDataset(data["tar"], decode="raw")
    list(ds)
    with pytest.warns(RuntimeWarning, match="set_epoch"):
        list(ds)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(ds)  # only once
        ds.set_epoch(1)
        list(ds)


def test_peeking_at_a_sample_before_iterating_warns_of_no_repeat(data):
    from shardkit.loader import ShardLoader

    ds = ShardDataset(data["tar"], decode=Decode("tensor", crop=CenterCrop(16, 16)))
    next(iter(ds))  # a look at one sample
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(ds)
        ds.set_epoch(1)
        next(iter(ds))
        assert sum(len(b[0]) for b in ShardLoader(ds, batch_size=4, num_workers=0)) == len(ds)
    with pytest.warns(RuntimeWarning, match="set_epoch"):
        list(ShardLoader(ds, batch_size=4, num_workers=0))  # epoch 1 read whole: now a repeat


def test_without_shuffle_the_order_is_the_packed_order(data):
    ds = ShardDataset(data["tar"], with_keys=True, decode="raw", order=Order(shuffle=False))
    fmt = get_format("tar")
    packed = [r.key for url in ds.urls for r in fmt.iter_records(url)]
    assert [k for _, _, k in ds] == packed
    ds.set_epoch(5)
    assert [k for _, _, k in ds] == packed


# --- samples ------------------------------------------------------------------------------------


def test_decode_modes_and_transforms(data):
    ds = ShardDataset(data["tar"], decode="pil")
    img, label = next(iter(ds))
    assert isinstance(img, Image.Image) and img.mode == "RGB" and isinstance(label, int)
    img, label = next(iter(ShardDataset(data["tar"], decode="tensor")))
    assert img.dtype == torch.uint8 and tuple(img.shape) == (3, 6, 8)
    img, label = next(iter(ShardDataset(data["tar"], decode="raw")))
    assert isinstance(img, bytes) and img[:3] == b"\xff\xd8\xff"
    ds = ShardDataset(
        data["tar"],
        decode="tensor",
        transform=lambda t: t.float() / 255,
        target_transform=lambda y: y + 100,
    )
    img, label = next(iter(ds))
    assert img.dtype == torch.float32 and label >= 100


def test_labels_follow_the_manifest_classes(data):
    ds = ShardDataset(data["lmdb"], with_keys=True, decode="raw")
    assert ds.classes == ["class0", "class1", "class2"]
    for _, label, key in ds:
        assert ds.classes[label] == key.split("/")[0]


def test_lmdb_and_tar_give_the_same_samples(data):
    def by_key(fmt):
        ds = ShardDataset(data[fmt], with_keys=True, decode="tensor")
        return {k: (img, y) for img, y, k in ds}

    a, b = by_key("tar"), by_key("lmdb")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k][0], b[k][0]) and a[k][1] == b[k][1]


def test_bad_arguments(data):
    with pytest.raises(InputError, match="decode"):
        ShardDataset(data["tar"], decode="numpy")
    with pytest.raises(InputError, match="equalize"):
        ShardDataset(data["tar"], order=Order(equalize="even"))
    with pytest.raises(InputError, match="on_error"):
        ShardDataset(data["tar"], on_error="ignore")
    with pytest.raises(InputError, match="cannot give each of 30 ranks"):
        ShardDataset(data["tar"], order=Order(equalize="drop"), rank=0, world_size=30)


# --- foreign tars -------------------------------------------------------------------------------


def _jpeg(i):
    buf = io.BytesIO()
    Image.new("RGB", (5, 5), (i, i, i)).save(buf, "JPEG")
    return buf.getvalue()


def test_webdataset_written_tars_stream_without_manifest(tmp_path):
    import webdataset as wds

    for s in range(3):
        with wds.TarWriter(str(tmp_path / f"part-{s}.tar")) as sink:
            for i in range(5):
                sink.write({"__key__": f"s{s}_{i:02d}", "jpg": _jpeg(i), "cls": i % 2})
    ds = ShardDataset(str(tmp_path / "part-{0..2}.tar"), with_keys=True, decode="tensor")
    assert len(ds) == 15 and ds.classes is None
    seen = _keys(ds, num_workers=2)
    assert sorted(seen) == sorted(f"s{s}_{i:02d}" for s in range(3) for i in range(5))
    ds.set_epoch(1)
    labels = {k: y for _, y, k in ds}
    assert labels["s1_03"] == 1 and labels["s2_04"] == 0


def test_pax_tars_from_tarfile_stream(tmp_path):
    path = tmp_path / "pax.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(4):
            for ext, payload in (("jpg", _jpeg(i)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"dir/ünïcode_{i}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    ds = ShardDataset(str(path), with_keys=True, decode="raw", order=Order(shuffle=False))
    assert [(y, k) for _, y, k in ds] == [(i, f"dir/ünïcode_{i}") for i in range(4)]


# --- errors -------------------------------------------------------------------------------------


@pytest.fixture
def corrupt(tmp_path):
    fmt = get_format("tar")
    w = fmt.open_writer(str(tmp_path / "shard-000000.tar"))
    for i in range(6):
        data = b"\xff\xd8\xff garbage" if i == 3 else _jpeg(i)
        w.add(f"k{i}", "jpg", data, 0)
    w.close()
    return str(tmp_path / "shard-000000.tar")


def test_corrupt_sample_raises_naming_shard_and_key(corrupt):
    ds = ShardDataset(corrupt, decode="tensor")
    with pytest.raises(SampleError, match=r"shard-000000\.tar.*'k3'") as info:
        list(ds)
    assert info.value.key == "k3" and info.value.shard.endswith("shard-000000.tar")
    # Through worker processes the error still names both.
    with pytest.raises(SampleError, match=r"shard-000000\.tar.*'k3'"):
        list(DataLoader(ds, num_workers=1))


def test_corrupt_sample_skipped_and_counted_across_workers(corrupt):
    ds = ShardDataset(corrupt, decode="tensor", on_error="skip", with_keys=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    keys = [k for _, _, k in loader]
    assert sorted(keys) == ["k0", "k1", "k2", "k4", "k5"]
    assert ds.skipped == 1
    ds.set_epoch(1)
    with pytest.warns(RuntimeWarning, match="k3"):
        list(ds)
    assert ds.skipped == 2


@pytest.mark.parametrize(
    ("kw", "shape"),
    [
        ({"decode": "pil"}, (64, 48)),
        ({"decode": "tensor"}, (3, 48, 64)),
        ({"decode": Decode(crop=CenterCrop(16, 16))}, (3, 16, 16)),
        ({"decode": Decode(crop=RandomResizedCrop(16))}, (3, 16, 16)),
    ],
)
def test_damaged_entropy_data_decodes_on_every_path_and_truncation_raises(tmp_path, kw, shape):
    """As docs/stream.md says: a JPEG whose entropy-coded data is damaged but parses decodes on
    every path (TurboJPEG refuses it, Pillow decodes it); a truncated one is a SampleError."""
    good = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(good, "JPEG")
    good = good.getvalue()
    damaged = bytearray(good)
    damaged[len(good) // 2 : len(good) // 2 + 4] = b"\xff\xd0\xff\xd1"
    src = str(tmp_path / "shard-000000.tar")
    w = get_format("tar").open_writer(src)
    w.add("damaged", "jpg", bytes(damaged), 0)
    w.add("cut", "jpg", good[: len(good) // 2], 0)
    w.close()
    ((image, _),) = list(ShardDataset(Source(src, subset=["damaged"]), **kw))
    assert (image.size if kw["decode"] == "pil" else tuple(image.shape)) == shape
    with pytest.raises(SampleError, match=r"shard-000000\.tar.*'cut'"):
        list(ShardDataset(Source(src, subset=["cut"]), **kw))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_truncated_tar_is_detected(data, tmp_path):
    d = _copy(data["tar"], tmp_path / "t")
    shard = os.path.join(d, "shard-000001.tar")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 1500)  # mid-member, end-of-archive gone
    ds = ShardDataset(d, decode="raw", order=Order(shuffle=False))
    with pytest.raises(ShardFormatError, match="shard-000001.tar"):
        list(ds)
    with pytest.raises(ShardFormatError, match="shard-000001.tar"):
        list(DataLoader(ds, num_workers=2))


def test_shard_shorter_than_its_manifest_is_not_a_short_epoch(data, tmp_path):
    d = _copy(data["tar"], tmp_path / "t")
    # Replace shard 1 by a complete, valid tar holding one sample fewer than the manifest says.
    shard = os.path.join(d, "shard-000001.tar")
    fmt = get_format("tar")
    records = list(fmt.iter_records(shard))
    os.unlink(shard)
    w = fmt.open_writer(shard)
    for r in records[:-1]:
        w.add(r.key, r.ext, r.data, r.label)
    w.close()
    with pytest.raises(ShardFormatError, match="shard-000001.tar.*shorter than its manifest"):
        list(ShardDataset(d, decode="raw", order=Order(shuffle=False)))


def test_missing_shard(data, tmp_path):
    with pytest.raises(InputError, match=r"shard-0000\d\d\.tar: shard not found \(and \d+ more"):
        ShardDataset(os.path.join(data["tar"], "shard-{000000..000099}.tar"))
    d = _copy(data["tar"], tmp_path / "t")
    ds = ShardDataset(d, decode="raw")
    os.unlink(os.path.join(d, "shard-000002.tar"))
    with pytest.raises(StorageError, match=r"shard-000002\.tar"):
        list(ds)


def test_unreadable_lmdb_shard(data, tmp_path):
    d = _copy(data["lmdb"], tmp_path / "l")
    with open(os.path.join(d, "shard-000000.lmdb"), "wb") as f:
        f.write(b"not an lmdb file")
    with pytest.raises(ShardFormatError, match=r"shard-000000\.lmdb"):
        list(ShardDataset(d, decode="raw"))


# --- storage ------------------------------------------------------------------------------------


class _CountingStorage(LocalStorage):
    opened: list

    def __init__(self):
        super().__init__()
        self.opened = []

    def open(self, shard):
        self.opened.append(url_of(shard))
        return super().open(shard)


def test_shards_are_opened_through_the_given_storage(data):
    storage = _CountingStorage()
    ds = ShardDataset(data["tar"], decode="raw", storage=storage, order=Order(shuffle=False))
    assert storage.opened == []  # manifest counts: nothing opened to plan
    list(ds)
    assert storage.opened == list(ds.urls)


def test_foreign_shards_are_counted_once_at_construction(data, tmp_path):
    d = tmp_path / "nomanifest"
    d.mkdir()
    for name in os.listdir(data["tar"]):
        if name.endswith(".tar"):
            shutil.copy(os.path.join(data["tar"], name), d)
    storage = _CountingStorage()
    ds = ShardDataset(str(d), decode="raw", storage=storage)
    assert len(ds) == N and len(storage.opened) == len(ds.urls)
    storage.opened.clear()
    list(ds)
    assert len(storage.opened) == len(ds.urls)  # reading only, no recount


# --- FolderDataset ------------------------------------------------------------------------------


def test_folder_dataset_with_workers(data):
    ds = FolderDataset(data["src"], decode="raw", with_keys=True)
    assert ds.classes == ["class0", "class1", "class2"]
    assert len(ds) == N
    loader = DataLoader(ds, batch_size=4, num_workers=2, shuffle=True)
    keys = [k for batch in loader for k in batch[2]]
    assert sorted(keys) == sorted(k + ".jpg" for k in ALL_KEYS)


def test_folder_dataset_keeps_paths_in_numpy_arrays(data):
    ds = FolderDataset(data["src"])
    assert isinstance(ds.path_bytes, np.ndarray) and ds.path_bytes.dtype == np.uint8
    assert isinstance(ds.offsets, np.ndarray) and ds.offsets.dtype == np.int64
    assert isinstance(ds.targets, np.ndarray)
    big = [v for v in vars(ds).values() if isinstance(v, (list, tuple, dict)) and len(v) >= N]
    assert big == []
    assert ds.relpath(0) == "class0/img000.jpg"


def test_folder_and_shards_decode_identically(data):
    folder = FolderDataset(data["src"], decode="tensor", with_keys=True)
    shards = ShardDataset(data["tar"], decode="tensor", with_keys=True)
    a = {k[: -len(".jpg")]: (img, y) for img, y, k in (folder[i] for i in range(len(folder)))}
    b = {k: (img, y) for img, y, k in shards}
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k][0], b[k][0]) and a[k][1] == b[k][1]


def test_folder_dataset_errors(tmp_path):
    with pytest.raises(InputError, match="not a directory"):
        FolderDataset(str(tmp_path / "nope"))
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(InputError, match="no images"):
        FolderDataset(str(tmp_path / "empty"))
    bad = tmp_path / "bad" / "cls"
    bad.mkdir(parents=True)
    (bad / "x.jpg").write_bytes(b"\xff\xd8\xff nope")
    with pytest.raises(SampleError, match=r"x\.jpg"):
        FolderDataset(str(tmp_path / "bad"))[0]


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_url_sources_stream_through_remote_storage(data, fmt):
    ds = ShardDataset(f"file://{data[fmt]}", with_keys=True, decode="raw")
    assert type(ds.storage).__name__ == "RemoteStorage"
    assert all(u.startswith("file://") for u in ds.urls) and len(ds) == N
    assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS


@pytest.mark.filterwarnings("ignore:retired keyword:FutureWarning")  # the old keywords
def test_remote_options_are_checked_and_sizes_accepted(data):
    with pytest.raises(InputError, match="prefetch=-1"):
        ShardDataset(data["tar"], prefetch=-1)
    with pytest.raises(InputError, match="cache_limit='lots'"):
        ShardDataset(data["tar"], cache_limit="lots")
    with pytest.raises(InputError, match="cache_dir= and storage= both set one option group"):
        ShardDataset(data["tar"], storage=LocalStorage(), cache_dir="/tmp/x")
    ds = ShardDataset(data["tar"], cache_limit="1GB", prefetch=0)  # local: options unused
    assert isinstance(ds.storage, LocalStorage) and len(ds) == N
