"""ShardLoader(decode_on="device"): the workers hand over stored bytes and crop boxes, the training
process decodes with nvImageCodec. Without a GPU this runs nvImageCodec's CPU backend through the
same calls; the CUDA-only lines have their own tests, skipped without a GPU."""

from __future__ import annotations

import gc
import io
import os
import time

import numpy as np
import pytest
import simplejpeg
import torch
from conftest import gradient_photo

from shardkit import CenterCrop, Decode, Order, RandomResizedCrop, ShardDataset, ShardLoader, pack
from shardkit.errors import InputError, SampleError
from shardkit.images import device as device_decode
from shardkit.images.decode import decode_rgb
from shardkit.images.device import MAX_MEAN_DIFFERENCE, device_decode_available, place

pytestmark = [
    pytest.mark.skipif(not device_decode_available(), reason="needs nvImageCodec (shardkit[gpu])"),
    pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:skipped:RuntimeWarning"),
]

N = 24
_photo = gradient_photo


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """JPEGs of two sizes (one PNG, one CMYK JPEG) in 2 classes."""
    base = tmp_path_factory.mktemp("device")
    for i in range(N):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        img = _photo(i, *((120, 90) if i % 3 else (96, 128)))
        if i == 4:
            img.save(d / f"im{i:02d}.png")
        elif i == 7:
            img.convert("CMYK").save(d / f"im{i:02d}.jpg", quality=90)
        else:
            img.save(d / f"im{i:02d}.jpg", quality=90)
    pack(str(base / "src"), str(base / "tar"), shard_size=40_000, progress=False)
    return str(base / "tar")


def _ds(path, **kw):
    kw.setdefault("decode", "tensor")
    kw.setdefault("with_keys", True)
    return ShardDataset(path, **kw)


def _epoch(loader):
    keys, images = [], {}
    for x, _, k in loader:
        keys += k
        images.update(zip(k, x.clone(), strict=True))
    return keys, images


def _full_scale_reference(path, size, seed, key_data, ds):
    """What the device path must give: the crop box of the CPU path, cut from a full-size decode
    (Pillow's libjpeg-turbo, as nvImageCodec's CPU backend), resized and flipped by ``place``."""
    dec = ds.tensor_decoder(0)
    out = {}
    for key, data in key_data.items():
        box = dec.crop_box(data, key)
        full = torch.from_numpy(decode_rgb(data, pillow=True))
        img = torch.empty((3, size, size), dtype=torch.uint8)
        place(full[box.top : box.top + box.h, box.left : box.left + box.w], size, box.flip, img)
        out[key] = img
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_device_decode_gives_the_cpu_paths_samples_order_and_boxes(shards, workers, monkeypatch):
    monkeypatch.setenv("SHARDKIT_DEVICE_UPSAMPLING", "fancy")  # libjpeg's, as the reference
    geo = dict(decode=Decode(crop=RandomResizedCrop(48), flip=True), seed=7)
    ds = _ds(shards, **geo)
    cpu_keys, cpu = _epoch(ShardLoader(ds, 5, num_workers=workers))
    loader = ShardLoader(ds, 5, num_workers=workers, decode_on="device")
    keys, dev = _epoch(loader)
    assert keys == cpu_keys and len(keys) == N  # same samples, same order
    raw = {k: d for d, _, k in _ds(shards, decode="raw")}
    reference = _full_scale_reference(shards, 48, 7, raw, ds)
    for k in keys:  # the same boxes and flips, decoded at full scale; the batch's float resize
        # rounds where the CPU's uint8 kernel rounds its fixed-point sums: a level at most
        assert (dev[k].int() - reference[k].int()).abs().max() <= 1, k
    diff = torch.stack([(dev[k].float() - cpu[k].float()).abs().mean() for k in keys])
    assert float(diff.mean()) <= MAX_MEAN_DIFFERENCE
    assert "nvImageCodec CPU backend" in repr(loader)
    loader.close()


