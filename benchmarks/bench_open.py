#!/usr/bin/env python3
"""What opening a many-shard dataset costs each process: CPU seconds and memory.

Every DataLoader worker (and every rank) parses the manifest and builds the shard list, so this
is paid per process. Makes one real tar shard of ``--samples`` tiny samples (with its ``.idx``)
and hard-links it ``--shards`` times under a manifest listing every link (no disk beyond one
shard), then in a fresh child process per case measures ``ShardDataset(DIR, decode="raw")``
and ``len()``: CPU seconds (user + system, so load does not move them) and peak memory over the
imports. Cases, measured interleaved:

- ``current``: the pack as this checkout writes it;
- ``json-offsets``: the same shards under a manifest that also lists each shard's sparse byte
  offsets as JSON ints (``index_every``/``index``): how packs were written before the offsets
  were read from each shard's ``.idx``; this checkout still reads it;
- with ``--against DIR`` (another checkout, e.g. ``git worktree add /tmp/old 16caec4``): that
  checkout opening ``json-offsets``, its own format.

    python benchmarks/bench_open.py --shards 40000 --samples 10000 --against /tmp/old
    python benchmarks/bench_open.py --shards 40000 --samples 128 --against /tmp/old

10,000 samples a shard at 40,000 shards is LAION-400M's shape (157 offsets a shard, 6.3M in all);
128 a shard (2 offsets, a 12 MB manifest) is the shape of the scale trial's 40,000-shard set.

Measured 2026-11-29 on the shared 2-core VM (load 7-9, so CPU seconds run high; the ratios are
the figures), against the tree before the offsets left the manifest:

| shape | before (JSON offsets) | now | older pack, read now |
|---|---|---|---|
| 40,000 x 10,000 (96 MB -> 10 MB) | 1.62 s CPU, +453 MB | 0.54 s, +54 MB | 1.58 s, +453 MB |
| 40,000 x 128 (12.2 MB -> 9.8 MB) | 0.54 s, +53 MB | 0.49 s, +52 MB | 0.57 s, +53 MB |

What is left is O(shards): the JSON parse, one ``ShardEntry`` and one ``ShardInfo`` per shard,
one ``stat`` per local shard (about 0.1 s each at 40,000 on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

CHILD = r"""
import json, resource, sys, warnings
warnings.simplefilter("ignore")
from shardkit import ShardDataset
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
base, c0 = hwm(), cpu()
ds = ShardDataset(sys.argv[1], decode="raw")
n = len(ds)
print(json.dumps({"cpu_s": cpu() - c0, "mb": hwm() - base, "len": n}))
"""


def make(out: Path, shards: int, samples: int) -> tuple[str, str]:
    """The many-shard pack (``current``) and its ``json-offsets`` twin (same shard files)."""
    from shardkit import ShardWriter
    from shardkit.formats.sample_index import decode_index, index_path

    packed, legacy = out / f"s{shards}x{samples}", out / f"s{shards}x{samples}-json"
    if (packed / "manifest.json").exists() and (legacy / "manifest.json").exists():
        return str(packed), str(legacy)
    one = out / f"one{samples}"
    if not (one / "manifest.json").exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ShardWriter(str(one), shard_size="1GB", classes=["a", "b"]) as w:
                for i in range(samples):
                    w.add(f"k{i:07d}", "jpg", b"\xff\xd8" + i.to_bytes(8, "big"), i % 2)
    doc = json.loads((one / "manifest.json").read_text())
    (entry,) = doc["shards"]
    entry = {k: v for k, v in entry.items() if k not in ("index", "index_every")}
    src = one / entry["path"]
    offsets = decode_index((one / index_path(entry["path"])).read_bytes(), "one").offsets
    for d, inline in ((packed, False), (legacy, True)):
        d.mkdir(parents=True, exist_ok=True)
        own = d.with_name(d.name + "-src.tar")  # one source per pack: a file has < 65,000 links
        if not own.exists():
            shutil.copyfile(src, own)
            shutil.copyfile(index_path(str(src)), index_path(str(own)))
        listed = []
        for i in range(shards):
            name = f"shard-{i:06d}.tar"
            for a, b in ((own, d / name), (index_path(str(own)), d / index_path(name))):
                if not os.path.exists(b):
                    os.link(a, b)
            e = dict(entry, path=name)
            if inline:
                e["index_every"] = 64
                e["index"] = offsets[:-1:64].tolist()
            listed.append(e)
        m = dict(doc, shards=listed, num_samples=shards * samples, total_bytes=0)
        m["total_bytes"] = shards * entry["bytes"]
        (d / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
    return str(packed), str(legacy)


def child(where: str, checkout: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, where], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=40000)
    ap.add_argument("--samples", type=int, default=10000, help="samples per shard")
    ap.add_argument("--out", default="/tmp/bench-open")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", help="another checkout, opening the json-offsets pack")
    args = ap.parse_args(argv)
    out = Path(args.out)
    packed, legacy = make(out, args.shards, args.samples)
    cases = [("current", packed, ROOT), ("json-offsets", legacy, ROOT)]
    if args.against:
        cases.append(("against: json-offsets", legacy, Path(args.against).resolve()))
    for name, where, _ in cases:
        size = os.path.getsize(os.path.join(where, "manifest.json"))
        print(f"{name}: manifest.json {size / 1e6:.1f} MB")
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, where, checkout in cases:
            r = child(where, checkout)
            if name not in best or r["cpu_s"] < best[name]["cpu_s"]:
                best[name] = r
    print(f"open at {args.shards} shards x {args.samples} samples (best of {args.repeats})")
    for name, r in best.items():
        print(f"  {name:24s} {r['cpu_s']:6.3f} s CPU  +{r['mb']:5.1f} MB  len {r['len']}")


if __name__ == "__main__":
    main()
