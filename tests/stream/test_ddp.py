"""A real two-process DistributedDataParallel run (gloo on 127.0.0.1) over ShardDataset."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import gloo_rank, run_ranks
from PIL import Image

from shardkit.write.packer import pack

pytestmark = pytest.mark.slow  # spawned ranks over gloo

N = 22  # even: with 2 ranks nothing is padded, so "exactly once" is exact
WORLD = 2


def _train(rank: int, port: int, data_dir: str, out_dir: str) -> None:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from shardkit.stream.dataset import ShardDataset

    with gloo_rank(rank, port, WORLD):
        torch.manual_seed(0)
        ds = ShardDataset(data_dir, decode="tensor", with_keys=True, seed=11)
        assert (ds.rank, ds.world_size) == (rank, WORLD)  # discovered from torch.distributed
        ds.set_epoch(0)
        loader = DataLoader(ds, batch_size=4, num_workers=2)
        model = DistributedDataParallel(torch.nn.Linear(3, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps, keys = 0, []
        for images, labels, batch_keys in loader:
            features = images.float().mean(dim=(2, 3)) / 255.0
            loss = F.cross_entropy(model(features), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            keys += list(batch_keys)
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": steps, "len": len(ds), "keys": keys, "weights": weights}, f)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    for i in range(N):
        d = base / "src" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (i * 10, 100, 200 - i)).save(d / f"im{i:02d}.jpg")
    pack(str(base / "src"), str(base / "out"), shard_size=9000, progress=False)
    return str(base / "out")


def test_two_rank_ddp_epoch(shards, tmp_path):
    run_ranks(_train, WORLD, shards, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[0]["steps"] == results[1]["steps"] > 0
    assert results[0]["len"] == results[1]["len"] == N // WORLD
    all_keys = results[0]["keys"] + results[1]["keys"]
    assert len(all_keys) == N and len(set(all_keys)) == N  # every sample exactly once
    assert results[0]["weights"] == results[1]["weights"]  # DDP kept the replicas in sync
