"""Pipeline stages alone: epoch planning, reading slices, decoding, transforms."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from shardkit.errors import InputError, SampleError, ShardFormatError, StorageError
from shardkit.formats import get_format
from shardkit.images.decode import decode_image
from shardkit.records import Record, ShardInfo, ShardSlice
from shardkit.stream.partition import plan_epoch, rank_samples
from shardkit.stream.shuffle import shard_order
from shardkit.stream.stages import apply_transforms, decode_records, read_slices
from shardkit.stream.storage import LocalStorage

# --- planning ---------------------------------------------------------------------------------


def _positions(counts, slices):
    """Global (shard, index) pairs a list of slices reads."""
    return [(s.shard, i) for s in slices for i in range(s.start, s.stop)]


def _infos(counts):
    """Shard records with these sample counts: what plan_epoch is given."""
    return [ShardInfo(f"s{i}.tar", c) for i, c in enumerate(counts)]


def _plan_all(counts, order, world_size, num_workers, equalize):
    return {
        (r, w): plan_epoch(
            _infos(counts),
            order,
            rank=r,
            world_size=world_size,
            worker=w,
            num_workers=num_workers,
            equalize=equalize,
        )
        for r in range(world_size)
        for w in range(num_workers)
    }


COUNTS = [[7], [3, 5, 0, 4, 1, 9], [1, 1, 1], [10, 10, 10, 10], [2]]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_plan_covers_every_sample_as_equalize_promises(counts, world_size, num_workers):
    n = sum(counts)
    order = shard_order(len(counts), seed=5, epoch=1)
    everything = sorted((s, i) for s, c in enumerate(counts) for i in range(c))
    for equalize in ("pad", "drop", "none"):
        if equalize != "pad" and n < world_size:
            continue
        plans = _plan_all(counts, order, world_size, num_workers, equalize)
        per_rank = [
            sum(len(s) for w in range(num_workers) for s in plans[r, w]) for r in range(world_size)
        ]
        got = sorted(p for sl in plans.values() for p in _positions(counts, sl))
        for r in range(world_size):
            assert per_rank[r] == rank_samples(n, r, world_size, equalize)
        if equalize == "none":
            assert got == everything
            assert max(per_rank) - min(per_rank) <= 1
        elif equalize == "drop":
            assert per_rank == [n // world_size] * world_size
            assert len(set(got)) == len(got)  # nothing twice
        else:
            per = -(-n // world_size)
            assert per_rank == [per] * world_size
            assert sorted(set(got)) == everything  # everything at least once
            assert len(got) - len(everything) == per * world_size - n
        for sl in plans.values():
            for s in sl:
                assert 0 <= s.start < s.stop <= counts[s.shard]


@pytest.mark.parametrize("equalize", ["pad", "drop"])
def test_worker_parts_match_across_ranks_and_differ_by_at_most_one(equalize):
    counts = [3, 5, 0, 4, 1, 9, 2]
    plans = _plan_all(counts, np.arange(len(counts)), 3, 4, equalize)
    sizes = {r: [sum(map(len, plans[r, w])) for w in range(4)] for r in range(3)}
    assert sizes[0] == sizes[1] == sizes[2]
    assert max(sizes[0]) - min(sizes[0]) <= 1


def test_one_shard_feeds_every_worker_of_every_rank():
    plans = _plan_all([12], [0], 2, 3, "pad")
    assert all(sum(map(len, sl)) == 2 for sl in plans.values())
    assert plans[0, 0] == [ShardSlice(0, 0, 2)]
    assert plans[1, 2] == [ShardSlice(0, 10, 12)]


def test_pad_rereads_the_start_of_the_epoch_stream():
    # Stream order: shard 1 (2 samples) then shard 0 (3): 5 samples, 2 ranks -> 3 each.
    plans = _plan_all([3, 2], [1, 0], 2, 1, "pad")
    assert plans[0, 0] == [ShardSlice(1, 0, 2), ShardSlice(0, 0, 1)]
    assert plans[1, 0] == [ShardSlice(0, 1, 3), ShardSlice(1, 0, 1)]


def test_drop_leaves_out_the_tail_of_the_epoch_stream():
    plans = _plan_all([3, 2], [1, 0], 2, 1, "drop")
    assert plans[0, 0] == [ShardSlice(1, 0, 2)]
    assert plans[1, 0] == [ShardSlice(0, 0, 2)]


def test_plan_follows_shard_order():
    order = shard_order(6, seed=0, epoch=3)
    sl = plan_epoch(_infos([2] * 6), order, rank=0, world_size=1, worker=0, num_workers=1)
    assert [s.shard for s in sl] == order.tolist()


def test_unknown_equalize_mode():
    with pytest.raises(InputError, match="equalize"):
        plan_epoch(_infos([3]), [0], rank=0, world_size=1, worker=0, num_workers=1, equalize="even")


# --- reading ----------------------------------------------------------------------------------


def _jpeg(value: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (6, 4), value if mode == "L" else (value, 255 - value, 7)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def shards(tmp_path):
    """Two real tar shards and two LMDB shards of 3 and 4 samples."""
    out = {}
    for fmt_name in ("tar", "lmdb"):
        fmt = get_format(fmt_name)
        urls = []
        k = 0
        for s, n in enumerate([3, 4]):
            path = str(tmp_path / f"shard-{s:06d}{fmt.suffix}")
            w = fmt.open_writer(path)
            for _ in range(n):
                w.add(f"cls/k{k}", "jpg", _jpeg(10 * k), k % 2)
                k += 1
            w.close()
            urls.append(ShardInfo(path, n))
        out[fmt_name] = (fmt, urls)
    return out


@pytest.mark.parametrize("fmt_name", ["tar", "lmdb"])
def test_read_slices_reads_exactly_the_planned_samples(shards, fmt_name):
    fmt, urls = shards[fmt_name]
    slices = [ShardSlice(1, 1, 3), ShardSlice(0, 0, 3), ShardSlice(1, 3, 4)]
    keys = [r.key for r in read_slices(slices, urls, fmt, LocalStorage())]
    assert keys == ["cls/k4", "cls/k5", "cls/k0", "cls/k1", "cls/k2", "cls/k6"]


@pytest.mark.parametrize("fmt_name", ["tar", "lmdb"])
def test_a_shard_shorter_than_planned_raises_naming_it(shards, fmt_name):
    fmt, urls = shards[fmt_name]
    with pytest.raises(ShardFormatError, match="shard-000000"):
        list(read_slices([ShardSlice(0, 1, 5)], urls, fmt, LocalStorage()))


def test_a_missing_shard_raises_naming_it(shards, tmp_path):
    fmt, urls = shards["tar"]
    gone = ShardInfo(str(tmp_path / "shard-000009.tar"), 1)
    with pytest.raises(StorageError, match="shard-000009.tar"):
        list(read_slices([ShardSlice(0, 0, 1)], [gone], fmt, LocalStorage()))


class _RecordingStorage(LocalStorage):
    def __init__(self):
        super().__init__()
        self.hints = []

    def prefetch(self, shards):
        self.hints.append([s.url for s in shards])


def test_storage_hears_about_upcoming_shards(shards):
    fmt, urls = shards["tar"]
    storage = _RecordingStorage()
    list(read_slices([ShardSlice(1, 0, 1), ShardSlice(0, 0, 1)], urls, fmt, storage))
    assert storage.hints == [[urls[1].url, urls[0].url], [urls[0].url]]


# --- decoding ---------------------------------------------------------------------------------


def test_decode_modes():
    data = _jpeg(100)
    assert decode_image(data, "raw") is data
    img = decode_image(data, "pil")
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (6, 4)
    t = decode_image(data, "tensor")
    assert t.dtype == torch.uint8 and tuple(t.shape) == (3, 4, 6)
    assert torch.equal(t, torch.from_numpy(np.array(img)).permute(2, 0, 1))
    assert t.is_contiguous()  # collate then stacks with plain copies
    t[0, 0, 0] = 1  # writable, no aliasing of internal buffers


def test_grayscale_is_converted_to_rgb():
    t = decode_image(_jpeg(80, "L"), "tensor")
    assert tuple(t.shape) == (3, 4, 6)


def _records():
    return [
        Record("a", "jpg", _jpeg(1), 0, "s0.tar"),
        Record("bad", "jpg", b"\xff\xd8\xffnot really a jpeg", 1, "s0.tar"),
        Record("c", "jpg", _jpeg(3), 2, "s1.tar"),
    ]


def test_corrupt_sample_raises_naming_shard_and_key():
    with pytest.raises(SampleError, match=r"s0\.tar.*'bad'") as info:
        list(decode_records(_records(), "pil"))
    assert (info.value.shard, info.value.key) == ("s0.tar", "bad")


def test_corrupt_sample_skipped_warns_and_counts():
    counted = []
    with pytest.warns(RuntimeWarning, match="bad"):
        out = list(
            decode_records(
                _records(),
                "tensor",
                on_error="skip",
                with_keys=True,
                skipped=lambda: counted.append(1),
            )
        )
    assert [(label, key) for _, label, key in out] == [(0, "a"), (2, "c")]
    assert counted == [1]


def test_raw_mode_passes_bytes_and_keys():
    recs = _records()
    out = list(decode_records(recs, "raw", with_keys=True))
    assert out == [(r.data, r.label, r.key) for r in recs]
    assert list(decode_records(recs, "raw")) == [(r.data, r.label) for r in recs]


def test_transforms_apply_to_image_and_label_and_keep_keys():
    samples = [(1, 2, "k1"), (3, 4, "k2")]
    out = list(apply_transforms(samples, lambda x: x * 10, lambda y: -y))
    assert out == [(10, -2, "k1"), (30, -4, "k2")]
    out = list(apply_transforms([(1, 2)], None, str))
    assert out == [(1, "2")]


def test_stages_compose_lazily():
    # Nothing is read before the first sample is asked for: a generator chain, not lists.
    reads = []

    def source():
        for r in _records()[::2]:
            reads.append(r.key)
            yield r

    samples = apply_transforms(decode_records(source(), "raw"), None, None)
    assert reads == []
    first = list(itertools.islice(samples, 1))
    assert len(first) == 1 and reads == ["a"]
