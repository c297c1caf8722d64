"""What a split or subset holds once built (its arrays' bytes, counted) and that it draws exactly
the samples, in the order, that the whole-array computation of before drew."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from shardkit.formats.sample_index import key_hash
from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.mix import _SUBSET
from shardkit.stream.partition import _DRAW
from shardkit.stream.shuffle import Order, rng_for
from shardkit.stream.view import ShardView
from shardkit.write.writer import ShardWriter

N = 2003  # not a multiple of 8: a split's bits end mid-byte, and shards start mid-byte


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """N samples in ~80 tar shards and the same keys in ~7 LMDB shards."""
    base = tmp_path_factory.mktemp("members")
    out = {}
    for fmt, size in (("tar", "60KB"), ("lmdb", "1MB")):
        with ShardWriter(str(base / fmt), format=fmt, shard_size=size, classes=["x"]) as w:
            for i in range(N):
                w.add(f"k/{i:05d}", "jpg", b"%d" % i, 0)
        out[fmt] = str(base / fmt)
    return out


def _expected(where, seed, epoch, split, subset, n, shuffle) -> list[str]:
    """The epoch's keys computed from every key at once, the way the members were chosen and
    drawn as whole arrays: each key's own hash for its side, the seeded subset draw over the
    member array, then whole passes in a fresh shard order and a partial draw."""
    view = ShardView(where, decode="raw")
    keys = [view.key(i) for i in range(len(view))]
    counts = np.asarray([s.samples for s in view.shards], dtype=np.int64)
    members = np.arange(len(keys), dtype=np.int64)
    if split is not None:
        threshold = math.ceil(0.1 * 2**64)
        val = np.asarray([key_hash(k) < threshold for k in keys])
        members = np.flatnonzero(val if split == "val" else ~val)
    if subset is not None:
        size = max(1, int(round(subset * len(members))))
        rng = rng_for(seed, 0, _SUBSET)
        members = np.sort(rng.choice(members, size=size, replace=False))
    rng = rng_for(seed, epoch, _DRAW, 0)
    m = len(members)
    shard_of = np.searchsorted(np.cumsum(counts), members, side="right")
    passes, rest = divmod(n or m, m)
    out = []
    for p in range(passes + (1 if rest else 0)):
        rank = rng.permutation(len(counts)) if shuffle else np.arange(len(counts))
        pick = np.arange(m)
        if p == passes:
            pick = np.sort(rng.choice(m, size=rest, replace=False))
        out.append(members[pick[np.argsort(rank[shard_of[pick]], kind="stable")]])
    return [keys[i] for i in np.concatenate(out).tolist()]


CASES = [
    ("val", None, None),
    ("train", None, None),
    ("train", 0.3, None),
    ("val", 0.5, 700),  # more than the members: whole passes, then a partial draw
    (None, 0.05, None),
    ("train", None, 1000),  # fewer than the members: a partial pass alone
]


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
@pytest.mark.parametrize(("split", "subset", "n"), CASES)
def test_split_and_subset_epochs_draw_what_the_whole_arrays_drew(packs, fmt, split, subset, n):
    where = packs[fmt]
    for shuffle in (True, False):
        ds = ShardDataset(
            Source(where, split=split, subset=subset), epoch_size=n, decode="raw",
            with_keys=True, seed=11,
            order=Order(buffer_size=0) if shuffle else Order(shuffle=False),
        )  # fmt: skip
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            want = _expected(where, 11, epoch, split, subset, n, shuffle)
            assert len(ds) == len(want)
            assert [s[2] for s in ds] == want, (split, subset, n, shuffle, epoch)


def test_the_draws_and_checkpoint_facts_are_those_of_before(packs):
    """Fixed figures, taken from the whole-array code: the keys of two epochs and the mixture's
    checkpoint fact (a state saved before this representation loads after it)."""
    sources = [
        Source(packs["tar"], split="train", weight=2),
        Source(packs["lmdb"], split="val", subset=0.5, weight=1),
    ]
    ds = ShardDataset(sources, decode="raw", with_keys=True, seed=5, epoch_size=3000)
    digest = hashlib.sha256()
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        for s in ds:
            digest.update(s[2].encode() + b"\n")
    state = ds.state_dict()
    # with the key file ShardWriter writes, the state's digest is of what vouches for the
    # members (``k1:``, no index read); the digest of every position is still the one pinned,
    # and a state carrying it loads
    assert state["dataset"]["mix"].startswith("k1:")
    assert ds._facts.other_kind("mix", "") == MIX_FACT
    ds.load_state_dict({**state, "dataset": {**state["dataset"], "mix": MIX_FACT}})
    assert digest.hexdigest()[:16] == KEYS_DIGEST


MIX_FACT = "658164d60dbf5e301b81f650672170b2"
KEYS_DIGEST = "a08d82d531290e31"


@pytest.mark.parametrize("split", ["val", "train"])
def test_a_split_holds_an_eighth_of_a_byte_a_sample_and_a_few_per_shard(packs, split):
    """Counted: the arrays a built split holds (its members and the val bits the epoch checks
    sides with) are the val bits, 1/8 byte a sample of the dataset, and 24 bytes a shard,
    whichever side: not a position (8 bytes) for each member; construction itself holds one
    shard's hashes at a time (``test_split_reads``)."""
    for fmt in ("tar", "lmdb"):
        ds = ShardDataset(Source(packs[fmt], split=split), decode="raw", seed=1)
        (src,) = ds.sources
        shards = len(src.shards)
        assert src.members.nbytes <= -(-N // 8) + 24 * (shards + 1)
        assert src.val_bits is None or src.val_bits is src.members.val_bits
        share = 0.1 if split == "val" else 0.9
        assert abs(len(src.members) - share * N) < 0.05 * N  # the side it is, not the other


@pytest.mark.parametrize("share", [0.37, 1.0, 3.6])  # a partial pass alone, one pass, passes
def test_an_epoch_draw_answered_by_position_is_the_whole_draw(packs, share):
    """``DrawnIds`` (a one-source epoch's ids, never held whole) gives at every position asked,
    in any order and past a wrap, what the whole draw (``_draw``) holds there."""
    from shardkit.stream.partition import DrawnIds, _draw

    for split, subset in (("train", None), ("val", 0.5), (None, None)):
        # the whole source is a mixture's draw only with an epoch size (alone it is the path)
        sized = {} if split or subset else {"epoch_size": ShardDataset(packs["tar"]).num_samples}
        ds = ShardDataset(Source(packs["tar"], split=split, subset=subset), decode="raw", **sized)
        (src,) = ds.sources
        n = max(1, int(share * len(src.members)))
        for shuffle in (True, False):
            whole = _draw(src, n, rng_for(4, 2, _DRAW, 0), shuffle)
            lazy = DrawnIds(src, n, rng_for(4, 2, _DRAW, 0), shuffle)
            asked = np.random.default_rng(0).integers(0, n, 3 * n)
            assert np.array_equal(lazy[asked], whole[asked])
            assert np.array_equal(
                lazy[np.arange(n // 3, n + n // 3) % n], np.roll(whole, -(n // 3))
            )


@pytest.mark.parametrize("split", ["val", "train"])
def test_a_one_source_epoch_layout_holds_a_few_bytes_a_shard(packs, split):
    """Counted (tracemalloc): the epoch stream of one split source, which every worker builds,
    holds each pass's shard order and member counts (16 bytes a shard), not an id and a source
    number for every drawn sample (16 bytes each: 14.4 a sample of the dataset for train)."""
    import tracemalloc

    from shardkit.stream.partition import MixLayout

    ds = ShardDataset(Source(packs["tar"], split=split), decode="raw", seed=2)
    kw = dict(seed=2, order=Order(buffer_size=0))
    MixLayout.build(ds.sources, ds.shares, epoch=0, **kw)  # the first draw imports its modules
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        layout = MixLayout.build(ds.sources, ds.shares, epoch=1, **kw)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert layout.total == len(ds)
    assert held <= 40 * len(ds.shards) + 1024, held


@pytest.mark.parametrize(("split", "subset", "n"), [("train", None, None), ("val", 0.5, 700)])
def test_each_rank_reads_its_span_of_the_whole_arrays_epoch(packs, split, subset, n):
    """Two ranks (``equalize="pad"``): each reads its contiguous span of the epoch the whole
    arrays give, the last one wrapping to the start, as the stream was cut before."""
    where = packs["tar"]
    want = _expected(where, 11, 1, split, subset, n, True)
    per = -(-len(want) // 2)
    for rank in (0, 1):
        ds = ShardDataset(
            Source(where, split=split, subset=subset), epoch_size=n, decode="raw",
            with_keys=True, seed=11, order=Order(buffer_size=0), rank=rank, world_size=2,
        )  # fmt: skip
        ds.set_epoch(1)
        assert [s[2] for s in ds] == (want * 2)[rank * per : (rank + 1) * per]
