"""Crop objects (shardkit.images.crops): torchvision's names and box rules, the fused region
decode's pixels against a reference written here (crop the full-size decode at the same box, then
torchvision's resize), user crop hooks, and the shorthands they replace."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from shardkit import (
    CenterCrop,
    Decode,
    RandomCrop,
    RandomResizedCrop,
    ShardDataset,
    ShardLoader,
    pack,
)
from shardkit.errors import InputError
from shardkit.images.crops import CropError
from shardkit.images.decode import decode_rgb
from shardkit.images.geometry import Geometry, TensorDecoder, sample_uniforms


def _photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients with mild texture: a photo's spectrum, where filters differ as on photos."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, 128 + 100 * np.sin((x + 2 * y) / 9.0)], -1)
    return np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)


def _jpeg(width: int = 500, height: int = 375, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_photo(width, height, seed)).save(buf, "JPEG", quality=92)
    return buf.getvalue()


def _reference_resized_crop(full: np.ndarray, box, size: int, interpolation: str) -> torch.Tensor:
    """torchvision's ``F.resized_crop(img, top, left, h, w, [size, size], interpolation,
    antialias=True)`` on a uint8 tensor, written out: the box of the full-size image, then
    torch's antialiased uint8 resize."""
    top, left, h, w = box
    x = torch.from_numpy(full).permute(2, 0, 1)[None, :, top : top + h, left : left + w]
    return F.interpolate(
        x.contiguous(), size=(size, size), mode=interpolation, antialias=True, align_corners=False
    )[0]


def _mean_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("scale", [(0.9, 1.0), (0.08, 1.0)])
def test_random_resized_crop_equals_torchvisions_resize_of_the_same_box(interpolation, scale):
    """Decoded at a DCT scale, only the box's region: within a level (mean) of the full-size
    reference for the same box; at full scale (a crop shrunk less than 2x) to the rounding."""
    crop = RandomResizedCrop(224, scale=scale, interpolation=interpolation)
    dec = TensorDecoder(Geometry(None, crop), seed=3)
    for i in range(6):
        data = _jpeg(seed=i)
        full = decode_rgb(data)
        key = f"k{i}"
        box = dec.crop_box(data, key)
        ref = _reference_resized_crop(full, box[2:6], 224, interpolation)
        got = dec(data, key)
        assert got.shape == (3, 224, 224) and got.dtype == torch.uint8
        assert _mean_diff(got, ref) < 1.0, (i, box)
        if box.h < 2 * 224 and box.w < 2 * 224:  # no DCT scaling: the same uint8 kernel
            assert torch.equal(got, ref), (i, box)


