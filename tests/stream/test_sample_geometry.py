"""Masks, boxes and user transforms follow the image's crop, resize and flip."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from shardkit import (
    Boxes,
    CenterCrop,
    Decode,
    Order,
    RandomResizedCrop,
    ShardDataset,
    ShardLoader,
    ShardWriter,
    Source,
)
from shardkit.errors import InputError, SampleError
from shardkit.images.geometry import CropBox, Geometry, TensorDecoder, crop_boxes

W, H = 90, 70  # under 256: image channel values are the pixel's own x and y


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def _position_image(w=W, h=H) -> bytes:
    y, x = np.mgrid[0:h, 0:w]
    return _png(np.stack([x, y, np.zeros_like(x)], axis=-1).astype(np.uint8))


def _position_mask(w=W, h=H) -> bytes:
    y, x = np.mgrid[0:h, 0:w]
    return _png(((x * 7 + y * 13) % 251).astype(np.uint8))


@pytest.fixture
def positions(tmp_path):
    out = tmp_path / "pos"
    with ShardWriter(out, format="tar", shard_size="1MB") as w:
        for i in range(12):
            boxes = [[5, 5, 40, 30], [60, 50, 25, 15], [0, 0, 3, 3]]  # COCO xywh
            w.write(f"k{i}", _position_image(), 0, **{
                "seg.png": _position_mask(), "json": {"annotations": [{"bbox": b} for b in boxes]},
            })  # fmt: skip
    return str(out)


def _expected_source(box: CropBox, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent nearest mapping: the output pixel's centre, back in full-size pixels."""
    centres = (np.arange(size) + 0.5) / size
    rows = box.top + np.floor(centres * box.h).astype(int)
    cols = box.left + np.floor(centres * box.w).astype(int)
    return rows, (cols[::-1] if box.flip else cols)


def test_mask_pixels_keep_their_image_position(positions):
    size = 32
    ds = ShardDataset(
        positions,
        decode=Decode("tensor", crop=RandomResizedCrop(size), flip=True),
        seed=3,
        fields=("seg.png",),
        with_keys=True,
    )
    decoder = TensorDecoder(Geometry(size, "random", True), seed=3)
    flips = 0
    for image, _, key, mask in ds:
        box = decoder.crop_box(_position_image(), key)
        flips += box.flip
        assert mask.shape == (1, size, size) and mask.dtype == torch.uint8
        rows, cols = _expected_source(box, size)
        y, x = np.meshgrid(rows, cols, indexing="ij")
        np.testing.assert_array_equal(mask[0].numpy(), (x * 7 + y * 13) % 251)
        # the image's pixel there shows the same position, up to the bilinear filter's blur
        assert np.abs(image[0].numpy().astype(int) - x).max() <= 2
        assert np.abs(image[1].numpy().astype(int) - y).max() <= 2
    assert 0 < flips < 12  # both branches were checked


def test_mask_of_another_size_names_shard_and_key(tmp_path):
    out = tmp_path / "bad"
    with ShardWriter(out, format="tar") as w:
        w.write("ok", _position_image(), 0, **{"seg.png": _position_mask()})
        w.write("odd", _position_image(), 0, **{"seg.png": _position_mask(W - 1, H)})
    kw = dict(
        decode=Decode("tensor", crop=CenterCrop(16, 16)),
        order=Order(shuffle=False),
        fields=("seg.png",),
    )
    with pytest.raises(SampleError, match=r"\.tar: sample 'odd': field 'seg.png' it is 89x70 "):
        list(ShardDataset(str(out), **kw))
    ds = ShardDataset(str(out), on_error="skip", with_keys=True, **kw)
    with pytest.warns(RuntimeWarning, match="'odd'"):
        assert [s[2] for s in ds] == ["ok"]
    assert ds.skipped == 1


def _reference_boxes(stored, box: CropBox, size: int):
    """Box by box in plain floats: xywh -> xyxy, shift, scale, flip, clip, drop empty."""
    kept, index = [], []
    for i, (x, y, w, h) in enumerate(stored):
        x0 = (x - box.left) * size / box.w
        x1 = (x + w - box.left) * size / box.w
        y0 = (y - box.top) * size / box.h
        y1 = (y + h - box.top) * size / box.h
        if box.flip:
            x0, x1 = size - x1, size - x0
        x0, x1 = min(max(x0, 0), size), min(max(x1, 0), size)
        y0, y1 = min(max(y0, 0), size), min(max(y1, 0), size)
        if x1 > x0 and y1 > y0:
            kept.append([x0, y0, x1, y1])
            index.append(i)
    return np.asarray(kept, dtype=np.float32).reshape(-1, 4), index


