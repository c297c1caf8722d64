"""ShardLoader with the dataset's fields=: a dict per batch (image, label, key and one list per
field, decoded in the workers), the same values as the dataset gives, with every guarantee."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from shardkit import CenterCrop, Decode, Order, RandomResizedCrop, ShardDataset, ShardLoader, pack
from shardkit.errors import InputError, SampleError
from shardkit.images.device import device_decode_available

pytestmark = [
    pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:skipped:RuntimeWarning"),
]

N = 14
NO_CAPTION = "c1/im05"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Images with a caption (.txt) and metadata (.json) beside each; one caption is missing."""
    base = tmp_path_factory.mktemp("fields")
    for i in range(N):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(
            d / f"im{i:02d}.jpg"
        )
        if f"c{i % 2}/im{i:02d}" != NO_CAPTION:
            (d / f"im{i:02d}.txt").write_text(f"a photo number {i}")
        (d / f"im{i:02d}.json").write_text(json.dumps({"i": i, "tags": ["x"] * (i % 3)}))
    pack(str(base / "src"), str(base / "tar"), shard_size=6000, progress=False)
    return str(base / "tar")


def _expected(key: str) -> tuple[str, dict]:
    i = int(key[-2:])
    return f"a photo number {i}", {"i": i, "tags": ["x"] * (i % 3)}


def _ds(path, **kw):
    kw.setdefault("decode", "tensor")
    kw.setdefault("with_keys", True)
    kw.setdefault("fields", ("txt", "json"))
    kw.setdefault("on_error", "skip")
    return ShardDataset(path, **kw)


def _check(batch, images_by_key=None):
    assert set(batch) == {"image", "label", "key", "txt", "json"}
    assert len(batch["image"]) == len(batch["key"]) == len(batch["txt"]) == len(batch["json"])
    for j, key in enumerate(batch["key"]):
        assert (batch["txt"][j], batch["json"][j]) == _expected(key)
        if images_by_key is not None:
            assert torch.equal(batch["image"][j], images_by_key[key])


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_dicts_of_images_and_decoded_fields(shards, workers):
    ds = _ds(shards)
    reference = {k: x for x, _, k, _, _ in _ds(shards)}
    keys = []
    loader = ShardLoader(ds, 4, num_workers=workers)
    for batch in loader:
        _check(batch, reference)
        keys += batch["key"]
    assert sorted(keys) == sorted(reference) and NO_CAPTION not in keys
    assert ds.skipped == 1  # the sample without its caption, counted
    loader.close()


def test_a_missing_field_names_shard_and_key(shards):
    ds = _ds(shards, on_error="raise", order=Order(shuffle=False))
    with pytest.raises(SampleError, match=rf"shard-\d+\.tar: sample '{NO_CAPTION}' has no 'txt'"):
        list(ShardLoader(ds, 4, num_workers=2))


def test_collate_shapes_the_batch(shards):
    loader = ShardLoader(_ds(shards), 4, num_workers=0, collate=lambda b: (b["image"], b["txt"]))
    for images, captions in loader:
        assert images.dtype == torch.uint8 and all(c.startswith("a photo") for c in captions)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_with_fields_replays_nothing(shards, workers):
    before = []
    loader = ShardLoader(_ds(shards), 3, num_workers=workers)
    for i, batch in enumerate(loader):
        before += batch["key"]
        if i == 1:
            break
    state = loader.state_dict()
    loader.close()
    resumed = ShardLoader(_ds(shards), 3, num_workers=workers)
    resumed.load_state_dict(state)
    after = []
    for batch in resumed:
        _check(batch)
        after += batch["key"]
    resumed.close()
    assert len(before + after) == len(set(before + after)) == N - 1


@pytest.mark.skipif(not device_decode_available(), reason="needs nvImageCodec (shardkit[gpu])")
def test_fields_travel_with_device_decoded_batches(shards):
    ds = _ds(shards, decode=Decode(crop=CenterCrop(8, 8)))
    loader = ShardLoader(ds, 4, num_workers=2, decode_on="device")
    keys = []
    for batch in loader:
        _check(batch)
        keys += batch["key"]
    assert len(keys) == N - 1
    loader.close()


