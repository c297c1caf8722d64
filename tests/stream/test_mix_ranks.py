"""Mixtures through real worker processes: ShardLoader and two gloo ranks checkpointing."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from conftest import gloo_rank, run_ranks
from torch.utils.data import DataLoader

from shardkit import CenterCrop, Decode, Order, ShardDataset, ShardLoader, Source
from shardkit.write.packer import pack

pytestmark = pytest.mark.slow  # worker processes and spawned ranks

B = 16
EPOCH = 640


@pytest.fixture(scope="module")
def two(resume_shards, tmp_path_factory):
    """301 JPEGs in tar shards and 40 others in an LMDB (keys differ: src/ vs lm/)."""
    from conftest import image_tree

    base = tmp_path_factory.mktemp("mixranks")
    image_tree(base / "lm", 40, classes=3)
    out = str(base / "lmdb")
    pack(str(base / "lm"), out, format="lmdb", progress=False)
    return resume_shards, out


def _ds(two, *, equalize="pad", **kw):
    """Two sources mixed 0.7/0.3, a buffer of 30; ``equalize``: the ``Order``'s."""
    kw.setdefault("seed", 5)
    kw.setdefault("order", Order(buffer_size=30, equalize=equalize))
    kw.setdefault("with_keys", True)
    kw.setdefault("epoch_size", EPOCH)
    kw.setdefault("labels", "union")  # class lists c0.. and class0..: mapped by name
    a, b = two
    return ShardDataset([Source(a, weight=0.7), Source(b, weight=0.3)], **kw)


def _keys(batches) -> list[list[str]]:
    return [list(b[2]) for b in batches]


def _src(key: str) -> str:
    return "b" if key.startswith("class") else "a"  # lm/ keys are class*/img*, tar keys c*/i*


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shard_loader_mixture_len_shares_and_resume(two, num_workers):
    loader = ShardLoader(
        _ds(two, decode=Decode("tensor", crop=CenterCrop(8, 8))),
        batch_size=B,
        num_workers=num_workers,
    )
    loader.set_epoch(1)
    full = _keys(loader)
    assert len(full) == len(loader) == EPOCH // B
    assert Counter(_src(k) for b in full for k in b) == {"a": 448, "b": 192}
    for b in full:
        assert abs(sum(_src(k) == "a" for k in b) - 0.7 * B) <= 2
    loader = ShardLoader(
        _ds(two, decode=Decode("tensor", crop=CenterCrop(8, 8))),
        batch_size=B,
        num_workers=num_workers,
    )
    loader.set_epoch(1)
    it = iter(loader)
    before = [list(next(it)[2]) for _ in range(13)]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    again = ShardLoader(
        _ds(two, decode=Decode("tensor", crop=CenterCrop(8, 8))),
        batch_size=B,
        num_workers=num_workers,
    )
    again.load_state_dict(state)
    assert before + _keys(again) == full


def test_shard_loader_mixture_elastic_resume(two):
    before, k = [], 5
    for rank in range(2):
        ds = _ds(
            two,
            decode=Decode("tensor", crop=CenterCrop(8, 8)),
            rank=rank,
            world_size=2,
            equalize="none",
        )
        loader = ShardLoader(ds, batch_size=B, num_workers=2)
        loader.set_epoch(3)
        it = iter(loader)
        before += [key for _ in range(k) for key in next(it)[2]]
        if rank == 0:
            state = loader.state_dict()
        loader.close()
    whole = _ds(two, decode="raw")
    whole.set_epoch(3)
    after = []
    for rank in range(3):
        ds = _ds(
            two,
            decode=Decode("tensor", crop=CenterCrop(8, 8)),
            rank=rank,
            world_size=3,
            equalize="none",
        )
        loader = ShardLoader(ds, batch_size=B, num_workers=1)
        loader.load_state_dict(state)
        after += [key for b in _keys(loader) for key in b]
    assert Counter(before) + Counter(after) == Counter(s[2] for s in whole)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shard_loader_shorter_ranks_state_at_the_epochs_end_ends_it_everywhere(two, num_workers):
    """equalize="none", 641 positions on 2 ranks (320 and 321): rank 0's ShardLoader state after
    its last batch loads as the next epoch on rank 1 and on a world of one; nothing repeats."""
    kw = dict(
        decode=Decode("tensor", crop=CenterCrop(8, 8)),
        equalize="none",
        epoch_size=EPOCH + 1,
    )
    for rank in range(2):
        loader = ShardLoader(_ds(two, rank=rank, world_size=2, **kw), batch_size=B,
                             num_workers=num_workers)  # fmt: skip
        loader.set_epoch(2)
        assert sum(len(b) for b in _keys(loader)) == EPOCH // 2 + rank
        if rank == 0:
            state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
    for rank, world in [(1, 2), (0, 1)]:
        loader = ShardLoader(_ds(two, rank=rank, world_size=world, **kw), batch_size=B)
        loader.load_state_dict(state)
        assert loader.dataset.epoch == 3
        loader.close()


