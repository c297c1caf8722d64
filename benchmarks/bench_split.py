#!/usr/bin/env python3
"""What a split or subset epoch costs per sample against a full epoch, in CPU seconds and reads.

Makes N samples (``data.scale_set``, bench_scale's set: one tiny JPEG's bytes under N keys, 5 MB
shards, with their sample indexes) and runs, each in a fresh child process
(``harness.in_child``), two epochs (``decode="raw"``, seed 3) of: the whole dataset,
``split="val"`` and ``split="train"`` (``val_fraction=0.1``) and ``subset=0.01``; the second
epoch is reported, the first beside it (the first also loads the indexes and, for a split,
checks each streamed key: a process checks a slice of an unchanged file once). Figures are CPU
seconds (user + system) per delivered sample, so load on the machine does not move them much,
and reads per delivered sample: ``os.pread`` and ``os.preadv`` calls (LMDB, a streamed tar) and
the spans a ranged tar read passes to its C calls (``_native.pread_spans``, ``pread_at``: one
``pread`` a span; a streamed full epoch reads its shards by ``readinto``, not counted).
``--against DIR``: the same runs on another checkout's ``shardkit`` (e.g. a worktree of main).

Every (N, format, epoch, checkout) is one contender, interleaved round by round (each goes first
in turn, each round's load recorded); reported per contender: the median over rounds of CPU per
sample and reads per sample, the median of per-round ratios to the same checkout's full epoch
(``x full``), and with ``--against`` the median of per-round ratios this / that.

    python benchmarks/bench_split.py --n 128000 640000 --out /tmp/scale
    python benchmarks/bench_split.py --n 640000 --format lmdb --what subset val
    python benchmarks/bench_split.py --n 128000 --against /tmp/main-checkout
    python benchmarks/bench_split.py --n 1280000 --what full val --against /tmp/old --that-v2

``--that-v2``: the other checkout reads a copy of each set whose sample indexes are version 2
(no per-sample digests; hard links to the same shards): a checkout from before the digests
refuses a version-3 index and would stream every shard instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

import data
import harness

_CHILD = r"""
import json, os, resource, sys, warnings
warnings.simplefilter("ignore")
where, what = sys.argv[1], sys.argv[2]
from shardkit import ShardDataset, Source
calls = [0]
def counted(real):
    def counting(*args):
        calls[0] += 1
        return real(*args)
    return counting
os.pread, os.preadv = counted(os.pread), counted(os.preadv)
from shardkit.stream import ranges  # a tar shard's spans: read in C, one pread a span
if getattr(ranges, "_pread_spans", None) is not None:
    real_spans = ranges._pread_spans
    def pread_spans(fd, buf, lo, hi):
        calls[0] += len(lo)
        return real_spans(fd, buf, lo, hi)
    ranges._pread_spans = pread_spans
if getattr(ranges, "_pread_at", None) is not None:
    real_at = ranges._pread_at
    def pread_at(*args):
        got = real_at(*args)
        calls[0] += got[3] if isinstance(got, tuple) else 0  # the spans it read
        return got
    ranges._pread_at = pread_at
kw = {"full": {}, "val": {"split": "val", "val_fraction": 0.1},
      "train": {"split": "train", "val_fraction": 0.1}, "subset": {"subset": 0.01}}[what]
ds = ShardDataset(Source(where, **kw) if kw else where, decode="raw", seed=3)
us = []
for epoch in (1, 2):
    ds.set_epoch(epoch)
    calls[0] = 0
    c0 = cpu()
    n = sum(1 for _ in ds)
    c1 = cpu()
    us.append(1e6 * (c1 - c0) / max(n, 1))
if n == 0:
    sys.exit(f"{where}: {what} delivered no sample: more samples (--n)")
