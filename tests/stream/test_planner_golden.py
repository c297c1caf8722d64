"""The planner's output, pinned: the keys every worker reads, its slices and its checkpoint
states over plain, split, subset, sized and mixed epochs, digested and compared with the digest
the planner gave before plain and drawn epochs were planned in one place. A change of any key's
place, any slice or any state_dict (which saved checkpoints must keep loading) fails here."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.shuffle import Order
from shardkit.stream.world import World
from shardkit.write.writer import ShardWriter

#: sha256 of ``_grid``'s record, as the planner of before gave it (commit 375000e)
GOLDEN = "ec662087c3d0a13ceab25add693e23ce811fb95917724971b5d6f751d2ccf3c5"


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """211 and 67 samples of fixed bytes in tar shards of ~16 samples (sizes fixed by tar)."""
    base = tmp_path_factory.mktemp("golden")
    out = []
    for name, n in (("a", 211), ("b", 67)):
        with ShardWriter(str(base / name), format="tar", shard_size="24KB", classes=["x"]) as w:
            for i in range(n):
                w.add(f"{name}{i:04d}", "jpg", b"%d" % i, 0)
        out.append(str(base / name))
    return out


def _keys(records, n=None) -> list[str]:
    out = []
    for rec in records:
        out.append(rec.key)
        if n is not None and len(out) >= n:
            break
    return out


def _grid(a: str, b: str) -> dict:
    keys = [f"a{i:04d}" for i in range(211)]
    cases = {
        "plain": dict(source=a),
        "source": dict(source=Source(a)),
        "val": dict(source=Source(a, split="val", val_fraction=0.3)),
        "subset": dict(source=Source(a, subset=0.4)),
        "keys": dict(source=Source(a, subset=keys[::7])),
        "sized": dict(source=a, epoch_size=90),
        "mix": dict(source=[Source(a, weight=0.7), Source(b, weight=0.3)], epoch_size=120),
    }
    orders = {"default": Order(), "drop": Order(buffer_size=7, equalize="drop")}
    rec = {}
    for (cname, kw), (oname, order), seed, bs in (
        (c, o, s, b) for c in cases.items() for o in orders.items() for s in (3,) for b in (None, 4)
    ):

        def make(ws=3, kw=kw, order=order, seed=seed, bs=bs):
            return ShardDataset(order=order, seed=seed, rank=1, world_size=ws, batch_size=bs, **kw)

        ds, tag = make(), f"{cname}/{oname}/{seed}/{bs}"
        rec[tag] = len(ds)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            for w in (0, 1):
                world = World(1, 3, w, 2)
                rec[f"{tag}/{epoch}/{w}"] = _keys(ds.records(world, epoch))
                rec[f"{tag}/{epoch}/{w}/plan"] = [
                    (s.shard, s.start, s.stop) for s in ds.plan(world, epoch)
                ]
                mid = make()
                mid.set_epoch(epoch)
                _keys(mid.records(world, epoch), 9)
                rec[f"{tag}/{epoch}/{w}/state"] = mid.state_dict()
            pos = ds.position(3, num_workers=2, batch_size=4, cut=bs)
            rec[f"{tag}/{epoch}/pos"] = pos
            rec[f"{tag}/{epoch}/wpos"] = ds.worker_position([5, 2], 1, cut=bs)
            other = make(ws=2)  # elastic: the rest of the epoch re-split over another world
            other.load_state_dict(pos)
            rec[f"{tag}/{epoch}/elastic"] = _keys(other.records(World(1, 2), other.epoch))
    return rec


def test_the_planner_gives_what_it_gave(packs, tmp_path):
    """Pinned on the packs as written before the key file (the split reads every index, the
    checkpoint's ``mix`` digests every member's position)."""
    from conftest import without_key_file

    plain = [without_key_file(p, str(tmp_path / os.path.basename(p))) for p in packs]
    rec = _grid(*plain)
    digest = hashlib.sha256(json.dumps(rec, sort_keys=True, default=list).encode()).hexdigest()
    assert digest == GOLDEN, (digest, len(rec))


def test_the_key_file_changes_nothing_but_a_splits_member_digest(packs, tmp_path):
    """With the key file (as ``ShardWriter`` writes it) every key, slice and state is the one
    pinned above, but for a split's ``mix`` and a subset by keys', which is then of what
    vouches for its members (``k1:``, no index read) where it was of every member's
    position."""
    from conftest import without_key_file

    plain = [without_key_file(p, str(tmp_path / os.path.basename(p))) for p in packs]
    keyed, before = _grid(*packs), _grid(*plain)
    assert keyed.keys() == before.keys()
    kinds = set()
    for tag, got in keyed.items():
        was = before[tag]
        if isinstance(got, dict) and "dataset" in got:
            mix = got["dataset"].get("mix")
            kinds.add((tag.split("/")[0], str(mix)[:3] == "k1:"))
            assert str(mix)[:3] == "k1:" or mix == was["dataset"].get("mix"), tag
            strip = {"mix": None}
            got = {**got, "dataset": {**got["dataset"], **strip}}
            was = {**was, "dataset": {**was["dataset"], **strip}}
        assert got == was, tag
    assert {c for c, k1 in kinds if k1} == {"val", "keys"}