# --- masks: cut with their image in the workers --------------------------------------------------


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    """Images of two sizes with a position-coded palette mask each; one mask of the wrong size."""
    base = tmp_path_factory.mktemp("masks")
    for i in range(10):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        w, h = (40, 30) if i % 3 else (36, 48)
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"m{i}.jpg")
        y, x = np.mgrid[0:h, 0:w]
        mask = ((x * 7 + y * 13) % 251).astype(np.uint8)
        if i == 6:
            mask = mask[:, :-1]  # a mask that is not its image's size
        Image.fromarray(mask).save(d / f"m{i}.seg.png")
    pack(str(base / "src"), str(base / "tar"), progress=False)
    return str(base / "tar")


@pytest.mark.parametrize("workers", [0, 2])
def test_masks_are_cut_resized_and_flipped_with_their_image(masked, workers):
    kw = dict(
        decode=Decode(crop=RandomResizedCrop(16), flip=True),
        fields=("seg.png",),
        seed=3,
        on_error="skip",
    )
    reference = {k: (x, m) for x, _, k, m in _ds(masked, **kw)}  # the dataset's own geometry
    assert len(reference) == 9  # the wrong-size mask was skipped
    ds = _ds(masked, **kw)
    loader = ShardLoader(ds, 4, num_workers=workers)
    seen = 0
    for batch in loader:
        masks = batch["seg.png"]
        assert masks.dtype == torch.uint8 and masks.shape == (len(batch["key"]), 1, 16, 16)
        for j, key in enumerate(batch["key"]):
            assert torch.equal(batch["image"][j], reference[key][0])
            assert torch.equal(masks[j], reference[key][1])
            seen += 1
    assert seen == 9 and ds.skipped == 1
    loader.close()


def test_a_mask_of_another_size_than_its_image_names_the_sample(masked):
    ds = _ds(
        masked,
        decode=Decode(crop=CenterCrop(16, 16)),
        order=Order(shuffle=False),
        fields=("seg.png",),
        on_error="raise",
    )
    with pytest.raises(SampleError, match=r"sample 'c0/m6'.*'seg.png'"):
        list(ShardLoader(ds, 4, num_workers=0))


def _jitter(sample: dict) -> dict:
    """A whole-sample transform: the image brightened by an amount drawn from the sample's seed,
    its caption upper-cased, the metadata and the seed passed on."""
    g = torch.Generator().manual_seed(sample["seed"])
    gain = int(torch.randint(0, 40, (1,), generator=g))
    image = (sample["image"].int() + gain).clamp(0, 255).to(torch.uint8)
    return {"image": image, "caption": sample["txt"].upper(), "meta": sample["json"],
            "key": sample["key"], "seed": sample["seed"]}  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_transform_runs_in_the_workers_and_its_outputs_are_batched(shards, workers):
    kw = dict(decode=Decode(crop=RandomResizedCrop(8)), seed=2, sample_transform=_jitter)
    reference = {s["key"]: s for s in _ds(shards, **kw)}  # the dataset's own samples
    loader = ShardLoader(_ds(shards, **kw), 4, num_workers=workers)
    keys = []
    for batch in loader:
        assert set(batch) == {"image", "caption", "meta", "key", "seed"}
        n = len(batch["key"])
        assert batch["image"].shape == (n, 3, 8, 8) and batch["image"].dtype == torch.uint8
        assert isinstance(batch["caption"], list)
        assert batch["seed"].dtype == torch.int64  # numbers batch as DataLoader's collate does
        for j, key in enumerate(batch["key"]):
            ref = reference[key]
            assert torch.equal(batch["image"][j], ref["image"])
            assert (batch["caption"][j], batch["meta"][j]) == (ref["caption"], ref["meta"])
            assert int(batch["seed"][j]) == ref["seed"]
        keys += batch["key"]
    assert sorted(keys) == sorted(reference) and len(keys) == N - 1
    loader.close()


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_normalize_and_channels_last_apply_to_sample_transform_batches(shards, workers):
    """They were ignored: uint8 batches came back, no warning. The image column ("image")
    is normalised and laid out as for plain batches; its other columns are as they were."""
    kw = dict(decode=Decode(crop=RandomResizedCrop(8)), seed=2, sample_transform=_jitter)
    plain = {k: b for b in ShardLoader(_ds(shards, **kw), 4) for k, b in _by_key(b)}
    loader = ShardLoader(
        _ds(shards, **kw), 4, num_workers=workers, normalize=(MEAN, STD), channels_last=True
    )
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    seen = 0
    for batch in loader:
        images = batch["image"]
        assert images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last)
        for j, key in enumerate(batch["key"]):
            want = (plain[key]["image"].float() / 255 - mean) / std
            torch.testing.assert_close(images[j], want, atol=1e-5, rtol=1e-5)
            assert int(batch["seed"][j]) == plain[key]["seed"]
            seen += 1
    assert seen == N - 1
    loader.close()