print(json.dumps({"n": n, "us": us[1], "us_first": us[0], "reads": calls[0] / n}))
"""

WHATS = ("full", "val", "train", "subset")


def v2_copy(where: Path) -> Path:
    """The set ``where`` as a pack made before sample digests: the same shards (hard links),
    each index as version 2 wrote it (no digest column; FORMAT.md), the manifest's index
    checksums those of the version-2 files."""
    from shardkit.formats.sample_index import columns_size

    out = where.with_name(where.name + "-v2")
    if (out / "manifest.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    doc = json.loads((where / "manifest.json").read_text())
    for s in doc["shards"]:
        n, name = s["samples"], s["path"]
        if not os.path.exists(out / name):
            os.link(where / name, out / name)
        data_ = (where / (name + ".idx")).read_bytes()
        at = columns_size(n, 2)  # the digest column: after the offsets and key hashes
        body = bytearray(data_[:at] + data_[at + 8 * n : -32])
        body[8:12] = (2).to_bytes(4, "little")
        old = bytes(body) + hashlib.sha256(bytes(body)).digest()
        (out / (name + ".idx")).write_bytes(old)
        s["index_sha256"] = hashlib.sha256(old).hexdigest()
        s["columns_sha256"] = hashlib.sha256(old[: columns_size(n, 2)]).hexdigest()
    with open(out / "manifest.json", "w") as f:  # data for the other checkout, not a result
        json.dump(doc, f)
    return out


@harness.case(
    data="N-sample sets (tar, LMDB) with their indexes, under <data root>/scale",
    measures="split and subset epochs against a full one: CPU seconds, pread calls per sample",
    small={"n": (2000,), "format": ("tar", "lmdb")},
    aliases={"out": ["work"]},
)
class Split(harness.Bench):
    rounds: int = 3
    against: Path | None = harness.arg(None, "another checkout, side by side")
    n: tuple[int, ...] = (128_000,)
    out: Path | None = harness.arg(None, "data (default: <data root>/scale)")
    format: tuple[Literal["tar", "lmdb"], ...] = ("tar",)
    what: tuple[Literal["full", "val", "train", "subset"], ...] = WHATS
    that_v2: bool = harness.arg(
        False, "--against reads a copy of each tar set with version-2 indexes (hard links)"
    )


def main(a: Split) -> None:
    work = a.out or data.root() / "scale"
    whats = ["full"] + [w for w in a.what if w != "full"]  # every ratio divides by a full epoch
    checkouts = {"this": harness.ROOT}
    if a.against is not None:
        checkouts["that"] = a.against.resolve()
    sets = {(n, fmt): data.scale_set(n, work, fmt)[0] for n in a.n for fmt in a.format}
    older = {k: v2_copy(w) if a.that_v2 and k[1] == "tar" else w for k, w in sets.items()}
    contenders = {
        f"{n}/{fmt}/{what}/{side}": (
            lambda r, c=checkout, w=where, what=what: harness.in_child(c, _CHILD, w, what)
        )
        for (n, fmt) in sets
        for what in whats
        for side, checkout in checkouts.items()
        for where in [older[n, fmt] if side == "that" else sets[n, fmt]]
    }
    rounds = harness.interleave(contenders, a.rounds)
    rows = []
    for n, fmt in sets:
        for what in whats:
            for side in checkouts:
                name, full = f"{n}/{fmt}/{what}/{side}", f"{n}/{fmt}/full/{side}"
                row = {
                    "n": n,
                    "format": fmt,
                    "what": what,
                    "checkout": side,
                    "samples": rounds.median(name, "n"),
                    "us_per_sample": rounds.median(name, "us"),
                    "us_first_epoch": rounds.median(name, "us_first"),
                    "reads_per_sample": rounds.median(name, "reads"),
                    "x_full": rounds.ratio(name, full, "us"),
                    "x_full_ratios": [round(x, 3) for x in rounds.ratios(name, full, "us")],
                }
                if side == "this" and "that" in checkouts:
                    other = f"{n}/{fmt}/{what}/that"
                    row["x_that"] = rounds.ratio(name, other, "us")
                    row["x_that_ratios"] = [round(x, 3) for x in rounds.ratios(name, other, "us")]
                    row["x_that_first"] = rounds.ratio(name, other, "us_first")
                rows.append(row)
    print(f"load average per round: {rounds.load_text()}")
    for r in rows:
        against = f", {r['x_that']:5.3f}x that {r['x_that_ratios']}" if "x_that" in r else ""
        first = f", first {r['x_that_first']:5.3f}x that" if "x_that" in r else ""
        print(
            f"N={r['n']:>9,} {r['format']:4s} {r['what']:6s} {r['checkout']}: "
            f"{r['samples']:>9,.0f} samples, {r['us_per_sample']:6.2f} us CPU/sample "
            f"({r['x_full']:4.2f}x full{against}), {r['reads_per_sample']:6.2f} preads/sample; "
            f"first epoch {r['us_first_epoch']:6.2f} us{first}"
        )
    result = {"checkouts": {k: str(v) for k, v in checkouts.items()}, "rows": rows}
    out = a.json or harness.ROOT / "bench-out" / "bench_split.json"
    harness.write_result(out, "bench_split", a, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
