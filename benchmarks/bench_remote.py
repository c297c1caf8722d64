#!/usr/bin/env python3
"""Remote shards over a loopback object store (HTTP or moto S3, behind a latency proxy)
against the raw transfer and a folder of objects, side by side in one run.

``decode="raw"`` throughout (bytes to the loader, not decoding): the raw transfer (every shard
whole, the stream's concurrency) is the ceiling; the shard stream runs with ``prefetch`` on and
off; the folder reads one object per image. ``--case sparse``: ``subset=0.01`` and
``split="val"`` epochs as ranged GETs, one in flight against ``--ranged-gets``. Method and
figures: docs/benchmarks.md ("Remote").

    python benchmarks/bench_remote.py --server s3 --latency-ms 20 --repeats 3
    python benchmarks/bench_remote.py --case sparse --rounds 3
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import data
import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "tests"))  # the loopback servers live beside the tests

from torch.utils.data import DataLoader, Subset  # noqa: E402

from shardkit.manifest import MANIFEST_NAME, read_manifest  # noqa: E402
from shardkit.remote import RemoteStorage, fetch  # noqa: E402
from shardkit.retry import RetryPolicy  # noqa: E402
from shardkit.stream.dataset import FolderDataset, ShardDataset  # noqa: E402
from shardkit.stream.shuffle import Order  # noqa: E402

BUCKET = "bench"
BATCH = 64


# --- the server process -----------------------------------------------------------------------


def _serve(kind, shards, src, images, latency, rate, conn) -> None:
    """Runs in its own process, so serving never competes with the client for one GIL."""
    from remote_servers import FaultProxy, HttpServer, S3Server

    if kind == "http":
        root = tempfile.mkdtemp(prefix="bench-remote-")
        os.symlink(shards, os.path.join(root, "shards"))
        os.symlink(src, os.path.join(root, "folder"))
        server = HttpServer(Path(root))
        with server:
            _serve_until_closed(server.port, latency, rate, conn, FaultProxy, server.log)
        return
    with S3Server() as server:
        c = server.client()
        c.create_bucket(Bucket=BUCKET)
        for name in sorted(os.listdir(shards)):
            c.upload_file(os.path.join(shards, name), BUCKET, f"shards/{name}")

        def put(rel: str) -> None:
            c.upload_file(os.path.join(src, rel), BUCKET, f"folder/{rel}")

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, images))
        _serve_until_closed(server.port, latency, rate, conn, FaultProxy, server.log)


def start_server(*args):
    """``_serve(*args)`` in a forked process: (the process, its pipe, the proxy's port)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(*args, child), daemon=True)
    server.start()
    return server, parent, parent.recv()


def _serve_until_closed(port, latency, rate, conn, proxy_cls, log) -> None:
    with proxy_cls(("127.0.0.1", port), latency=latency, rate=rate) as proxy:
        conn.send(proxy.port)
        while conn.recv() == "gets":  # until the parent says "stop"
            conn.send(len(ranged_gets(log)))


def ranged_gets(log) -> list:
    """The ranged GETs of shard bytes the server answered (not indexes, not whole shards)."""
    return [g for g in log.gets(".tar") if g[2] and not g[1].endswith(".idx")]


# --- measurements -----------------------------------------------------------------------------


def _download_part(args) -> int:
    urls, opts, threads = args
    total = 0

    class Null:
        def write(self, b):
            nonlocal total
            total += len(b)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda u: fetch(u, Null(), storage_options=opts), urls))
    return total


def raw_transfer(pool, urls, opts, workers, in_flight) -> tuple[float, int]:
    """All shards, ``workers`` processes with ``in_flight`` downloads each: the stream's layout."""
    parts = [urls[w::workers] for w in range(workers)]
    t0 = time.perf_counter()
    total = sum(pool.map(_download_part, [(p, opts, in_flight) for p in parts if p]))
    return total / (time.perf_counter() - t0) / 1e6, total