def test_a_bicubic_crop_object_gives_torchs_bicubic_of_the_cpu_paths_boxes(shards, monkeypatch):
    """``crop=RandomResizedCrop(..., interpolation="bicubic")`` on the device: each sample the
    float antialiased bicubic of its CPU-path box (a level at most), near the CPU path's pixels."""
    from shardkit import RandomResizedCrop

    monkeypatch.setenv("SHARDKIT_DEVICE_UPSAMPLING", "fancy")
    crop = RandomResizedCrop(48, scale=(0.9, 1.0), interpolation="bicubic")
    ds = _ds(shards, decode=Decode(crop=crop, flip=True), seed=4)
    cpu_keys, cpu = _epoch(ShardLoader(ds, 5, num_workers=0))
    loader = ShardLoader(ds, 5, num_workers=0, decode_on="device")
    keys, dev = _epoch(loader)
    loader.close()
    assert keys == cpu_keys and len(keys) == N
    dec = ds.tensor_decoder(0)
    for data, _, k in _ds(shards, decode="raw"):
        box = dec.crop_box(data, k)
        full = torch.from_numpy(decode_rgb(data, pillow=True)).permute(2, 0, 1).float()
        x = full[None, :, box.top : box.top + box.h, box.left : box.left + box.w]
        x = x.flip(-1) if box.flip else x
        ref = torch.nn.functional.interpolate(
            x, size=(48, 48), mode="bicubic", antialias=True, align_corners=False
        )[0]
        assert (dev[k].int() - ref.round().clamp(0, 255).int()).abs().max() <= 1, k
    diff = torch.stack([(dev[k].float() - cpu[k].float()).abs().mean() for k in keys])
    assert float(diff.mean()) <= MAX_MEAN_DIFFERENCE


def test_full_size_images_without_size_equal_the_cpu_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDKIT_DEVICE_UPSAMPLING", "fancy")  # libjpeg's own pixels
    for i in range(6):
        d = tmp_path / "src" / "c"
        d.mkdir(parents=True, exist_ok=True)
        _photo(i).save(d / f"{i}.jpg", quality=85)
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), progress=False)
    ds = _ds(str(tmp_path / "tar"))
    keys, cpu = _epoch(ShardLoader(ds, 4, num_workers=0))
    dkeys, dev = _epoch(ShardLoader(ds, 4, num_workers=0, decode_on="device", channels_last=True))
    assert dkeys == keys
    assert all(torch.equal(dev[k], cpu[k]) for k in keys)


