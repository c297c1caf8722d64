"""Two "machines" training from object storage: two ``torchrun --nnodes=2`` launches on
loopback (gloo), one rank each with its own ``cache_dir``, reading the loopback S3 server; then
the epoch resumed on one node. Nothing but torch.distributed and S3 is shared between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image
from remote_servers import S3Server, free_env, free_port

from shardkit.write.packer import pack

pytestmark = pytest.mark.slow  # torchrun launchers and ranks, the S3 server

N = 48  # two ranks, batches of 4: 6 batches each, nothing padded
BATCH = 4

_RANK = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from shardkit import ShardDataset

    url, endpoint, cache, out, mode = sys.argv[1:6]
    BATCH = int(os.environ["TEST_BATCH"])
    opts = {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ShardDataset(url, decode="raw", with_keys=True, equalize="none", batch_size=BATCH,
                      storage_options=opts, cache_dir=cache, seed=5)
    assert (ds.rank, ds.world_size) == (rank, world)  # from torch.distributed, as torchrun set it
    if mode == "resume":
        with open(os.path.join(out, "state.json")) as f:
            ds.load_state_dict(json.load(f))
    else:
        ds.set_epoch(3)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=0)
    half = len(loader) // 2
    keys = []
    for step, (_, _, batch_keys) in enumerate(loader, 1):
        keys.append(list(batch_keys))
        if step == half and mode == "train" and rank == 0:  # the checkpoint of a preemption
            with open(os.path.join(out, "state.json"), "w") as f:
                json.dump(ds.state_dict(batches=half), f)
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"world": world, "batches": len(loader), "keys": keys, "half": half}, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _torchrun(nnodes: int, node: int, port: int, script: Path, *args: str) -> subprocess.Popen:
    env = {**free_env(), "OMP_NUM_THREADS": "1", "TEST_BATCH": str(BATCH)}
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--node-rank={node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(script),
        *args,
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait(procs: list[subprocess.Popen]) -> None:
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:  # a failed rank leaves no launcher behind
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_nodes_read_s3_with_their_own_caches_and_one_node_resumes(s3: S3Server, tmp_path):
    src = tmp_path / "src"
    for i in range(N):
        d = src / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (6, 4), (i * 5, 90, 200 - i)).save(d / f"im{i:02d}.jpg")
    pack(str(src), str(tmp_path / "packed"), shard_size=12000, progress=False)
    s3.upload_dir("multinode", "set", tmp_path / "packed")
    url = "s3://multinode/set/"
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    out = tmp_path / "out"
    out.mkdir()
    caches = [tmp_path / f"cache-node{n}" for n in range(2)]

    port = free_port()  # two launchers, one per "machine", meeting at node 0's address
    _wait(
        [
            _torchrun(2, n, port, script, url, s3.endpoint, str(caches[n]), str(out), "train")
            for n in range(2)
        ]
    )
    ranks = [json.loads((out / f"train-rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["batches"] == ranks[1]["batches"] == N // 2 // BATCH  # equal per rank
    assert all(len(b) == BATCH for r in ranks for b in r["keys"])
    seen = [k for r in ranks for b in r["keys"] for k in b]
    assert len(seen) == len(set(seen)) == N  # disjoint, and complete
    for cache in caches:  # each machine fetched into its own cache
        assert any(f.is_file() for f in cache.rglob("*"))

    _wait(
        [_torchrun(1, 0, free_port(), script, url, s3.endpoint, str(caches[0]), str(out), "resume")]
    )
    solo = json.loads((out / "resume-rank0.json").read_text())
    assert solo["world"] == 1
    before = [k for r in ranks for b in r["keys"][: r["half"]] for k in b]
    after = [k for b in solo["keys"] for k in b]
    assert sorted(before + after) == sorted(seen)  # 2 nodes -> 1: every sample exactly once