def stream(loader, nbytes: int) -> dict:
    e = harness.epoch(loader)
    return {"mb_s": nbytes / e["wall_s"] / 1e6, "samples_s": e["rate"],
            "first_batch_s": e["first_s"], "n": e["images"]}  # fmt: skip


class RemoteFolder:
    """FolderDataset lists the local tree; every image is then fetched as its own object."""

    def __init__(self, local_root: str, base_url: str, remote: RemoteStorage):
        self.local_root, self.base_url, self.remote = local_root, base_url, remote

    def open(self, path: str):
        rel = os.path.relpath(path, self.local_root)
        return self.remote.open(f"{self.base_url}/{rel}")

    def local_path(self, path: str) -> str:  # pragma: no cover - folders never need it
        raise NotImplementedError

    def prefetch(self, urls) -> None:
        pass

    def close(self) -> None:
        self.remote.close()


def collate_raw(batch):
    return [b[0] for b in batch], [b[1] for b in batch]


@harness.case(
    data="LFW-shaped shards of --shard-size served on loopback (HTTP Range or moto S3)",
    measures="remote epochs against the raw transfer and a folder; sparse epochs (--case sparse)",
    small={
        "src": str(data.root() / "lfw-smoke"),
        "shards": str(data.root() / "lfw-smoke-remote"),
        "latency_ms": 1.0,
        "folder_images": 40,
        "shard_size": "1MB",
        "case": "both",
        "sparse_n": 3000,
    },  # fmt: skip
    aliases={"rounds": ["repeats"]},
)
class Remote(harness.Bench):
    rounds: int = 3
    src: str = str(ROOT / "data/lfw")
    shards: str = str(ROOT / "bench-out/remote/lfw-tar")
    shard_size: str = harness.arg(
        "4MB",
        "pack size (default 4MB: ~50 LFW shards, several per worker; a remote worker "
        "fetches whole shards, so fewer shards than workers would fetch some twice)",
    )
    server: Literal["http", "s3"] = "http"
    latency_ms: float = 20.0
    mb_per_conn: float = harness.arg(
        0.0,
        "cap each connection's throughput (MB/s), as object stores do per request; "
        "0: unlimited (loopback, CPU-bound)",
    )
    workers: int = 2
    prefetch: int = 2
    folder_images: int = harness.arg(600, "folder subset size")
    case: Literal["stream", "sparse", "both"] = "stream"
    sparse_n: int = harness.arg(32_000, "samples of the sparse set")
    val_fraction: float = harness.arg(0.01, "the split's val share")
    ranged_gets: int = harness.arg(16, "GETs in flight, concurrent")