def test_normalised_device_batches_match_the_formula(shards):
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    ds = _ds(shards, decode=Decode(crop=CenterCrop(32, 32)))
    _, plain = _epoch(ShardLoader(ds, 6, num_workers=0, decode_on="device"))
    loader = ShardLoader(ds, 6, num_workers=0, decode_on="device", normalize=(mean, std))
    for x, _, keys in loader:
        assert x.dtype == torch.float32
        for img, k in zip(x, keys, strict=True):
            want = (plain[k].float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(
                std
            ).view(3, 1, 1)
            # normalised from the unrounded resize: within half a level of the uint8 batch's
            assert torch.allclose(img, want, atol=0.5 / 255 / min(std) + 1e-5)


def test_images_the_device_decoder_declines_are_decoded_on_the_cpu_in_the_same_batch(
    shards, monkeypatch
):
    """A GPU backend declines PNG (and may decline CMYK): here the CPU backend takes everything,
    so the decline is imposed on the real decoder's answer for non-JPEG bytes."""
    real = device_decode.DeviceDecoder.decode
    declined = []

    def decline_png(self, buffers, boxes, stream=None):
        out = real(self, buffers, boxes, stream)
        for i, buf in enumerate(buffers):
            if bytes(buf[:4]) == b"\x89PNG":
                out[i] = None
                declined.append(i)
        return out

    monkeypatch.setattr(device_decode.DeviceDecoder, "decode", decline_png)
    ds = _ds(shards, decode=Decode(crop=CenterCrop(48, 48)))
    cpu_keys, cpu = _epoch(ShardLoader(ds, 8, num_workers=0))
    keys, dev = _epoch(ShardLoader(ds, 8, num_workers=0, decode_on="device"))
    assert declined and keys == cpu_keys
    assert torch.equal(dev["c0/im04"], cpu["c0/im04"])  # the PNG: the CPU path's own pixels


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    base = tmp_path_factory.mktemp("broken")
    d = base / "src" / "c"
    d.mkdir(parents=True)
    for i in range(6):
        _photo(i).save(d / f"im{i}.jpg")
    buf = io.BytesIO()
    _photo(9).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    data[2:40] = b"\xff" * 38  # markers destroyed: no decoder can read the header
    (d / "im3.jpg").write_bytes(bytes(data))
    pack(str(base / "src"), str(base / "tar"), progress=False, on_error="skip")
    return str(base / "tar")


@pytest.mark.parametrize("size", [None, 24])
def test_an_undecodable_sample_names_shard_and_key_or_is_counted(broken, size):
    if size is None:  # the header is read in the worker only to crop: the device decides
        ds = _ds(broken, order=Order(shuffle=False))
        with pytest.raises(SampleError, match=r"shard-\d+\.tar: sample 'c/im3'") as err:
            list(ShardLoader(ds, 3, num_workers=0, decode_on="device"))
        assert "()" not in str(err.value)  # no empty extension
    skipping = _ds(broken, decode=Decode(crop=CenterCrop(size or 24, size or 24)), on_error="skip")
    loader = ShardLoader(skipping, 3, num_workers=2, decode_on="device")
    keys, _ = _epoch(loader)
    assert sorted(keys) == [f"c/im{i}" for i in (0, 1, 2, 4, 5)] and skipping.skipped == 1
    loader.close()


def test_a_workers_error_ends_the_decode_thread_before_the_ring_is_freed(tmp_path, monkeypatch):
    """A worker's error closes the loader from inside the epoch: the decode thread, which reads
    (and on CUDA copies from) ring slots, must have ended before the ring lets go of them (on
    CUDA: unpins them under an in-flight copy)."""
    import threading

    from shardkit.images.crops import CropError
    from shardkit.loader import ring as ring_mod

    d = tmp_path / "src" / "c"
    d.mkdir(parents=True)
    for i in range(6):
        _photo(i).save(d / f"im{i}.jpg")
    _photo(4, 50, 50).save(d / "im4.jpg")  # the one the policy below fails on, in the worker
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), shuffle=False, progress=False)

    class FailsOnSquares:
        size = 24

        def box(self, height, width, uniforms):
            if height == width:
                raise ValueError("a square")
            return 0, 0, height, width

    alive_at_close = []
    close = ring_mod.Ring.close

    def watched(self):
        names = [t.name for t in threading.enumerate()]
        alive_at_close.append([n for n in names if n.startswith("shardkit-device-decode")])
        close(self)

    monkeypatch.setattr(ring_mod.Ring, "close", watched)
    decode = device_decode.DeviceDecoder.decode

    def slow(self, *a, **kw):  # the decode thread is busy when the worker's error arrives
        time.sleep(0.2)
        return decode(self, *a, **kw)

    monkeypatch.setattr(device_decode.DeviceDecoder, "decode", slow)
    ds = _ds(
        str(tmp_path / "tar"), decode=Decode(crop=FailsOnSquares()), order=Order(shuffle=False)
    )
    loader = ShardLoader(ds, 1, num_workers=1, decode_on="device")
    with pytest.raises(CropError, match="c/im4"):
        list(loader)
    assert alive_at_close and alive_at_close[0] == []
    loader.close()