def test_boxes_follow_crop_resize_and_flip(positions):
    size = 24
    ds = ShardDataset(
        positions,
        decode=Decode("tensor", crop=RandomResizedCrop(size), flip=True),
        seed=5,
        fields=("json",),
        with_keys=True,
        boxes=Boxes("json", "annotations", "xywh"),
    )
    decoder = TensorDecoder(Geometry(size, "random", True), seed=5)
    dropped = 0
    for _, _, key, meta, boxes, index in ds:
        box = decoder.crop_box(_position_image(), key)
        stored = [a["bbox"] for a in meta["annotations"]]
        want, want_index = _reference_boxes(stored, box, size)
        assert boxes.dtype == torch.float32 and boxes.shape == (len(want_index), 4)
        np.testing.assert_allclose(boxes.numpy(), want, atol=1e-4)
        assert index.tolist() == want_index
        dropped += len(stored) - len(index)
    assert dropped > 0  # some crops cut boxes away


def test_boxes_from_an_npy_field_and_refusals(tmp_path):
    out = tmp_path / "npy"
    buf = io.BytesIO()
    np.save(buf, np.array([[10, 10, 50, 40]], dtype=np.int32))
    with ShardWriter(out, format="lmdb") as w:
        w.write("a", _position_image(), 0, npy=buf.getvalue())
    ds = ShardDataset(
        str(out),
        decode=Decode("tensor", crop=CenterCrop(35, 35)),
        fields=("npy",),
        boxes=Boxes("npy"),
    )
    ((_, _, _, boxes, index),) = list(ds)
    # center crop of 90x70: the 70x70 square from x=10, scaled by 35/70
    np.testing.assert_allclose(boxes.numpy(), [[0, 5, 20, 20]])
    assert index.tolist() == [0]
    with pytest.raises(InputError, match="add it to fields="):
        list(
            ShardDataset(
                str(out),
                decode=Decode("tensor", crop=CenterCrop(8, 8)),
                boxes=Boxes("json"),
                fields=("npy",),
            )
        )
    with pytest.raises(InputError, match=r"boxes= moves boxes.*Decode\(crop="):
        ShardDataset(str(out), decode="tensor", fields=("npy",), boxes=Boxes("npy"))
    with pytest.raises(InputError, match="format"):
        Boxes("npy", format="cxcywh")


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array))
    return buf.getvalue()


def test_boxes_that_are_not_rows_of_4_finite_numbers_are_refused(tmp_path):
    """Rows of 5 (x0, y0, x1, y1, class) are never reshaped into other boxes (4 rows of 5 are
    20 numbers: 5 rows of 4), and an infinite corner never becomes a whole-image box."""
    out = tmp_path / "boxes"
    rows5 = [[1, 2, 30, 40, 3], [5, 5, 20, 20, 1], [0, 0, 9, 9, 2], [1, 1, 5, 5, 0]]
    bad = {
        "five": (_npy(np.array(rows5, np.float32)), {"b": [[1, 2, 3, 4]]}),
        "json5": (_npy(np.zeros((0, 4))), {"b": rows5}),
        "flat": (_npy(np.arange(8.0)), {"b": [[1, 2, 3, 4]]}),
        "inf": (_npy([[-np.inf, -np.inf, np.inf, np.inf]]), {"b": [[1, 2, 3, 4]]}),
        "nan": (_npy([[1, 2, 3, 4]]), {"b": [[1, 2, 3, 4], [float("nan"), 2, 3, 4]]}),
    }
    with ShardWriter(out, format="tar") as w:
        w.write("ok", _position_image(), 0, npy=_npy([[10, 10, 50, 40]]), json={"b": []})
        for key, (npy, meta) in bad.items():
            w.write(key, _position_image(), 0, npy=npy, json=meta)
    why = {"five": "shape \\(4, 5\\)", "json5": "shape \\(4, 5\\)", "flat": "shape \\(8,\\)",
           "inf": "box 0 is .*not finite", "nan": "box 1 is .*not finite"}  # fmt: skip
    wrong_in = {"npy": {"five", "flat", "inf"}, "json": {"json5", "nan"}}
    for boxes in (Boxes("npy"), Boxes("json", key="b")):
        field, wrong = boxes.field, wrong_in[boxes.field]
        kw = dict(
            decode=Decode("tensor", crop=CenterCrop(16, 16)),
            fields=("npy", "json"),
            boxes=boxes,
            with_keys=True,
        )
        ds = ShardDataset(str(out), on_error="skip", **kw)
        with pytest.warns(RuntimeWarning):
            got = {s[2]: s for s in ds}
        assert set(got) == {"ok", *bad} - wrong and ds.skipped == len(wrong)
        for key in wrong:
            match = rf"shard-000000\.tar: sample '{key}': field '{field}'.* {why[key]}"
            with pytest.raises(SampleError, match=match):
                list(ShardDataset(Source(str(out), subset=[key]), **kw))
    assert got["ok"][5].shape == (0, 4)  # an empty list: no boxes
    whole = CropBox(H, W, 0, 0, H, W, False)
    with pytest.raises(ValueError, match=r"shape \(4, 5\), not \(N, 4\)"):
        crop_boxes(rows5, whole, 16)  # the public function does not reshape either
    assert crop_boxes([], whole, 16)[0].shape == (0, 4)