def _by_key(batch: dict):
    for j, key in enumerate(batch["key"]):
        yield key, {"image": batch["image"][j], "seed": int(batch["seed"][j])}


def test_normalize_on_a_sample_transform_batch_without_an_image_column_is_refused(shards):
    kw = dict(
        decode=Decode(crop=CenterCrop(8, 8)),
        sample_transform=lambda s: {"x": s["image"].float(), "key": s["key"]},
    )
    with pytest.raises(InputError, match=r"^ShardLoader\(normalize=\) .* under \"image\""):
        list(ShardLoader(_ds(shards, **kw), 4, num_workers=0, normalize=(MEAN, STD)))
    kw = dict(
        decode=Decode(crop=CenterCrop(8, 8)),
        sample_transform=lambda s: (s["image"].float(), s["label"]),
    )
    with pytest.raises(InputError, match=r"channels_last=\) .* first column, but it is a "):
        list(ShardLoader(_ds(shards, **kw), 4, num_workers=0, channels_last=True))


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_sample_transform_tensors_of_one_shape_travel_in_the_ring(shards, workers):
    """Stacked columns were pickled through the pipe; they are written into the batch's slot
    and lent as the plain path's images are: kept batches keep their values."""
    kw = dict(decode=Decode(crop=RandomResizedCrop(8)), seed=2, sample_transform=_jitter)
    reference = {s["key"]: s for s in _ds(shards, **kw)}
    loader = ShardLoader(_ds(shards, **kw), 4, num_workers=workers)
    it = iter(loader)
    kept = [next(it)]
    assert loader._res.ring.nbytes > 0  # the slot was mapped: the columns came through it
    kept += it  # every batch kept: the slots get fresh memory, nothing is overwritten
    keys = []
    for batch in kept:
        for j, key in enumerate(batch["key"]):
            assert torch.equal(batch["image"][j], reference[key]["image"])
            assert int(batch["seed"][j]) == reference[key]["seed"]
        keys += batch["key"]
    assert sorted(keys) == sorted(reference)
    loader.close()


def _large(sample: dict) -> dict:
    """An output larger than a pipe's buffer per batch: batches travel through the pipe."""
    return {"x": torch.zeros(3, 64, 64), "key": sample["key"]}


@pytest.mark.slow
def test_workers_sending_large_batches_nobody_reads_stop_when_asked(shards):
    """After a break, workers go on filling the abandoned epoch: a batch of sample_transform
    outputs (or masks) larger than the pipe's buffer blocks its worker in the send. ``close()``
    reads and drops what they send until they have stopped: they exit by themselves (0), where
    each was killed (SIGKILL) after a 5 s wait."""
    loader = ShardLoader(
        _ds(shards, decode=Decode(crop=CenterCrop(8, 8)), sample_transform=_large), 4, num_workers=2
    )
    for _ in loader:
        break
    procs = list(loader._res.workers.procs)
    loader.close()
    assert [p.exitcode for p in procs] == [0, 0]


def _numbers(sample: dict) -> dict:
    """The sample passed on, with numbers and arrays of each kind beside it."""
    i = int(sample["key"][-2:])
    return {**sample, "ratio": i / 4, "odd": bool(i % 2), "np32": np.float32(i),
            "row": np.full(3, i, np.int16), "ragged": np.zeros(1 + i % 2),
            "huge": 2**64 + i, "none": None}  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_numbers_and_arrays_of_a_sample_transform_batch_as_dataloader_collates_them(
    shards, workers
):
    """A pass-through transform keeps the batch a plain loader gives: labels (and the source,
    the seed, any number) an int64 or float tensor, arrays of one shape stacked."""
    kw = dict(decode=Decode(crop=RandomResizedCrop(8)), seed=2, fields=("txt",))
    plain = {
        k: lab
        for b in ShardLoader(_ds(shards, **kw), 4)
        for k, lab in zip(b["key"], b["label"].tolist(), strict=True)
    }
    loader = ShardLoader(_ds(shards, **kw, sample_transform=_numbers), 4, num_workers=workers)
    for batch in loader:
        keys, n = batch["key"], len(batch["key"])
        assert batch["label"].dtype == torch.int64 and batch["label"].tolist() == [
            plain[k] for k in keys
        ]
        assert batch["seed"].dtype == torch.int64 and batch["ratio"].dtype == torch.float64
        assert batch["odd"].dtype == torch.bool and batch["np32"].dtype == torch.float32
        assert batch["row"].shape == (n, 3) and batch["row"].dtype == torch.int16
        assert batch["row"][:, 0].tolist() == [int(k[-2:]) for k in keys]
        if len({1 + int(k[-2:]) % 2 for k in keys}) > 1:  # ragged: as it is
            assert isinstance(batch["ragged"], list) and isinstance(batch["ragged"][0], np.ndarray)
        else:  # one shape in this batch: stacked, as tensors of one shape are
            assert batch["ragged"].shape[0] == n
        assert batch["huge"] == [2**64 + int(k[-2:]) for k in keys]  # past int64: a list
        assert batch["none"] == [None] * n and isinstance(batch["txt"], list)
    loader.close()