@pytest.mark.slow
@pytest.mark.parametrize("decode_on", ["device", "auto"])
def test_a_worker_with_no_batch_of_its_own_ends_its_part_cleanly(shards, decode_on):
    """More workers than batches (a small validation set, a rank with few samples): a worker's
    part is empty, its first fill takes no sample and maps no slot; the epoch is the others'."""
    ds = _ds(shards, decode=Decode(crop=CenterCrop(32, 32)))
    cpu = ShardLoader(ds, 8, num_workers=4)  # 3 batches, 4 workers
    want, _ = _epoch(cpu)
    cpu.close()
    loader = ShardLoader(ds, 8, num_workers=4, decode_on=decode_on)
    for _ in range(2):
        keys, _ = _epoch(loader)
        assert keys == want and len(keys) == N
    loader.close()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_whose_every_sample_is_skipped_on_the_device_side_is_not_handed_out(
    broken, workers
):
    """One sample a batch, decided in the training process (no size: no header read in the
    workers): the undecodable one gave an empty batch (a NaN loss), which the workers' path
    never yields. Now the batches are the workers' path's."""
    counts = {}
    for decode_on in ("workers", "device"):
        ds = _ds(broken, on_error="skip", order=Order(shuffle=False))
        loader = ShardLoader(ds, 1, num_workers=workers, decode_on=decode_on)
        counts[decode_on] = [len(x) for x, _, _ in loader]
        assert ds.skipped == 1
        loader.close()
    assert counts["device"] == counts["workers"] == [1] * 5


def test_no_growth_across_epochs_or_after_break(shards):
    ds = _ds(shards, decode=Decode(crop=RandomResizedCrop(32)))
    loader = ShardLoader(ds, 4, num_workers=2, decode_on="device")
    sizes = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        for i, _ in enumerate(loader):
            if epoch % 2 and i == 2:
                break
        gc.collect()
        sizes.append((loader._res.ring.nbytes, len(os.listdir("/proc/self/fd"))))
    # epoch 1 maps the slots epoch 0 left unused (the workers fill it ahead): then nothing more
    assert sizes[2:] == sizes[1:2] * 2 and sizes[1][1] == sizes[0][1]
    assert sizes[1][0] <= 2 * loader._res.ring.slots * 2**20  # at most every slot, of 1 MiB
    loader.close()


def test_device_decode_arguments_are_checked(shards):
    with pytest.raises(InputError, match="decode_on"):
        ShardLoader(_ds(shards), 4, decode_on="gpu")
    with pytest.raises(InputError, match="transform"):
        ShardLoader(_ds(shards, transform=lambda x: x), 4, decode_on="device")


# --- CUDA (skipped without a GPU) ----------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_device_decode_gives_the_cpu_backends_pixels_on_the_gpu(shards, workers):
    ds = _ds(shards, decode=Decode(crop=RandomResizedCrop(48), flip=True))
    keys, ref = _epoch(ShardLoader(ds, 5, num_workers=workers, decode_on="device"))
    loader = ShardLoader(ds, 5, num_workers=workers, decode_on="device", device="cuda")
    assert "nvImageCodec on cuda" in repr(loader)
    got = []
    for x, _, k in loader:  # used on the caller's stream with no synchronize: stream order
        assert x.is_cuda and x.dtype == torch.uint8
        got += k
        diff = torch.stack(
            [(a.float().cpu() - ref[kk].float()).abs().mean() for a, kk in zip(x, k, strict=True)]
        )
        assert float(diff.mean()) <= MAX_MEAN_DIFFERENCE  # nvJPEG's IDCT, not libjpeg's
    assert got == keys
    loader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_decoder_decodes_on_the_device_in_stream_order():
    """Decoded on the given stream: read after that stream only, the pixels are the image's."""
    dec = device_decode.DeviceDecoder(torch.device("cuda"))
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = simplejpeg.encode_jpeg(pixels, quality=100)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (crop,) = dec.decode([np.frombuffer(data, np.uint8)], [None], stream)
        img = dec.tensor(crop)
        total = img.float().sum()  # queued behind the decode on the same stream
    stream.synchronize()
    assert img.is_cuda and tuple(img.shape) == (64, 64, 3)
    cpu = simplejpeg.decode_jpeg(data).astype(np.float64)
    assert abs(float(total) - cpu.sum()) / cpu.size <= MAX_MEAN_DIFFERENCE