@pytest.mark.parametrize("short", [224, 256, 320])
def test_center_crop_after_resize_short_is_the_two_step_window_to_half_a_pixel(short):
    """The box is the full-size window that torchvision's ``Resize(short)`` then
    ``CenterCrop(224)`` keeps, rounded to whole pixels (half a pixel at most, each edge), and
    its pixels are the reference resize of that box."""
    dec = TensorDecoder(Geometry(None, CenterCrop(224, resize_short=short)))
    for i, (w, h) in enumerate([(500, 375), (375, 500), (640, 427), (300, 300)]):
        data = _jpeg(w, h, seed=i)
        if h <= w:
            rh, rw = short, int(short * w / h)
        else:
            rh, rw = int(short * h / w), short
        top, left = int(round((rh - 224) / 2.0)), int(round((rw - 224) / 2.0))
        exact = (top * h / rh, left * w / rw, 224 * h / rh, 224 * w / rw)
        box = dec.crop_box(data, "k")
        if short == 224:  # the central square, as crop="center"
            side = min(w, h)
            assert box[2:6] == ((h - side) // 2, (w - side) // 2, side, side)
            continue
        for got, want in zip(box[2:6], exact, strict=True):
            assert abs(got - want) <= 0.5, (w, h, box, exact)
        ref = _reference_resized_crop(decode_rgb(data), box[2:6], 224, "bilinear")
        assert _mean_diff(dec(data, "k"), ref) < 1.0, (w, h)


def test_random_crop_at_the_images_scale_is_the_full_decodes_pixels():
    """No resize: the crop is exactly a size x size window of the full decode, anywhere."""
    dec = TensorDecoder(Geometry(None, RandomCrop(96)), seed=1)
    data = _jpeg(200, 150)
    full = decode_rgb(data)
    tops = set()
    for i in range(20):
        box = dec.crop_box(data, str(i))
        assert (box.h, box.w) == (96, 96)
        window = full[box.top : box.top + 96, box.left : box.left + 96]
        assert torch.equal(dec(data, str(i)), torch.from_numpy(window).permute(2, 0, 1))
        tops.add((box.top, box.left))
    assert len(tops) > 10  # positions drawn per key


def test_scale_jitter_draws_the_shorter_side_in_its_range():
    crop = RandomCrop(64, resize_short=(64, 128))
    sides = {crop.box(300, 400, sample_uniforms(0, 0, 0, str(i)))[2] for i in range(200)}
    # shorter side 300 resized to s in [64, 128]: the box is 64 * 300 / s full-size pixels
    assert min(sides) == round(64 * 300 / 128) and max(sides) == 300 and len(sides) > 30
    with pytest.raises(InputError, match="resize_short"):
        CenterCrop(224, resize_short=200)  # smaller than the crop


def test_the_shorthands_are_the_crop_objects():
    data = _jpeg()
    for short, obj in [("random", RandomResizedCrop(64)), ("center", CenterCrop(64, 64))]:
        a = TensorDecoder(Geometry(64, short, True), seed=5)
        b = TensorDecoder(Geometry(None, obj, True), seed=5)
        for k in ("a", "b", "c"):
            assert a.crop_box(data, k) == b.crop_box(data, k)
            assert torch.equal(a(data, k), b(data, k))


class _TopLeftQuarter:
    """A user's crop policy: the top-left quarter, shifted by a drawn amount."""

    size = 48
    interpolation = "bicubic"

    def box(self, height, width, uniforms):
        shift = int(next(uniforms) * 8)
        return shift, shift, height // 2, width // 2


def test_a_crop_hook_is_called_from_the_header_and_its_box_decoded():
    data = _jpeg(200, 160)
    dec = TensorDecoder(Geometry(None, _TopLeftQuarter()), seed=2)
    box = dec.crop_box(data, "x")
    assert (box.h, box.w) == (80, 100) and box.top == box.left < 8
    ref = _reference_resized_crop(decode_rgb(data), box[2:6], 48, "bicubic")
    assert _mean_diff(dec(data, "x"), ref) < 1.0
    assert dec.crop_box(data, "x") == TensorDecoder(Geometry(None, _TopLeftQuarter()), 2).crop_box(
        data, "x"
    )  # the seed rule: (seed, epoch, rank, key) only


def test_bad_crops_are_one_line_errors():
    class Outside(_TopLeftQuarter):
        def box(self, height, width, uniforms):
            return 0, 0, height + 1, width

    with pytest.raises(InputError, match=r"Outside.box\(160, 200, \.\.\.\) returned"):
        TensorDecoder(Geometry(None, Outside())).crop_box(_jpeg(200, 160), "k")
    with pytest.raises(InputError, match="crop object"):
        Geometry(32, object())
    with pytest.raises(InputError, match="give the size in one place"):
        Geometry(32, RandomResizedCrop(64))
    with pytest.raises(InputError, match="interpolation="):
        RandomResizedCrop(64, interpolation="lanczos")
    with pytest.raises(InputError, match="scale="):
        RandomResizedCrop(64, scale=(0.5, 0.2))


@pytest.fixture(scope="module")
def boxed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crops")
    for i in range(6):
        d = base / "src" / "c0"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_photo(120, 90, seed=i)).save(d / f"im{i}.jpg", quality=90)
        mask = np.zeros((90, 120), np.uint8)
        mask[10:30, 20:60] = 1
        Image.fromarray(mask).save(d / f"im{i}.seg.png")
    pack(str(base / "src"), str(base / "tar"), progress=False)
    return str(base / "tar")


def test_a_dataset_takes_a_crop_object_and_masks_follow_its_box(boxed):
    crop = RandomCrop(40, resize_short=(60, 90), interpolation="bicubic")
    ds = ShardDataset(boxed, decode=Decode("tensor", crop=crop), fields=["seg.png"], with_keys=True)
    dec = ds.tensor_decoder(0)
    raw = {k: d for d, _, k in ShardDataset(boxed, decode="raw", with_keys=True)}
    for img, _, key, mask in ds:
        assert img.shape == (3, 40, 40) and mask.shape == (1, 40, 40)
        box = dec.crop_box(raw[key], key)
        rows = box.top + (np.arange(40) * 2 + 1) * box.h // 80
        cols = box.left + (np.arange(40) * 2 + 1) * box.w // 80
        full = np.zeros((90, 120), np.uint8)
        full[10:30, 20:60] = 1
        assert np.array_equal(mask[0].numpy(), full[rows][:, cols]), key
    with pytest.raises(InputError, match=r'Decode\(crop=...\) needs mode="tensor"'):
        ShardDataset(boxed, decode=Decode("pil", crop=crop))


class _Raising(_TopLeftQuarter):
    def box(self, height, width, uniforms):
        raise ZeroDivisionError("a bug in the policy")


class _Infinite(_TopLeftQuarter):
    def box(self, height, width, uniforms):
        return 0, 0, float("inf"), width