def main(args: Remote) -> None:
    if args.case == "sparse":
        summary, rounds = sparse(args)
        harness.write_result(args.json, "bench_remote", args, summary, rounds)
        return 0
    if args.smoke:
        data.lfw(Path(args.src), 0.01)
    src, shards = Path(args.src), Path(args.shards)
    data.packed(data.lfw(src), shards, shard_size=args.shard_size, workers=2)
    manifest = read_manifest(str(shards))
    nbytes = manifest.total_bytes
    batches_per_shard = max(2, -(-manifest.num_samples // len(manifest.shards) // BATCH))
    in_flight = max(1, args.prefetch)  # downloads a streaming worker keeps going once warm
    folder = FolderDataset(str(src), decode="raw")
    rng = random.Random(0)
    subset = sorted(rng.sample(range(len(folder)), min(args.folder_images, len(folder))))
    rels = [folder.relpath(i) for i in subset]
    rate = args.mb_per_conn * 1e6 or None
    where = (str(shards.resolve()), str(src.resolve()))
    server, parent, port = start_server(args.server, *where, rels, args.latency_ms / 1000, rate)
    endpoint = f"http://127.0.0.1:{port}"
    if args.server == "http":
        base, opts = endpoint, None
    else:
        from remote_servers import S3Server

        base, opts = f"s3://{BUCKET}", S3Server.options(endpoint)
    shard_url = f"{base}/shards/"
    urls = [f"{base}/shards/{e.path}" for e in manifest.shards]
    print(
        f"{args.server} server on loopback, +{args.latency_ms:g} ms per request, "
        f"{f'{args.mb_per_conn:g} MB/s per connection' if args.mb_per_conn else 'no rate cap'}; "
        f"{len(urls)} shards, {nbytes / 1e6:.0f} MB, {manifest.num_samples} images; "
        f"{args.workers} workers, prefetch {args.prefetch}",
        flush=True,
    )

    def shard_loader(prefetch: int):
        ds = ShardDataset(
            shard_url if args.server == "s3" else f"{shard_url}{MANIFEST_NAME}",
            decode="raw",
            order=Order(shuffle=False),
            storage=RemoteStorage(storage_options=opts),
        )
        ds.storage = RemoteStorage(opts, prefetch=prefetch)
        return DataLoader(
            ds,
            batch_size=BATCH,
            num_workers=args.workers,
            persistent_workers=True,
            collate_fn=collate_raw,
            prefetch_factor=batches_per_shard,
        )

    loaders = {"stream": shard_loader(args.prefetch), "stream_p0": shard_loader(0)}
    remote = RemoteStorage(opts, prefetch=0, verify=False, retries=RetryPolicy.retries)
    folder.storage = RemoteFolder(str(src), f"{base}/folder", remote)
    folder_loader = DataLoader(
        Subset(folder, subset),
        batch_size=BATCH,
        num_workers=args.workers,
        persistent_workers=True,
        collate_fn=collate_raw,
    )
    pool = mp.get_context("fork").Pool(args.workers)
    for ld in loaders.values():
        stream(ld, nbytes)
    stream(folder_loader, 0)
    raw_transfer(pool, urls, opts, args.workers, in_flight)

    def raw(r: int) -> dict:
        return {"mb_s": raw_transfer(pool, urls, opts, args.workers, in_flight)[0]}

    sides = {
        "raw": raw,
        "stream": lambda r: stream(loaders["stream"], nbytes),
        "stream_p0": lambda r: stream(loaders["stream_p0"], nbytes),
        "folder": lambda r: stream(folder_loader, 0),
    }
    rounds = harness.interleave(sides, args.rounds, order="shuffle")
    results = rounds.results
    pool.close()
    parent.send("stop")
    server.join(10)

    med = rounds.median
    raw = med("raw", "mb_s")
    summary = {
        "server": args.server,
        "latency_ms": args.latency_ms,
        "mb_per_conn": args.mb_per_conn,
        "workers": args.workers,
        "prefetch": args.prefetch,
        "raw_in_flight_per_worker": in_flight,
        "loader_prefetch_factor": batches_per_shard,
        "shards": len(urls),
        "mb": nbytes / 1e6,
        "raw_mb_s": raw,
        "stream_mb_s": med("stream", "mb_s"),
        "stream_samples_s": med("stream", "samples_s"),
        "stream_first_batch_s": med("stream", "first_batch_s"),
        "stream_p0_mb_s": med("stream_p0", "mb_s"),
        "folder_samples_s": med("folder", "samples_s"),
        "stream_vs_raw": rounds.ratio("stream", "raw", "mb_s"),
        "stream_p0_vs_raw": rounds.ratio("stream_p0", "raw", "mb_s"),
        "shards_vs_folder": rounds.ratio("stream", "folder", "samples_s"),
        "raw": results,
    }
    rows = {name: {k.removeprefix(f"{name}_"): v for k, v in summary.items() if k.startswith(name)}
            for name in ("raw", "stream_p0", "stream", "folder", "shards")}  # fmt: skip
    rows["stream"] = {k: v for k, v in rows["stream"].items() if not k.startswith("p0")}
    harness.table(rows, ["mb_s:.1f", "samples_s:.0f", "vs_raw:.0%", "first_batch_s:.2f",
                         "vs_folder:.1f"])  # fmt: skip
    if args.case == "both":
        summary["sparse"] = sparse(args)[0]
    harness.write_result(args.json, "bench_remote", args, summary, rounds)
    return 0


# --- sparse epochs: subset and split as ranged GETs --------------------------------------------


def sparse(args) -> tuple[dict, harness.Rounds]:
    """subset=0.01 and split="val" epochs, one ranged GET at a time against ``ranged_gets``."""
    from shardkit.stream.mix import Source
    from shardkit.stream.shuffle import Order

    shards, _ = data.scale_set(args.sparse_n, work=data.root() / "remote-sparse")
    manifest = read_manifest(str(shards))
    where = str(shards.resolve())
    server, parent, port = start_server("http", where, where, [], args.latency_ms / 1000, None)
    url = f"http://127.0.0.1:{port}/shards/{MANIFEST_NAME}"
    cases = {
        "subset": Source(url, subset=0.01),
        "split": Source(url, split="val", val_fraction=args.val_fraction),
    }
    print(
        f"sparse epochs over HTTP on loopback, +{args.latency_ms:g} ms per request: "
        f"{manifest.num_samples} samples in {len(manifest.shards)} shards; subset=0.01, "
        f"split='val' at val_fraction={args.val_fraction}; ranged_gets 1 vs "
        f"{args.ranged_gets}, in one process",
        flush=True,
    )

    def gets() -> int:
        parent.send("gets")
        return parent.recv()

    def epoch(source, in_flight: int) -> dict:
        ds = ShardDataset(
            source,
            decode="raw",
            with_keys=True,
            storage=RemoteStorage(ranged_gets=in_flight),
            order=Order(shuffle=False),
        )
        g0, t0 = gets(), time.perf_counter()
        keys = [s[2] for s in ds]
        secs, n = time.perf_counter() - t0, len(keys)
        return {"samples_s": n / secs, "gets_per_sample": (gets() - g0) / n, "n": n, "keys": keys}

    sides = {}
    for case, source in cases.items():
        sides[f"{case}_1"] = lambda r, src=source: epoch(src, 1)
        sides[f"{case}_{args.ranged_gets}"] = lambda r, src=source: epoch(src, args.ranged_gets)
    rounds = harness.interleave(sides, args.rounds, order="shuffle")
    parent.send("stop")
    server.join(10)
    summary: dict = {
        "latency_ms": args.latency_ms,
        "samples": manifest.num_samples,
        "shards": len(manifest.shards),
        "ranged_gets": args.ranged_gets,
    }
    for case in cases:
        one, many = f"{case}_1", f"{case}_{args.ranged_gets}"
        want = rounds.results[one][0]["keys"]
        for name in (one, many):
            for res in rounds.results[name]:
                if res["keys"] != want:
                    raise SystemExit(f"{name}: another epoch than one GET at a time read")
                res["keys"] = len(res["keys"])
        summary[case] = {
            "n": rounds.results[one][0]["n"],
            "samples_s_1": rounds.median(one, "samples_s"),
            f"samples_s_{args.ranged_gets}": rounds.median(many, "samples_s"),
            "speedup": rounds.ratio(many, one, "samples_s"),
            "gets_per_sample_1": rounds.median(one, "gets_per_sample"),
            f"gets_per_sample_{args.ranged_gets}": rounds.median(many, "gets_per_sample"),
            "cpu_s_1": rounds.median(one, "cpu_s"),
            f"cpu_s_{args.ranged_gets}": rounds.median(many, "cpu_s"),
        }
    harness.table({c: summary[c] for c in cases}, ["n", *[f"{k}_{g}:.{p}f" for k, p in (
        ("samples_s", 0), ("gets_per_sample", 3), ("cpu_s", 2)) for g in (1, args.ranged_gets)],
        "speedup:.1f"])  # fmt: skip
    print(f"load: {rounds.load_text()}")
    return summary, rounds


if __name__ == "__main__":
    harness.script(__file__)