# --- decode_on="auto" ----------------------------------------------------------------------------


def _slowed_device(monkeypatch, seconds: float) -> list[int]:
    """The real device decoder, made ``seconds`` slower per image (a busy GPU)."""
    real = device_decode.DeviceDecoder.decode
    sizes = []

    def slow(self, buffers, boxes, stream=None):
        time.sleep(seconds * len(buffers))
        sizes.append(len(buffers))
        return real(self, buffers, boxes, stream)

    monkeypatch.setattr(device_decode.DeviceDecoder, "decode", slow)
    return sizes


def _slowed_workers(monkeypatch, seconds: float) -> None:
    """The workers' CPU decode made ``seconds`` slower per image (busy cores); forked workers
    inherit the patch."""
    from shardkit.loader import fill

    real = fill.Filler._fill

    def slow(self, slot, records, decoder):
        batch = real(self, slot, records, decoder)
        time.sleep(seconds * batch.count)
        return batch

    monkeypatch.setattr(fill.Filler, "_fill", slow)


def _auto_epochs(shards, epochs: int = 3):
    ds = _ds(shards, decode=Decode(crop=CenterCrop(32, 32)))
    reference = {k: x for k, x in zip(*_epoch(ShardLoader(ds, 2, num_workers=0)), strict=False)}
    loader = ShardLoader(ds, 2, num_workers=2, decode_on="auto")
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        keys, _ = _epoch(loader)
        assert sorted(keys) == sorted(reference)  # every sample once, whoever decoded it
    share = loader._balance.sent
    loader.close()
    return share


def test_auto_gives_the_workers_most_batches_when_the_device_is_slow(shards, monkeypatch):
    on_device = _slowed_device(monkeypatch, 0.02)
    share = _auto_epochs(shards)
    assert share >= 0.8 and on_device  # both measured, the workers take most


def test_auto_gives_the_device_most_batches_when_the_workers_are_slow(shards, monkeypatch):
    _slowed_workers(monkeypatch, 0.05)
    share = _auto_epochs(shards)
    assert share <= 0.35  # ~0.1 on a quiet machine; the device side is this process's CPU here


def test_auto_leaves_the_device_alone_when_the_workers_outrun_the_caller(shards, monkeypatch):
    """A model that bounds the step (a sleep per batch: ~40 images/s) takes fewer images than
    the workers alone make (slowed to ~200 images/s, so the device is the faster side): the
    device then decodes only the share that keeps its rate measured, taking nothing from the
    model."""
    _slowed_workers(monkeypatch, 0.01)
    ds = _ds(shards, decode=Decode(crop=CenterCrop(32, 32)))
    loader = ShardLoader(ds, 2, num_workers=2, decode_on="auto")
    for epoch in range(3):
        loader.set_epoch(epoch)
        for _ in loader:
            time.sleep(0.05)
    bal = loader._balance
    loader.close()
    assert bal.sent >= 0.9 and bal.demand < 100, (bal.sent, bal.demand)


def test_auto_batches_are_the_cpu_paths_whichever_side_decoded_them(shards):
    ds = _ds(shards, decode=Decode(crop=CenterCrop(32, 32)))
    keys, cpu = _epoch(ShardLoader(ds, 3, num_workers=2))
    loader = ShardLoader(ds, 3, num_workers=2, decode_on="auto")
    got, images = _epoch(loader)
    assert got == keys
    diff = torch.stack([(images[k].float() - cpu[k].float()).abs().mean() for k in keys])
    assert float(diff.mean()) <= MAX_MEAN_DIFFERENCE
    loader.close()