@pytest.mark.slow
@pytest.mark.parametrize("crop", [_Raising(), _Infinite()], ids=["raises", "infinite"])
@pytest.mark.parametrize("workers", [None, 0, 2])
def test_a_crop_policys_error_is_raised_whatever_on_error_never_a_skipped_sample(
    boxed, crop, workers
):
    """A crop object's bug is user code's, as a transform's: under ``on_error="skip"`` it
    emptied the epoch sample by sample, under "raise" it said to re-pack a sound image."""
    ds = ShardDataset(boxed, decode=Decode("tensor", crop=crop), on_error="skip")
    name = type(crop).__name__
    with pytest.raises(CropError, match=rf"shard-\d+\.tar: sample 'c0/im\d': {name}\.box\(90, 120"):
        if workers is None:
            list(ds)
        else:
            list(ShardLoader(ds, 2, num_workers=workers))
    assert ds.skipped == 0
    if isinstance(crop, _Raising) and workers:  # the policy's own exception, from the worker
        with pytest.raises(CropError) as caught:
            list(ShardLoader(ds, 2, num_workers=workers))
        assert isinstance(caught.value.__cause__, ZeroDivisionError)


INF = float("inf")


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: RandomResizedCrop(32, ratio=(INF, INF)), "ratio="),
        (lambda: RandomResizedCrop(32, ratio=(float("nan"), 1.0)), "ratio="),
        (lambda: RandomResizedCrop(32, ratio=(0, 1)), "ratio="),
        (lambda: RandomResizedCrop(32, scale=(0.5,)), "scale="),
        (lambda: RandomResizedCrop(32, scale=("a", "b")), "scale="),
        (lambda: RandomResizedCrop(32, scale=0.5), "scale="),
        (lambda: RandomResizedCrop(32, scale=(0.5, INF)), "scale="),
        (lambda: RandomResizedCrop(10**6), "size="),
        (lambda: RandomResizedCrop(30000), "size="),
        (lambda: CenterCrop(30000), "size="),
        (lambda: RandomCrop(32, resize_short=40.5), "resize_short="),
        (lambda: RandomCrop(32, resize_short=(48, 40)), "resize_short="),
        (lambda: CenterCrop(32, resize_short=10**400), "resize_short="),
    ],
    ids=[
        "ratio-inf",
        "ratio-nan",
        "ratio-0",
        "scale-one",
        "scale-text",
        "scale-number",
        "scale-inf",
        "size-1e6",
        "size-30000",
        "center-30000",
        "short-float",
        "short-unordered",
        "short-huge",
    ],  # fmt: skip
)
def test_crop_arguments_are_refused_at_construction_in_one_line(make, named):
    """Non-finite, unordered, non-positive or huge arguments: accepted before, then every sample
    was "cannot be decoded" (an empty epoch under on_error="skip") or one ran for minutes (900
    MP asked per 64x48 JPEG); a wrong shape or type was a raw ValueError or TypeError."""
    with pytest.raises(InputError) as caught:
        make()
    message = str(caught.value)
    assert message.startswith(named) and "\n" not in message


@pytest.mark.parametrize("ratio", [(1e-300, 1e-300), (1e300, 1e300), (1e-300, 1e300)])
def test_extreme_finite_ratios_give_a_box_inside_the_image(boxed, ratio):
    """A side that overflows, or rounds to 0, fails its try; the clamped whole image keeps one
    row or column: every sample is delivered, none skipped."""
    crop = RandomResizedCrop(16, ratio=ratio)
    dec = TensorDecoder(Geometry(None, crop), seed=1)
    for i in range(20):
        top, left, h, w = crop.box(90, 120, sample_uniforms(0, 0, 0, str(i)))
        assert h >= 1 and w >= 1 and top + h <= 90 and left + w <= 120
    assert dec(_jpeg(120, 90), "k").shape == (3, 16, 16)
    ds = ShardDataset(boxed, decode=Decode("tensor", crop=crop), on_error="skip")
    assert len(list(ds)) == 6 and ds.skipped == 0


def test_an_output_over_the_datasets_max_pixels_is_refused(boxed):
    with pytest.raises(InputError, match=r"^size 2000 makes .* over max_pixels=1000000"):
        ShardDataset(boxed, decode=Decode("tensor", crop=RandomResizedCrop(2000), max_pixels=10**6))


def test_a_builtin_crops_own_failure_is_a_crop_error_not_an_undecodable_sample(boxed):
    """Whatever a crop's box rule raises (here a ratio forced past the construction checks) is
    the crop's error, raised whatever on_error, never "cannot be decoded ... re-pack"."""
    crop = RandomResizedCrop(16)
    object.__setattr__(crop, "ratio", (0.0, 1.0))  # math.log(0): a bug in the rule's arguments
    ds = ShardDataset(boxed, decode=Decode("tensor", crop=crop), on_error="skip")
    with pytest.raises(CropError, match=r"sample 'c0/im\d': RandomResizedCrop\.box\(90, 120"):
        list(ds)
    assert ds.skipped == 0
