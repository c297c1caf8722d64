"""A URL dataset's key file at work, counted, not timed, over the tests' loopback HTTP Range
server. ``--what split``: the GETs and bytes (of the manifest, the key file, the shards' index
heads) that ``ShardDataset(Source(url, split=))`` makes, rank 0 of 8 against world size 1, and
with its first plan (every shard it reaches: each one's index head, read when reached).
``--what keys``: the same for a key-list subset (``subset=`` every 100th key). ``--what view``:
a ``ShardView(url)``'s construction and its first ``get(key)`` (and a second key's). "before":
the same dataset with no key file listed, which a URL dataset's readers were before they read
one (a split or key subset read every shard's index head at construction; a view sorted every
shard's hashes into a private table at its first lookup); "after": the key file read by ranged
GETs. Index-only packs (a few bytes a sample, ``ShardWriter``). Figures: docs/benchmarks.md ("A
URL dataset's split reads its key file").

``--epoch``: for ``val``, then a fresh dataset's construction and epoch 0 read, every GET.

    python -m benchmarks run remote_split --samples 16000 160000 --what split keys view
    python -m benchmarks run remote_split --samples 16000 160000 --epoch
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Literal

import harness

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from remote_servers import HttpServer

from shardkit.manifest import MANIFEST_NAME, read_manifest, write_manifest
from shardkit.stream.dataset import ShardDataset
from shardkit.stream.mix import Source
from shardkit.stream.view import ShardView
from shardkit.stream.world import World
from shardkit.write.writer import ShardWriter

WORLD = 8


def build(out: Path, n: int, per_shard: int) -> int:
    """``n`` samples of a few bytes in shards of ~``per_shard`` (two members a sample, 1 KB
    each in the tar), with their indexes and key file; the shards written."""
    with ShardWriter(str(out), format="tar", shard_size=per_shard * 2048, classes=["x"]) as w:
        for i in range(n):
            w.add(f"k{i:07d}", "jpg", b"%d" % i, 0)
    return len(json.loads((out / MANIFEST_NAME).read_text())["shards"])


def without_keys(src: Path, dst: Path) -> None:
    """``dst``: ``src`` (its files hard-linked) with no key file, none listed."""
    dst.mkdir()
    for name in os.listdir(src):
        if name.startswith("shard-"):
            os.link(src / name, dst / name)
    write_manifest(dataclasses.replace(read_manifest(str(src)), keys={}), str(dst))


def _bytes(root: Path, get: tuple[str, str, str]) -> int:
    _, path, rng = get
    if rng:
        a, b = rng.removeprefix("bytes=").split("-")
        return int(b) - int(a) + 1
    return os.path.getsize(root / path.lstrip("/"))


def count(http, root: Path, what: str) -> dict:
    gets = http.log.gets()
    idx = [g for g in gets if g[1].endswith(".idx")]
    return {
        what + "_gets": len(gets),
        what + "_bytes": sum(_bytes(root, g) for g in gets),
        what + "_idx_gets": len(idx),
    }


def _dataset(url: str, narrow: dict, world: int) -> ShardDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardDataset(
            Source(url, **narrow),
            decode="raw",
            rank=0,
            world_size=world,
            seed=3,
        )


def measure(
    http, root: Path, name: str, split: str, world: int, n: int, epoch: bool = False
) -> dict:
    url = f"{http.url}/{name}/{MANIFEST_NAME}"
    if split == "view":
        return measure_view(http, root, url, n)
    narrow = (
        {"subset": [f"k{i:07d}" for i in range(0, n, 100)]}
        if split == "keys"
        else {"split": split, "val_fraction": 0.1}
    )
    http.log.clear()
    ds = _dataset(url, narrow, world)
    got = count(http, root, "built")
    reached = {s.shard for s in ds.plan(World(0, world, 0, 1), 0)}
    got |= count(http, root, "planned") | {"shards_reached": len(reached)}
    if epoch:  # a fresh dataset: construction and its first epoch read, every GET counted
        http.log.clear()
        read = sum(1 for _ in _dataset(url, narrow, world))
        idx = [p for _, p, _ in http.log.gets() if p.endswith(".idx")]
        got |= count(http, root, "epoch") | {"epoch_samples": read, "epoch_idx": len(set(idx))}
    return got


def measure_view(http, root: Path, url: str, n: int) -> dict:
    """A view's construction, its first ``get(key)`` and a second key's, each counted."""
    http.log.clear()
    view = ShardView(url, decode="raw")
    got = count(http, root, "built")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        view.index(f"k{n // 3:07d}")
        got |= count(http, root, "first")
        view.index(f"k{2 * n // 3:07d}")
    return got | count(http, root, "second")


def _said(got: dict) -> str:
    if "first_gets" in got:  # a view: each step's own GETs
        first = {k: got[f"first_{k}"] - got[f"built_{k}"] for k in ("gets", "idx_gets", "bytes")}
        second = {k: got[f"second_{k}"] - got[f"first_{k}"] for k in ("gets", "idx_gets", "bytes")}
        return (
            f"construction {got['built_gets']} GETs {got['built_bytes']:,} B; first get(key) "
            f"{first['gets']} GETs ({first['idx_gets']} .idx) {first['bytes']:,} B; second "
            f"{second['gets']} GETs ({second['idx_gets']} .idx) {second['bytes']:,} B"
        )
    return (
        f"construction {got['built_gets']} GETs ({got['built_idx_gets']} .idx) "
        f"{got['built_bytes']:,} B; with its plan {got['planned_gets']} GETs "
        f"({got['planned_idx_gets']} .idx) {got['planned_bytes']:,} B, "
        f"{got['shards_reached']} shards"
    ) + (
        f"; construction + epoch {got['epoch_gets']} GETs ({got['epoch_idx_gets']} .idx of "
        f"{got['epoch_idx']} shards) {got['epoch_bytes']:,} B, {got['epoch_samples']} samples"
        if "epoch_gets" in got
        else ""
    )


@harness.case(
    data="index-only tar packs of N samples (a few bytes each), served by the loopback HTTP server",
    measures="GETs and bytes of a URL split's construction, rank 0 of 8 against world size 1",
    small={"samples": (2000,)},
)
class RemoteSplit(harness.Bench):
    rounds: int = 1
    samples: tuple[int, ...] = harness.arg((16000, 160000), "pack sizes (samples)")
    per_shard: int = harness.arg(250, "samples a shard")
    what: tuple[Literal["split", "keys", "view"], ...] = harness.arg(
        ("split",), "split: a split's construction; keys: a key-list subset's; view: get(key)"
    )
    epoch: bool = harness.arg(False, "val: also construction + rank 0's epoch 0 read: GETs, bytes")


def main(args: RemoteSplit) -> None:
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-remote-split-") as tmp:
        root = Path(tmp)
        for n in args.samples:
            shards = build(root / f"n{n}", n, args.per_shard)
            without_keys(root / f"n{n}", root / f"n{n}-nokeys")
            keys = os.path.getsize(root / f"n{n}" / "manifest.keys")
            print(f"{n} samples in {shards} shards (key file {keys:,} B)", flush=True)
            with HttpServer(root) as http:
                for split in _kinds(args.what):
                    for label, name in (("before", f"n{n}-nokeys"), ("after", f"n{n}")):
                        row = {}
                        for world in (1,) if split == "view" else (1, WORLD):
                            epoch = args.epoch and split == "val"  # what a val rank reads
                            got = measure(http, root, name, split, world, n, epoch)
                            row[f"world{world}"] = got
                            print(f"  {split:5} {label:6} world {world}: {_said(got)}", flush=True)
                        result[f"n{n}/{split}/{label}"] = row
    harness.write_result(args.json, "bench_remote_split", args, result)
    return 0


def _kinds(what) -> list[str]:
    """The measured cases: ``split`` is its two sides."""
    return [k for w in what for k in (("val", "train") if w == "split" else (w,))]


if __name__ == "__main__":
    harness.script(__file__)