# --- the batch's resize, fallbacks, counts ------------------------------------------------------


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_resize_batch_equals_torchs_antialiased_resize_image_by_image(interpolation):
    """Two batched products with ``aa_weights`` give what F.interpolate gives per image (float,
    antialiased where the CPU path antialiases: any shrink, every bicubic), enlargements and
    flips included."""
    g = torch.Generator().manual_seed(3)
    size, n = 40, 12
    hs = [7, 40, 41, 100, 33, 64, 200, 39, 80, 17, 120, 45]
    ws = [90, 40, 12, 50, 33, 200, 64, 41, 19, 160, 120, 7]
    flips = [bool(i % 3 == 1) for i in range(n)]
    crops = [
        torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
        for h, w in zip(hs, ws, strict=True)
    ]
    padded = torch.randint(0, 256, (n, max(hs), max(ws), 3), dtype=torch.uint8, generator=g)
    for i, c in enumerate(crops):  # garbage around each crop: it must get no weight
        padded[i, : hs[i], : ws[i]] = c
    out = torch.empty((n, 3, size, size), dtype=torch.float32)
    one, zero = torch.ones(1, 3, 1, 1), torch.zeros(1, 3, 1, 1)
    how = dict(interpolation=interpolation)
    device_decode.resize_batch(padded, hs, ws, size, flips, out, one, zero, **how)
    rounded = torch.empty((n, size, size, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    device_decode.resize_batch(padded, hs, ws, size, flips, rounded, **how)
    for i, c in enumerate(crops):
        x = c.permute(2, 0, 1)[None].float()
        x = x.flip(-1) if flips[i] else x
        aa = hs[i] > size or ws[i] > size or interpolation == "bicubic"
        ref = torch.nn.functional.interpolate(
            x, size=(size, size), mode=interpolation, antialias=aa, align_corners=False
        )[0]
        assert (out[i] - ref).abs().max() < 0.02, i
        assert torch.equal(rounded[i], ref.round().clamp(0, 255).to(torch.uint8)) or (
            (rounded[i].int() - ref.round().clamp(0, 255).int()).abs().max() <= 1
        )


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_float16_resize_stays_within_half_a_level_of_float32(interpolation):
    """The CUDA path's dtype (float16 weights and row pass) on ImageNet-sized crops of noise,
    the worst case for rounding, computed here on the CPU: IEEE half rounds the same on a GPU,
    so bicubic's negative lobes in half precision are checked without one."""
    g = torch.Generator().manual_seed(5)
    size = 224
    hs, ws = [375, 300, 224, 500, 180, 400], [500, 280, 224, 375, 200, 420]
    padded = torch.randint(0, 256, (6, 500, 500, 3), dtype=torch.uint8, generator=g)
    one, zero, flips = torch.ones(1, 3, 1, 1), torch.zeros(1, 3, 1, 1), [False, True] * 3
    full = torch.empty((6, 3, size, size), dtype=torch.float32)
    half = torch.empty_like(full)
    how = dict(interpolation=interpolation)
    device_decode.resize_batch(padded, hs, ws, size, flips, full, one, zero, **how)
    device_decode.resize_batch(padded, hs, ws, size, flips, half, one, zero, torch.float16, **how)
    assert (half - full).abs().max() < 0.5 and (half - full).abs().mean() < 0.1


def test_groups_bound_the_padded_batch():
    crops = [device_decode.Crop(None, 0, 0, h, w) for h, w in [(10, 10)] * 5 + [(100, 100)]]
    assert device_decode.groups(crops, limit=10 * 10 * 3 * 3) == [[0, 1, 2], [3, 4], [5]]
    assert device_decode.groups(crops) == [[0, 1, 2, 3, 4, 5]]
    mixed = [device_decode.Crop(None, 0, 0, h, w) for h, w in [(90, 80), (10, 12), (95, 70)]]
    assert device_decode.groups(mixed, limit=2 * 95 * 80 * 3) == [[1, 0], [2]]  # by size


def _declining(monkeypatch, regions=(), wholes=()):
    """The real decoder at the library's boundary, made to decline what an old nvJPEG or a
    backend without PNG refuses: every region ("all" in ``regions``) or the PNG's, and the
    PNG's whole decode ("png" in ``wholes``)."""
    real = device_decode.DeviceDecoder._pass
    seen = {"region": 0, "whole": 0}

    def _pass(self, buffers, boxes, stream):
        out = real(self, buffers, boxes, stream)
        for i, (buf, box) in enumerate(zip(buffers, boxes, strict=True)):
            png = bytes(buf[:4]) == b"\x89PNG"
            if box is not None and (png or "all" in regions):
                out[i] = None
                seen["region"] += 1
            elif box is None and png and "png" in wholes:
                out[i] = None
                seen["whole"] += 1
        return out

    monkeypatch.setattr(device_decode.DeviceDecoder, "_pass", _pass)
    return seen


def test_a_declined_region_is_decoded_whole_on_the_device_and_cropped(shards, monkeypatch):
    ds = _ds(shards, decode=Decode(crop=RandomResizedCrop(48), flip=True), seed=5)
    _, before = _epoch(ShardLoader(ds, 6, num_workers=0, decode_on="device"))
    seen = _declining(monkeypatch, regions=("all",))
    monkeypatch.setenv("SHARDKIT_DEVICE_UPSAMPLING", "fancy")
    loader = ShardLoader(ds, 6, num_workers=0, decode_on="device")
    assert "fast upsampling" in repr(loader)  # the fancy option sets failed their probe
    seen["region"] = 0
    keys, dev = _epoch(loader)
    counts = loader.feed_counts
    assert seen["region"] == N and counts.whole == N and counts.region == 0 and counts.cpu == 0
    for k in keys:  # the same box cut from the whole image: the same pixels
        assert torch.equal(dev[k], before[k]), k


def test_what_the_device_declines_whole_is_counted_and_warned_about_once(shards, monkeypatch):
    _declining(monkeypatch, regions=(), wholes=("png",))
    ds = _ds(shards, decode=Decode(crop=CenterCrop(48, 48)))
    loader = ShardLoader(ds, 6, num_workers=0, decode_on="device")
    with pytest.warns(RuntimeWarning, match=r"1 of 24 images .* training process's CPU"):
        _epoch(loader)
    counts = loader.feed_counts
    assert (counts.cpu, counts.whole, counts.region) == (1, 0, 23)  # the PNG: declined twice
    import warnings

    loader.set_epoch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per loader
        _epoch(loader)
    assert counts.cpu == 2 and counts.delivered == 2 * N
    assert counts.as_dict()["trainer_cpu_us_per_image"] > 0


def test_fast_upsampling_stays_within_the_bound_of_the_cpu_path(shards):
    ds = _ds(shards, decode=Decode(crop=RandomResizedCrop(48), flip=True))
    keys, cpu = _epoch(ShardLoader(ds, 6, num_workers=0))
    loader = ShardLoader(ds, 6, num_workers=0, decode_on="device")
    assert "fast upsampling" in repr(loader)
    dkeys, dev = _epoch(loader)
    assert dkeys == keys
    diff = torch.stack([(dev[k].float() - cpu[k].float()).abs().mean() for k in keys])
    assert 0 < float(diff.mean()) <= MAX_MEAN_DIFFERENCE


def test_upsampling_choice_is_checked(shards, monkeypatch):
    monkeypatch.setenv("SHARDKIT_DEVICE_UPSAMPLING", "smooth")
    with pytest.raises(InputError, match="SHARDKIT_DEVICE_UPSAMPLING='smooth'"):
        ShardLoader(_ds(shards, decode=Decode(crop=CenterCrop(32, 32))), 4, decode_on="device")


def test_a_torch_of_another_cuda_than_the_nvimagecodec_wheel_names_the_extra():
    device_decode.check_cuda_match(13, [13])
    device_decode.check_cuda_match(None, [12])  # a CPU torch: the CPU backend of either wheel
    with pytest.raises(
        Exception, match=r"CUDA 13 but nvidia-nvimgcodec-cu12 .*shardkit\[gpu-cu13\]"
    ):
        device_decode.check_cuda_match(13, [12])
    with pytest.raises(Exception, match=r"shardkit\[gpu-cu12\]"):
        device_decode.check_cuda_match(12, [13])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.slow
def test_cuda_rrc_epoch_decodes_nothing_on_the_cpu_with_torchvision_imported_first(shards):
    """torchvision's own older nvJPEG, loaded first as training scripts do, must not send
    region decodes to the training process's CPU (a fresh process: import order matters)."""
    pytest.importorskip("torchvision")
    code = (
        "import torchvision, sys, torch\n"
        "from shardkit import ShardDataset, ShardLoader\n"
        f"ds = ShardDataset({shards!r}, decode='tensor', size=48, crop='random', flip=True)\n"
        "ld = ShardLoader(ds, 8, num_workers=2, decode_on='device', device='cuda')\n"
        "n = sum(x.shape[0] for x, _ in ld)\n"
        "c = ld.feed_counts\n"
        "print(repr(ld)); print(c.as_dict())\n"
        "jpegs = n - 2  # the PNG and the CMYK JPEG may be declined by GPU backends\n"
        "assert c.region + c.whole >= jpegs and c.cpu <= 2, c\n"
    )
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("upsampling", ["fancy", "fast"])
def test_cuda_both_upsamplings_stay_within_the_bound_of_the_cpu_path(
    shards, upsampling, monkeypatch
):
    monkeypatch.setenv("SHARDKIT_DEVICE_UPSAMPLING", upsampling)
    ds = _ds(shards, decode=Decode(crop=RandomResizedCrop(48), flip=True))
    keys, cpu = _epoch(ShardLoader(ds, 6, num_workers=0))
    loader = ShardLoader(ds, 6, num_workers=0, decode_on="device", device="cuda")
    dkeys, dev = _epoch(loader)
    assert dkeys == keys
    diff = torch.stack([(dev[k].float().cpu() - cpu[k].float()).abs().mean() for k in keys])
    assert float(diff.mean()) <= MAX_MEAN_DIFFERENCE, (upsampling, float(diff.mean()))
    assert loader.feed_counts.cpu <= 2  # the PNG and the CMYK JPEG at most


def test_auto_balance_tries_the_workers_alone_and_backs_off_when_they_fall_short():
    """The controller on its own, with a made-up clock: the workers take nearly all until the
    caller waits; both sides at their rates while it does; the workers alone again once it no
    longer waits, later each time that fell short."""
    from shardkit.loader.device_feed import IDLE_SHARE, PATIENCE, Balance

    bal, now = Balance(worker_s=0.01, device_s=0.001), 0.0

    def steps(n, wait_share):
        nonlocal now
        for _ in range(n):
            now += 0.1
            bal.taken(10, now, waited=0.1 * wait_share)

    steps(30, 0.0)
    assert not bal.split and bal.share(2) == 1.0 - IDLE_SHARE  # fed: the device idles
    steps(5, 0.5)
    assert bal.split and bal.share(2) < 0.5  # waiting: the (faster) device takes most
    split_for, n = bal.since, 0
    while bal.split and n < 100:
        steps(1, 0.0)
        n += 1
    assert not bal.split and split_for + n >= PATIENCE  # tried again, not before PATIENCE
    steps(5, 0.5)
    assert bal.split and bal.patience == 2 * PATIENCE  # they fell short at once: try later