def _gloo_rank(rank: int, port: int, two, out_dir: str, stop: int):
    """Take ``stop`` steps and checkpoint; then, as a restarted job would, build a new dataset
    and loader, load rank 0's state and finish the epoch."""
    import torch

    with gloo_rank(rank, port, 2) as dist:
        out = {}
        for phase in ("before", "after"):
            ds = _ds(two, decode="raw", batch_size=B)  # rank, world: torch.distributed
            if phase == "after":
                with open(os.path.join(out_dir, "state0.json")) as f:
                    ds.load_state_dict(json.load(f))
            else:
                ds.set_epoch(1)
            keys, steps = [], 0
            for _, _, batch_keys in DataLoader(ds, batch_size=B, num_workers=2):
                dist.all_reduce(torch.ones(1))  # ranks step together, as DDP makes them
                steps += 1
                keys += list(batch_keys)
                if phase == "before" and steps == stop:
                    with open(os.path.join(out_dir, f"state{rank}.json"), "w") as f:
                        json.dump(ds.state_dict(batches=steps, num_workers=2), f)
                    break
            out[phase] = {"keys": keys, "steps": steps, "len": len(ds)}
            dist.barrier()  # rank 0's state is on disk before anyone loads it
        with open(os.path.join(out_dir, f"keys{rank}.json"), "w") as f:
            json.dump(out, f)


def test_two_gloo_ranks_mixture_checkpoint_and_resume(two, tmp_path):
    run_ranks(_gloo_rank, 2, two, str(tmp_path), 7)
    states = [json.loads((tmp_path / f"state{r}.json").read_text()) for r in range(2)]
    assert {**states[0], "rank": 1} == states[1]  # one rank's state stands for the world
    got = [json.loads((tmp_path / f"keys{r}.json").read_text()) for r in range(2)]
    per_rank = []
    for rank in range(2):
        ds = _ds(two, decode="raw", batch_size=B, rank=rank, world_size=2)
        ds.set_epoch(1)
        full = [k for b in _keys(DataLoader(ds, batch_size=B, num_workers=2)) for k in b]
        assert got[rank]["before"]["keys"] + got[rank]["after"]["keys"] == full
        assert got[rank]["before"]["steps"] + got[rank]["after"]["steps"] == EPOCH // 2 // B
        per_rank.append(full)
    whole = _ds(two, decode="raw")
    whole.set_epoch(1)
    # Disjoint parts of one epoch: together exactly its draws (the tar source's 448 of 301
    # samples repeat some, the LMDB's 192 of 40 each 4 or 5 times).
    assert Counter(per_rank[0]) + Counter(per_rank[1]) == Counter(s[2] for s in whole)
    assert len(per_rank[0]) == len(per_rank[1]) == EPOCH // 2


def test_mixture_with_dataloader_workers_and_with_keys_off(two):
    ds = _ds(two, decode=Decode("tensor", crop=CenterCrop(8, 8)), with_keys=False, batch_size=B)
    batches = list(DataLoader(ds, batch_size=B, num_workers=2))
    assert len(batches) == EPOCH // B and all(len(b) == 2 for b in batches)


def test_mixture_of_a_local_lmdb_and_s3_tar_resumes_exactly(two, s3):
    """Sources on different storages: the tar one on the S3 test server, the LMDB local."""
    pytest.importorskip("s3fs")
    import uuid
    from pathlib import Path

    from remote_servers import S3Server
    from torchdata.stateful_dataloader import StatefulDataLoader

    bucket = f"mix-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(bucket, "tar", Path(two[0]))
    remote = (f"s3://{bucket}/tar/", two[1])

    def ds():
        a, b = remote
        opts = S3Server.options(s3.endpoint)
        return ShardDataset(
            [Source(a, weight=0.7, storage_options=opts), Source(b, weight=0.3)],
            epoch_size=EPOCH,
            seed=5,
            order=Order(buffer_size=30),
            with_keys=True,
            decode="raw",
            batch_size=B,
            labels="union",
        )

    full = _keys(StatefulDataLoader(ds(), batch_size=B, num_workers=2))
    local = _ds(two, decode="raw", batch_size=B)
    assert full == _keys(DataLoader(local, batch_size=B, num_workers=2))  # storage changes nothing
    loader = StatefulDataLoader(ds(), batch_size=B, num_workers=2)
    it = iter(loader)
    before = [list(next(it)[2]) for _ in range(29)]
    state = loader.state_dict()
    del it, loader
    resumed = StatefulDataLoader(ds(), batch_size=B, num_workers=2)
    resumed.load_state_dict(state)
    assert before + _keys(resumed) == full