def _seen(ds, workers):
    got = {}
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    for item in loader:
        got[item["key"]] = item
    return got


@pytest.mark.slow
def test_sample_transform_sees_the_sample_and_repeats_across_workers(positions):
    def augment(sample):
        g = torch.Generator().manual_seed(sample["seed"])
        noise = torch.randint(0, 5, (1,), generator=g).item()
        return {"key": sample["key"], "noise": noise, "mask": sample["seg.png"],
                "image": sample["image"], "seed": sample["seed"]}  # fmt: skip

    def ds():
        return ShardDataset(
            positions,
            decode=Decode("tensor", crop=RandomResizedCrop(16), flip=True),
            fields=("seg.png",),
            sample_transform=augment,
        )

    one, two = _seen(ds(), 0), _seen(ds(), 2)
    assert sorted(one) == sorted(two) == sorted(f"k{i}" for i in range(12))
    for key in one:
        assert one[key]["seed"] == two[key]["seed"] and one[key]["noise"] == two[key]["noise"]
        assert torch.equal(one[key]["mask"], two[key]["mask"])
    assert len({v["seed"] for v in one.values()}) == 12
    other = ds()
    other.set_epoch(1)
    assert {k: v["seed"] for k, v in _seen(other, 0).items()} != {
        k: v["seed"] for k, v in one.items()
    }
    with pytest.raises(InputError, match="sample_transform="):
        ShardDataset(positions, transform=len, sample_transform=augment)


class _Curriculum:
    """A crop whose answer changes between calls (a counter, as a curriculum's step would be):
    the same box for two calls in a row, then the next one, so asking twice to compare passes."""

    size = 16

    def __init__(self):
        self.calls = 0

    def box(self, height, width, uniforms):
        self.calls += 1
        at = (self.calls - 1) // 2 % 5 * 8
        return at, at, 16, 16


def _cut_where_its_image_was(samples) -> int:
    """Each sample's mask and boxes against the box its image shows: a box of ``size`` x
    ``size`` is not resized, so the image's pixels are their own full-size x and y."""
    n = 0
    for img, mask, boxes in samples:
        left, top = int(img[0, 0, 0]), int(img[1, 0, 0])
        y, x = np.mgrid[top : top + 16, left : left + 16]
        assert np.array_equal(img[0].numpy(), x) and np.array_equal(img[1].numpy(), y)
        assert np.array_equal(mask[0].numpy(), (x * 7 + y * 13) % 251), (top, left)
        want = np.clip([[5 - left, 5 - top, 45 - left, 35 - top]], 0, 16)  # the xywh 5,5,40,30
        assert boxes[:1].tolist() == want.tolist(), (top, left)
        n += 1
    return n


@pytest.mark.parametrize("workers", [None, 0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_crop_asked_once_cuts_image_masks_and_boxes_at_one_box(positions, workers):
    """A crop hook is asked once per sample and its box used for the image, masks and boxes
    alike: one whose answer changes between calls still gives aligned samples."""
    ds = ShardDataset(
        positions,
        decode=Decode("tensor", crop=_Curriculum()),
        fields=("seg.png", "json"),
        boxes=Boxes("json", "annotations", "xywh"),
    )
    if workers is None:
        samples = ((img, mask, boxes) for img, _, mask, _, boxes, _ in ds)
    else:
        batches = ShardLoader(ds, 4, num_workers=workers)
        samples = (
            (img, mask, boxes)
            for b in batches
            for img, mask, boxes in zip(b["image"], b["seg.png"], b["boxes"], strict=True)
        )
    assert _cut_where_its_image_was(samples) == 12
