"""ShardLoader(decode_on="device"/"auto") with ``StandInDecoder``: the device path's structure
(decode threads, lanes, ordering, the CPU fallback, "auto"'s split) on a machine without a GPU
or nvImageCodec. The stand-in decodes on the CPU and sleeps a set time per image, releasing the
GIL as nvImageCodec's calls do; the batches must be the CPU path's, in its order."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from conftest import gradient_photo

from shardkit import CenterCrop, Decode, Order, RandomResizedCrop, ShardDataset, ShardLoader, pack
from shardkit.errors import SampleError
from shardkit.images.decode import decode_rgb
from shardkit.images.device import MAX_MEAN_DIFFERENCE, StandInDecoder, place
from shardkit.loader import epoch as epoch_mod

pytestmark = [pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning")]

N = 24
_photo = gradient_photo


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """JPEGs of two sizes and one PNG, in 2 classes."""
    base = tmp_path_factory.mktemp("standin")
    for i in range(N):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        img = _photo(i, *((120, 90) if i % 3 else (96, 128)))
        img.save(d / f"im{i:02d}.{'png' if i == 4 else 'jpg'}", quality=90)
    pack(str(base / "src"), str(base / "tar"), shard_size=40_000, progress=False)
    return str(base / "tar")


def _ds(path, **kw):
    kw.setdefault("decode", "tensor")
    return ShardDataset(path, with_keys=True, **kw)


class _Counting(StandInDecoder):
    """A stand-in that counts the decode calls in flight at once, across its lanes."""

    lock = threading.Lock()
    now = most = 0

    def decode(self, buffers, boxes, stream=None):
        with self.lock:
            _Counting.now += 1
            _Counting.most = max(_Counting.most, _Counting.now)
        try:
            return super().decode(buffers, boxes, stream)
        finally:
            with self.lock:
                _Counting.now -= 1


def _lanes(seconds: list[float]):
    """A factory building one stand-in per decode thread, the i-th sleeping ``seconds[i]`` per
    image (a slow first lane and a fast second one: batches finish out of order)."""
    built: list[StandInDecoder] = []
    _Counting.now = _Counting.most = 0

    def factory(device=None, upsampling=None):
        built.append(_Counting(device, seconds=seconds[len(built) % len(seconds)]))
        return built[-1]

    return factory, built


def _full_scale(ds, key_data: dict, size: int, epoch: int) -> dict:
    """Each sample's CPU-path box cut from its full-size decode, resized by ``place``."""
    dec = ds.tensor_decoder(epoch)
    out = {}
    for key, data in key_data.items():
        box = dec.crop_box(data, key)
        full = torch.from_numpy(decode_rgb(data))
        img = torch.empty((3, size, size), dtype=torch.uint8)
        place(full[box.top : box.top + box.h, box.left : box.left + box.w], size, box.flip, img)
        out[key] = img
    return out


@pytest.mark.parametrize("decode_on", ["device", "auto"])
def test_stand_in_batches_are_the_cpu_paths_in_order_over_epochs(shards, decode_on, monkeypatch):
    """Two decode threads on two lanes, the first ten times slower, two batches staged ahead
    as on CUDA (both lanes decode at once): every epoch's batches come
    in the CPU path's order with its samples, each the full-scale decode of the CPU path's box
    and flip (a level at most; under "auto" the workers' share is the CPU path's own) and,
    over the epoch, near the CPU path's own pixels."""
    monkeypatch.setattr(epoch_mod, "DECODE_THREADS", 2)
    geo = dict(decode=Decode(crop=RandomResizedCrop(32), flip=True), seed=5)
    ds = _ds(shards, **geo)
    raw = {k: d for d, _, k in ShardDataset(shards, decode="raw", with_keys=True)}
    factory, built = _lanes([0.01, 0.001])
    cpu = ShardLoader(ds, 3, num_workers=2)
    loader = ShardLoader(ds, 3, num_workers=2, decode_on=decode_on, _decoder_factory=factory)
    assert "stand-in" in repr(loader)
    loader._ahead = 2  # as on CUDA: two batches staged ahead, so both lanes decode at once
    for epoch in range(3):
        cpu.set_epoch(epoch)
        loader.set_epoch(epoch)
        want = [(list(k), x.clone()) for x, _, k in cpu]
        got = [(list(k), x.clone()) for x, _, k in loader]
        assert [k for k, _ in got] == [k for k, _ in want]  # the same batches, in order
        assert sum(len(k) for k, _ in got) == N
        reference = _full_scale(ds, raw, 32, epoch)
        for (keys, x), (_, y) in zip(got, want, strict=True):
            for j, k in enumerate(keys):
                if decode_on == "auto" and torch.equal(x[j], y[j]):
                    continue  # decoded by a worker: the CPU path's own pixels
                assert (x[j].int() - reference[k].int()).abs().max() <= 1, (epoch, k)
        diff = torch.cat(
            [
                (x.float() - y.float()).abs().flatten()
                for (_, x), (_, y) in zip(got, want, strict=True)
            ]
        )
        assert float(diff.mean()) <= MAX_MEAN_DIFFERENCE  # the CPU path decodes at DCT scale
    decoded = sum(d.images for d in built)
    assert decoded > 0 and loader.feed_counts.as_dict()["device_cpu_fallback"] == 0  # none declined
    if decode_on == "device":  # every image through the stand-ins, both lanes taking turns
        assert decoded == 3 * N and len(built) == 2 and all(d.calls > 0 for d in built)
        assert _Counting.most == 2  # the two lanes decoded at once (the GIL released)
    loader.close()
    cpu.close()


def test_what_the_stand_in_cannot_decode_reaches_the_cpu_fallback(tmp_path):
    """A header no decoder reads: declined by the stand-in, then named by the CPU decoder."""
    d = tmp_path / "src" / "c"
    d.mkdir(parents=True)
    for i in range(4):
        _photo(i).save(d / f"im{i}.jpg")
    buf = io.BytesIO()
    _photo(9).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    data[2:40] = b"\xff" * 38
    (d / "im2.jpg").write_bytes(bytes(data))
    pack(str(tmp_path / "src"), str(tmp_path / "tar"), progress=False, on_error="skip")
    ds = ShardDataset(str(tmp_path / "tar"), decode="tensor", order=Order(shuffle=False))
    stand_in = StandInDecoder()
    loader = ShardLoader(
        ds, 2, num_workers=0, decode_on="device", _decoder_factory=lambda *a, **k: stand_in
    )
    with pytest.raises(SampleError, match=r"shard-\d+\.tar: sample 'c/im2'"):
        list(loader)
    assert stand_in.declined == 1
    loader.close()


def test_the_stub_decodes_nothing_and_keeps_the_batches(shards):
    """``stub=True`` (bench_device --stub): every sample through one decode call per batch,
    the batches' keys and shapes the CPU path's (the pixels are not decoded)."""
    ds = _ds(shards, decode=Decode(crop=CenterCrop(16, 16)), order=Order(shuffle=False))
    want = [(list(k), x.shape) for x, _, k in ShardLoader(ds, 4, num_workers=0)]
    stub = StandInDecoder(stub=True)
    loader = ShardLoader(
        ds, 4, num_workers=0, decode_on="device", _decoder_factory=lambda *a, **k: stub
    )
    assert [(list(k), x.shape) for x, _, k in loader] == want
    assert stub.images == N and stub.calls == N // 4
    loader.close()