def _image_mask_boxes(sample: dict) -> tuple:
    return sample["image"], sample["seg.png"], torch.zeros(sample["image"].shape[-1] % 3, 4)


def test_tuples_stack_tensors_of_one_shape_and_list_the_rest(masked):
    kw = dict(
        decode=Decode(crop=CenterCrop(16, 16)),
        fields=("seg.png",),
        on_error="skip",
        sample_transform=_image_mask_boxes,
    )
    reference = {
        i: (x, m) for i, (x, m, _) in enumerate(_ds(masked, **kw, order=Order(shuffle=False)))
    }
    kw["sample_transform"] = lambda s: (
        *_image_mask_boxes(s),
        torch.zeros(1 + int(s["key"][-1]) % 2, 2),
    )
    batches = list(ShardLoader(_ds(masked, order=Order(shuffle=False), **kw), 9, num_workers=0))
    assert len(batches) == 1
    images, masks, boxes, ragged = batches[0]
    assert images.shape == (9, 3, 16, 16) and masks.shape == (9, 1, 16, 16)
    assert torch.equal(images[0], reference[0][0]) and torch.equal(masks[0], reference[0][1])
    assert isinstance(boxes, torch.Tensor) and boxes.shape == (9, 16 % 3, 4)  # one shape
    assert isinstance(ragged, list) and {tuple(r.shape) for r in ragged} == {(1, 2), (2, 2)}


def test_sample_transforms_are_refused_where_no_decoded_sample_exists(masked):
    from shardkit.errors import InputError, TransformError

    ds = _ds(
        masked,
        decode=Decode(crop=CenterCrop(16, 16)),
        fields=("seg.png",),
        sample_transform=lambda s: s,
    )
    for mode in ("device", "auto"):
        with pytest.raises(InputError, match=f'needs decode_on="workers".*{mode!r}'):
            ShardLoader(ds, 4, decode_on=mode)
    odd = _ds(
        masked,
        decode=Decode(crop=CenterCrop(16, 16)),
        fields=(),
        sample_transform=lambda s: {s["key"]: 1},
    )
    with pytest.raises(InputError, match="same keys"):
        list(ShardLoader(odd, 4, num_workers=0))
    failing = _ds(
        masked, decode=Decode(crop=CenterCrop(16, 16)), fields=(), sample_transform=lambda s: 1 / 0
    )
    with pytest.raises(TransformError):
        list(ShardLoader(failing, 4, num_workers=0))


@pytest.fixture(scope="module")
def boxed(tmp_path_factory):
    """Images with a COCO-style list of boxes in a .json beside each."""
    base = tmp_path_factory.mktemp("boxes")
    for i in range(9):
        d = base / "src" / "c"
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(d / f"b{i}.jpg")
        boxes = [[int(v) for v in rng.integers(0, 20, 2)] + [12, 9] for _ in range(1 + i % 3)]
        (d / f"b{i}.json").write_text(json.dumps({"boxes": boxes}))
    pack(str(base / "src"), str(base / "tar"), progress=False)
    return str(base / "tar")


