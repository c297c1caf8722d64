"""The two decoders (libjpeg-turbo via simplejpeg, Pillow) and the fixed-size geometry."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import shardkit.images.decode as image_mod
from shardkit import CenterCrop, Decode, RandomResizedCrop
from shardkit.errors import InputError
from shardkit.images.decode import (
    MAX_PATH_DIFFERENCE,
    decode_image,
    decode_jpeg_batch,
    decode_jpeg_region,
    decode_rgb,
    image_size,
    jpeg_scale,
    to_planes,
)
from shardkit.images.geometry import (
    Geometry,
    TensorDecoder,
    center_crop_box,
    random_resized_crop_box,
    sample_uniforms,
)
from shardkit.stream.dataset import ShardDataset
from shardkit.write.packer import pack


def _photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: JPEG-like content with real high frequencies."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def _encode(arr: np.ndarray, fmt: str = "JPEG", mode: str = "RGB", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, fmt, **kw)
    return buf.getvalue()


JPEG_VARIANTS = {
    "420": dict(quality=90),
    "444": dict(quality=95, subsampling=0),
    "422": dict(quality=85, subsampling=1),
    "progressive": dict(quality=90, progressive=True),
    "gray": dict(quality=90, mode="L"),
    "cmyk": dict(quality=90, mode="CMYK"),
}


@pytest.mark.parametrize("variant", sorted(JPEG_VARIANTS))
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_the_two_decoders_agree_within_the_documented_bound(variant, scale):
    kw = dict(JPEG_VARIANTS[variant])
    data = _encode(_photo(203, 157, seed=scale), mode=kw.pop("mode", "RGB"), **kw)
    need = (math.ceil(157 / scale), math.ceil(203 / scale)) if scale > 1 else None
    fast = decode_rgb(data, min_size=need)
    slow = decode_rgb(data, min_size=need, pillow=True)
    assert fast.shape == slow.shape == (math.ceil(157 / scale), math.ceil(203 / scale), 3)
    diff = np.abs(fast.astype(np.int16) - slow)
    assert diff.max() <= MAX_PATH_DIFFERENCE
    if variant != "cmyk":  # same libjpeg-turbo settings: identical pixels
        assert diff.max() == 0


needs_roi = pytest.mark.skipif(
    image_mod._native is None, reason="shardkit.images._native not built (no libjpeg headers)"
)


@needs_roi
@pytest.mark.parametrize("variant", sorted(set(JPEG_VARIANTS) - {"cmyk"}))
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_region_decode_equals_the_same_region_of_a_full_decode(variant, scale):
    kw = dict(JPEG_VARIANTS[variant])
    data = _encode(_photo(331, 263, seed=scale), mode=kw.pop("mode", "RGB"), **kw)
    full = decode_rgb(data, min_size=(math.ceil(263 / scale), math.ceil(331 / scale)))
    fh, fw = full.shape[:2]
    rng = np.random.default_rng(scale)
    # edges on and off iMCU boundaries (8/16 px), the whole image, one pixel, the corners
    boxes = [(0, 0, fh, fw), (0, 0, 1, 1), (fh - 1, fw - 1, 1, 1), (0, 16, fh, 16), (8, 0, 8, fw)]
    boxes += [(16 // scale, 32 // scale, fh // 2, fw // 2), (1, fw - 17, fh - 1, 17)]
    for _ in range(25):
        t, left = int(rng.integers(0, fh)), int(rng.integers(0, fw))
        boxes.append(
            (t, left, int(rng.integers(1, fh - t + 1)), int(rng.integers(1, fw - left + 1)))
        )
    for t, left, h, w in boxes:
        region = decode_jpeg_region(data, scale, t, left, h, w)
        assert region is not None and region.shape == (h, w, 3), (t, left, h, w)
        assert np.array_equal(region, full[t : t + h, left : left + w]), (variant, t, left, h, w)


@needs_roi
def test_region_decode_declines_what_it_cannot_do_and_the_crop_still_decodes(monkeypatch):
    cmyk = _encode(_photo(120, 90), mode="CMYK", quality=90)
    assert decode_jpeg_region(cmyk, 1, 0, 0, 10, 10) is None  # no RGB conversion in libjpeg
    good = _encode(_photo(120, 90), quality=90)
    assert decode_jpeg_region(good, 1, 80, 0, 20, 10) is None  # outside the image
    assert decode_jpeg_region(good[: len(good) // 2], 1, 0, 0, 80, 100) is None  # damaged
    assert decode_jpeg_region(_encode(_photo(40, 30), "PNG"), 1, 0, 0, 5, 5) is None
    dec = TensorDecoder(Geometry(size=32, crop="random", flip=True), seed=1)
    assert dec(cmyk, "k").shape == (3, 32, 32)  # through the full-decode fallback


@needs_roi
@pytest.mark.parametrize("crop", ["center", "random"])
def test_geometry_gives_the_same_pixels_with_and_without_the_region_decoder(crop, monkeypatch):
    datas = [
        _encode(_photo(w, h, seed=i), **dict(JPEG_VARIANTS[v], mode="RGB"))
        for i, (w, h, v) in enumerate(
            [(500, 375, "420"), (375, 500, "444"), (640, 480, "422"), (260, 250, "progressive")]
        )
    ]
    dec = TensorDecoder(Geometry(size=96, crop=crop, flip=True), seed=3, epoch=1)
    keys = [f"k{i}" for i in range(8)]
    with_roi = [dec(d, k) for d in datas for k in keys]
    monkeypatch.setattr(image_mod, "_native", None)
    without = [dec(d, k) for d in datas for k in keys]
    for a, b in zip(with_roi, without, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("native", [True, False])
def test_to_planes_is_the_transpose_for_every_layout(native, monkeypatch):
    if native and image_mod._native is None:
        pytest.skip("shardkit.images._native not built")
    if not native:
        monkeypatch.setattr(image_mod, "_native", None)
    rng = np.random.default_rng(0)
    for h, w in [(1, 1), (7, 5), (250, 250), (224, 331)]:
        hwc = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        chw = np.zeros((3, h, w), np.uint8)
        to_planes(hwc, chw)
        assert np.array_equal(chw, hwc.transpose(2, 0, 1))
    strided = rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)[:, 5:45]  # a crop's view
    chw = np.zeros((3, 40, 40), np.uint8)
    to_planes(strided, chw)
    assert np.array_equal(chw, strided.transpose(2, 0, 1))


def test_decode_into_a_caller_buffer():
    data = _encode(_photo(64, 48))
    buf = np.zeros((48, 64, 3), np.uint8)
    got = decode_rgb(data, out=buf)
    assert np.shares_memory(got, buf) and buf.any()
    with pytest.raises(ValueError, match="does not fit"):
        decode_rgb(data, out=np.zeros((48, 65, 3), np.uint8))


def test_a_batch_decode_without_the_native_extension_leaves_every_image_to_decode_rgb(monkeypatch):
    monkeypatch.setattr(image_mod, "_native", None)
    out = np.zeros((1, 30, 40, 3), np.uint8)
    assert decode_jpeg_batch([_encode(_photo(40, 30))], out, 0, False) == 0
    assert not out.any()


@needs_roi
@pytest.mark.parametrize("planar", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_a_batch_decode_gives_decode_rgbs_pixels_and_leaves_the_rest_to_it(planar, fast):
    variants = sorted(set(JPEG_VARIANTS) - {"cmyk"})
    datas = [_encode(_photo(40, 30, i), **JPEG_VARIANTS[v]) for i, v in enumerate(variants)]
    shape = (3, 30, 40) if planar else (30, 40, 3)
    out = np.zeros((len(datas) + 1, *shape), np.uint8)
    assert decode_jpeg_batch(datas, out, 1, planar, fast) == len(datas)
    assert not out[0].any()  # images before ``first`` untouched
    for i, data in enumerate(datas):
        got = out[i + 1].transpose(1, 2, 0) if planar else out[i + 1]
        assert np.array_equal(got, decode_rgb(data, fast_dct=fast)), variants[i]
    good = datas[0]
    declined = {  # each stops the run: the per-image path decides what it is
        "png": _encode(_photo(40, 30), "PNG"),
        "another size": _encode(_photo(41, 30)),
        "cmyk": _encode(_photo(40, 30), mode="CMYK", quality=90),
        "truncated": good[: len(good) // 2],
        "garbage after the marker": b"\xff\xd8\xff" + bytes(100),
        "not bytes": bytearray(good),
    }
    for what, data in declined.items():
        assert decode_jpeg_batch([good, data, good], out, 0, planar, fast) == 1, what
    with pytest.raises(ValueError, match="buffer"):
        decode_jpeg_batch([good], out, len(out), planar, fast)


def test_dct_scale_never_goes_below_the_requested_size():
    assert jpeg_scale(375, 500, None) == 1
    assert jpeg_scale(375, 500, (188, 250)) == 2
    assert jpeg_scale(375, 500, (189, 250)) == 1
    assert jpeg_scale(1200, 1600, (150, 200)) == 8
    for h, w, nh, nw in [(375, 500, 100, 60), (1000, 800, 130, 99), (33, 31, 5, 5)]:
        d = jpeg_scale(h, w, (nh, nw))
        assert math.ceil(h / d) >= nh and math.ceil(w / d) >= nw


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "BMP"])
def test_non_jpeg_images_take_the_pillow_path(fmt):
    arr = _photo(40, 30)
    data = _encode(arr, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    assert np.array_equal(decode_rgb(data), arr)
    assert image_size(data) == (30, 40)
    t = decode_image(data, "tensor")
    assert t.is_contiguous() and torch.equal(t, torch.from_numpy(arr).permute(2, 0, 1))


def test_a_jpeg_turbojpeg_refuses_falls_back_to_pillow_and_corrupt_data_still_raises():
    data = _encode(_photo(64, 48))
    # Damage inside the entropy-coded data: TurboJPEG (strict) refuses, Pillow still decodes it,
    # as the only decoder before this one did.
    damaged = bytearray(data)
    damaged[len(data) // 2 : len(data) // 2 + 4] = b"\xff\xd0\xff\xd1"
    assert decode_rgb(bytes(damaged)).shape == (48, 64, 3)
    with pytest.raises((OSError, ValueError)):
        decode_rgb(data[: len(data) // 2] + b"\x00" * 10)  # truncated: both refuse
    with pytest.raises((OSError, ValueError)):
        decode_rgb(b"\xff\xd8\xff" + b"\x00" * 100)  # a header and nothing else


# --- geometry ----------------------------------------------------------------------------------


def test_random_resized_crop_box_follows_torchvision_rules():
    for i in range(300):
        h, w = (375, 500) if i % 2 else (500, 90)
        top, left, ch, cw = random_resized_crop_box(
            h, w, (0.08, 1.0), (3 / 4, 4 / 3), sample_uniforms(0, 0, 0, str(i))
        )
        assert 0 <= top and top + ch <= h and 0 <= left and left + cw <= w
        if (h, w) == (375, 500):  # the tries succeed: area and aspect within the ranges
            assert 0.08 * h * w * 0.9 <= ch * cw <= h * w
            assert 3 / 4 * 0.9 <= cw / ch <= 4 / 3 * 1.1
    # A strip too thin for any try: the fallback is the whole width at the nearest allowed ratio.
    never = iter([0.999, 0.0] * 10 + [0.0, 0.0])
    assert random_resized_crop_box(500, 90, (0.9, 1.0), (3 / 4, 4 / 3), never) == (190, 0, 120, 90)
    assert center_crop_box(375, 500) == (0, 62, 375, 375)


def test_sample_randomness_is_a_pure_function_of_seed_epoch_rank_and_key():
    def first(*args):
        it = sample_uniforms(*args)
        return [next(it) for _ in range(5)]

    assert first(1, 2, 0, "a/b") == first(1, 2, 0, "a/b")
    others = [first(2, 2, 0, "a/b"), first(1, 3, 0, "a/b"), first(1, 2, 1, "a/b")]
    others.append(first(1, 2, 0, "a/c"))
    assert all(o != first(1, 2, 0, "a/b") for o in others)
    assert all(0 <= u < 1 for u in first(0, 0, 0, ""))


def test_center_geometry_equals_resizing_the_central_square():
    arr = _photo(300, 200)
    data = _encode(arr, "PNG")  # lossless: the expected pixels are computable exactly
    got = TensorDecoder(Geometry(100, "center"))(data, "k")
    square = torch.from_numpy(arr[:, 50:250]).permute(2, 0, 1)[None].contiguous()
    want = torch.nn.functional.interpolate(square, size=(100, 100), mode="bilinear", antialias=True)
    assert got.shape == (3, 100, 100) and got.dtype == torch.uint8 and got.is_contiguous()
    assert (got.int() - want[0].int()).abs().max() <= 1


def test_flip_mirrors_exactly_the_unflipped_crop():
    data = _encode(_photo(300, 200), "PNG")
    flipped = TensorDecoder(Geometry(64, "center", flip=True), seed=0)
    plain = TensorDecoder(Geometry(64, "center", flip=False), seed=0)
    seen = set()
    for i in range(40):
        a, b = flipped(data, f"k{i}"), plain(data, f"k{i}")
        seen.add(torch.equal(a, b.flip(-1)) and not torch.equal(a, b))
    assert seen == {True, False}  # about half flipped


def test_reduced_dct_scale_matches_a_full_decode_within_resampling_error():
    """Decoding a big JPEG at 1/4 scale before resizing gives nearly the pixels of resizing a
    full decode: the saving does not change what the model sees."""
    arr = _photo(1600, 1200)
    data = _encode(arr, quality=95)
    fast = TensorDecoder(Geometry(224, "center"))(data, "k")
    full = torch.from_numpy(decode_rgb(data)[:, 200:1400]).permute(2, 0, 1)[None].contiguous()
    slow = torch.nn.functional.interpolate(full, size=(224, 224), mode="bilinear", antialias=True)
    diff = (fast.int() - slow[0].int()).abs().float()
    assert diff.mean() < 3


def test_an_out_buffer_of_either_layout_receives_the_same_pixels():
    data = _encode(_photo(120, 90))
    dec = TensorDecoder(None)
    ref = dec(data)
    chw = torch.zeros((3, 90, 120), dtype=torch.uint8)
    hwc = torch.zeros((90, 120, 3), dtype=torch.uint8)
    assert torch.equal(dec(data, "k", chw), ref)
    assert torch.equal(dec(data, "k", hwc.permute(2, 0, 1)), ref)
    with pytest.raises(InputError, match="'k' is 120x90 but its batch holds 100x90.*decode=Decode"):
        dec(data, "k", torch.zeros((3, 90, 100), dtype=torch.uint8))


def test_geometry_arguments_are_checked():
    with pytest.raises(InputError, match="crop="):
        Geometry(10, "middle")
    with pytest.raises(InputError, match="size="):
        Geometry(0)


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """14 JPEGs of different sizes plus a PNG, packed into 3 shards."""
    base = tmp_path_factory.mktemp("geom")
    for i in range(15):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        arr = _photo(60 + 17 * i, 40 + 11 * i, seed=i)
        if i == 7:
            Image.fromarray(arr).save(d / f"im{i:02d}.png")
        else:
            Image.fromarray(arr).save(d / f"im{i:02d}.jpg", quality=90)
    pack(str(base / "src"), str(base / "tar"), shard_size=15000, progress=False)
    return str(base / "tar")


@pytest.mark.parametrize("crop", ["center", "random"])
def test_geometry_through_a_plain_dataloader_repeats_and_changes_with_the_epoch(varied, crop):
    def epoch_images(epoch):
        shape = CenterCrop(32, 32) if crop == "center" else RandomResizedCrop(32)
        ds = ShardDataset(varied, decode=Decode(crop=shape, flip=True), with_keys=True)
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=4, num_workers=2)
        out = {}
        for images, _, keys in loader:
            assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.uint8
            out.update(zip(keys, images, strict=True))
        return out

    a, b, c = epoch_images(0), epoch_images(0), epoch_images(1)
    assert len(a) == 15 and a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # a run repeats
    changed = sum(not torch.equal(a[k], c[k]) for k in a)
    assert changed >= (5 if crop == "random" else 1)  # new crops (random) / new flips (center)


def test_size_needs_tensor_decode(varied):
    with pytest.raises(InputError, match='size=32 needs decode="tensor"'):
        ShardDataset(varied, size=32)  # the retired keyword: refused before it could warn


def test_the_fast_idct_is_opt_in_and_within_its_documented_difference(tmp_path):
    from shardkit import ShardDataset, pack
    from shardkit.errors import InputError
    from shardkit.images.decode import FAST_DCT_DIFFERENCE

    rng = np.random.default_rng(3)
    d = tmp_path / "src" / "c"
    d.mkdir(parents=True)
    for i in range(4):
        y, x = np.mgrid[0:90, 0:120]
        img = np.stack([x * 2, y * 2, (x + y)], -1) + rng.normal(0, 20, (90, 120, 3))
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(d / f"{i}.jpg", quality=90)
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), progress=False)
    for crop in (None, RandomResizedCrop(48)):
        flip = crop is not None

        def images(dct, crop=crop, flip=flip):
            decode = Decode("tensor", crop=crop, flip=flip, dct=dct)
            return {
                k: x
                for x, _, k in ShardDataset(str(tmp_path / "tar"), decode=decode, with_keys=True)
            }

        accurate, fast = images("accurate"), images("fast")
        diffs = [int((accurate[k].int() - fast[k].int()).abs().max()) for k in accurate]
        assert 0 < max(diffs) <= FAST_DCT_DIFFERENCE  # another IDCT ran, within its bound
    with pytest.raises(InputError, match="dct="):
        ShardDataset(str(tmp_path / "tar"), decode=Decode("tensor", dct="fastest"))
