#!/usr/bin/env python3
"""A raw epoch from each emulated object store (moto S3, fake-gcs-server, Azurite, each its
own process on loopback: tests/remote_servers.py) against the same shards on local disk:
``decode="raw"``, ``num_workers=0``, interleaved rounds; samples/s and this process's CPU us per
sample, medians, and the ratio to the local epoch per round (the emulators' CPU not counted).
Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
import warnings
from pathlib import Path

import data
import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "tests"))  # the loopback servers live beside the tests

from remote_servers import AzureServer, Emulator, GcsServer, S3Server, free_port  # noqa: E402

from shardkit.remote import RemoteStorage  # noqa: E402
from shardkit.remote.fs import filesystem  # noqa: E402
from shardkit.stream.dataset import ShardDataset  # noqa: E402


class MotoProcess(Emulator):
    """moto's S3 server in its own process (``moto_server``), not a thread of this one."""

    name = "moto_server"

    def __init__(self) -> None:
        port = free_port()
        exe = shutil.which("moto_server", path=str(Path(sys.executable).parent))
        super().__init__([exe or "moto_server", "-H", "127.0.0.1", "-p", str(port)], port)

    options = staticmethod(S3Server.options)


def upload(scheme: str, server, shards: Path) -> str:
    """Every file of ``shards`` into a new bucket of ``server``; the dataset's URL."""
    fs = filesystem(scheme, server.options(server.endpoint))
    bucket = f"bench{uuid.uuid4().hex[:8]}"
    if scheme == "s3":
        import boto3

        opts = server.options(server.endpoint)
        boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=opts["key"],
            aws_secret_access_key=opts["secret"],
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
    else:
        fs.mkdir(bucket)
    for p in sorted(shards.iterdir()):
        if p.is_file():
            fs.pipe_file(f"{bucket}/lfw/{p.name}", p.read_bytes())
    return f"{scheme}://{bucket}/lfw/"


def epoch(source: str, storage=None) -> dict:
    ds = ShardDataset(source, decode="raw", storage=storage)
    c0, t0 = harness.cpu_seconds(), time.perf_counter()
    n = sum(1 for _ in ds)
    cpu, wall = harness.cpu_seconds() - c0, time.perf_counter() - t0
    if storage is not None:
        storage.close()
    return {"rate": n / wall, "cpu_us": 1e6 * cpu / n, "samples": n, "cpu_s": cpu, "wall_s": wall}


@harness.case(
    data="the LFW-shaped set at --scale, packed; served by moto S3, fake-gcs-server, Azurite",
    measures="a raw epoch from each emulated store against the local shards: rate, CPU/sample",
    small={"scale": 0.02, "shard_size": "1MB"},
)
class Stores(harness.Bench):
    rounds: int = 3
    scale: float = harness.arg(0.25, "of LFW's 13,233 images")
    shard_size: str = "4MB"


def main(args: Stores) -> None:
    src = data.lfw(scale=args.scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shards = data.packed(src, Path(f"{src}-tar-{args.shard_size}"), shard_size=args.shard_size)
    servers = {"s3": MotoProcess(), "gs": GcsServer(), "az": AzureServer()}
    started = []
    try:
        for server in servers.values():
            started.append(server.__enter__())
        urls = {k: upload(k, s, shards) for k, s in servers.items()}
        contenders = {"local": lambda r: epoch(str(shards))}
        for k, s in servers.items():
            opts = s.options(s.endpoint)
            contenders[k] = lambda r, k=k, opts=opts: epoch(urls[k], RemoteStorage(opts))
        for fn in contenders.values():  # warm-up: indexes, connections, page cache
            fn(-1)
        rounds = harness.interleave(contenders, args.rounds)
    finally:
        for server in reversed(started):
            server.__exit__()
    result = {}
    for name in contenders:
        result[name] = {
            "samples": rounds.results[name][0]["samples"],
            "samples_per_s": rounds.median(name),
            "cpu_us_per_sample": rounds.median(name, "cpu_us"),
            "rate_vs_local": rounds.ratio(name, "local"),
            "cpu_vs_local": rounds.ratio(name, "local", "cpu_us"),
        }
        r = result[name]
        harness.say(
            f"{name:6s} {r['samples']} samples: {r['samples_per_s']:8.0f} samples/s "
            f"({r['rate_vs_local']:.2f}x local), {r['cpu_us_per_sample']:6.1f} us CPU a sample "
            f"({r['cpu_vs_local']:.2f}x local)"
        )
    harness.say(f"load per round: {rounds.load_text()}")
    harness.write_result(args.json, "bench_stores", args, result, rounds)
    return 0


if __name__ == "__main__":
    harness.script(__file__)
