"""ShardLoader with the dataset's fields=: a dict per batch (image, label, key and one list per
field, decoded in the workers), the same values as the dataset gives, with every guarantee."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from shardkit import ShardDataset, ShardLoader, pack
from shardkit.errors import SampleError
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
    ds = _ds(shards, on_error="raise", shuffle=False)
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
    ds = _ds(shards, size=8)
    loader = ShardLoader(ds, 4, num_workers=2, decode_on="device")
    keys = []
    for batch in loader:
        _check(batch)
        keys += batch["key"]
    assert len(keys) == N - 1
    loader.close()