@pytest.mark.parametrize("workers", [0, 2])
def test_boxes_travel_with_their_batch_as_the_dataset_moves_them(boxed, workers):
    from shardkit import Boxes

    kw = dict(decode=Decode(crop=RandomResizedCrop(16), flip=True), fields=("json",), seed=5)
    kw["boxes"] = Boxes("json", key="boxes", format="xywh")
    reference = {s[2]: (s[4], s[5]) for s in _ds(boxed, **kw)}  # image, label, key, json, ...
    loader = ShardLoader(_ds(boxed, **kw), 4, num_workers=workers)
    seen = 0
    for batch in loader:
        assert len(batch["boxes"]) == len(batch["box_index"]) == len(batch["key"])
        for j, key in enumerate(batch["key"]):
            boxes, index = reference[key]
            assert torch.equal(batch["boxes"][j], boxes)
            assert torch.equal(batch["box_index"][j], index)
            seen += 1
    assert seen == 9
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_with_fields_delivers_the_rest_exactly_once(shards, workers):
    """Two ranks take two batches each; the rest goes to one rank: every readable sample once,
    each with its own caption and metadata."""
    kw = dict(order=Order(buffer_size=8, equalize="none"))
    before = []
    for rank in range(2):
        loader = ShardLoader(_ds(shards, rank=rank, world_size=2, **kw), 2, num_workers=workers)
        it = iter(loader)
        for _ in range(2):
            batch = next(it)
            _check(batch)
            before += batch["key"]
        if rank == 0:
            state = loader.state_dict()
        loader.close()
    loader = ShardLoader(_ds(shards, rank=0, world_size=1, **kw), 2, num_workers=workers)
    loader.load_state_dict(state)
    after = []
    for batch in loader:
        _check(batch)
        after += batch["key"]
    loader.close()
    assert len(before + after) == len(set(before + after)) == N - 1


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fields", [(), ("txt",)])
def test_batches_say_which_source_each_sample_came_from(shards, workers, fields):
    from shardkit import Source

    train = Source(shards, split="train", val_fraction=0.3)
    val = Source(shards, split="val", val_fraction=0.3)
    val_keys = {k for _, _, k in ShardDataset([val], decode="raw", with_keys=True)}
    assert 0 < len(val_keys) < N
    kw = dict(with_keys=("key", "source"), fields=fields, on_error="skip")
    ds = _ds([train, val], **kw)
    expected = {k: s for _, _, k, s, *_ in _ds([train, val], **kw)}
    assert set(expected.values()) == {0, 1}
    # the loader's with_keys= over a dataset that reports none: the same sources (were empty)
    plain = _ds([train, val], fields=fields, on_error="skip")
    kw_loader = dict(num_workers=workers, with_keys=("key", "source"))
    for loader in (ShardLoader(ds, 4, num_workers=workers), ShardLoader(plain, 4, **kw_loader)):
        seen = 0
        for batch in loader:
            keys, sources = (batch["key"], batch["source"]) if fields else (batch[2], batch[3])
            assert sources.dtype == torch.int64
            assert sources.tolist() == [int(k in val_keys) for k in keys]
            assert sources.tolist() == [expected[k] for k in keys]
            seen += len(keys)
        assert seen == len(expected)
        loader.close()
    from shardkit.errors import InputError

    for bad in ("path", ("key", "key"), 3):
        with pytest.raises(InputError, match="with_keys="):
            ShardLoader(ds, 4, with_keys=bad)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_mixture_reports_the_sources_of_the_uninterrupted_epoch(shards, masked, workers):
    """Mixed sources (weighted, shuffle buffers), a checkpoint mid-epoch, resumed in a new
    loader: the (key, source) pairs of before and after are the uninterrupted epoch's, in order;
    the source of a sample that waited in a buffer across the checkpoint included."""
    from shardkit import Source

    def loader():
        sources = [Source(shards, weight=2), Source(masked, weight=1)]
        ds = _ds(
            sources,
            fields=(),
            decode=Decode(crop=CenterCrop(8, 8)),
            order=Order(buffer_size=6),
            seed=4,
            with_keys=("key", "source"),
        )
        ds.set_epoch(1)
        return ShardLoader(ds, 3, num_workers=workers)

    def pairs(batches):
        out = []
        for _, _, keys, sources in batches:
            out += zip(keys, sources.tolist(), strict=True)
        return out

    full = loader()
    whole = pairs(full)
    full.close()
    assert {s for _, s in whole} == {0, 1}
    first = loader()
    it = iter(first)
    before = pairs(next(it) for _ in range(3))
    state = first.state_dict()
    first.close()
    resumed = loader()
    resumed.load_state_dict(state)
    assert before + pairs(resumed) == whole
    resumed.close()
