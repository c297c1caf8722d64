#!/usr/bin/env python3
"""What subsets, splits, random access, ``ls`` and ``show`` cost at ImageNet's sample count.

Makes N samples (one tiny 64x64 JPEG's bytes under N keys in 1,000 classes, written with
``ShardWriter``: fast), then measures each figure in a fresh child process, with the sample
indexes (``*.tar.idx``) and on the same shards without them (hard links, the indexes left out:
an older pack), interleaved. ``--format lmdb``: LMDB shards with their index record, and a copy
whose shards have it deleted (through the ``lmdb`` package: an older pack's reads):

- ``subset=0.01`` epoch: bytes read (``rchar``) against the drawn samples' own bytes;
- ``split="val"`` construction: seconds and peak memory;
- ``ShardView`` open: seconds and peak memory;
- ``shardkit ls`` first line and ``shardkit show KEY``: seconds after imports, peak memory;
- a full epoch (``decode="raw"``): samples/s, both sides (nothing else slower).

    python benchmarks/bench_scale.py --n 128000 --out /tmp/scale
    python benchmarks/bench_scale.py --n 1280000 --out /tmp/scale --json bench-out/scale.json
    python benchmarks/bench_scale.py --n 200000 --format lmdb --what split view ls show
    python benchmarks/bench_scale.py --n 128000 640000 --what append merge get miss showmiss

Growth (``append``, ``merge``: 10,000 new samples, ``--new``) and key lookups (``get``,
``miss``: CPU per ``ShardView.index`` call; ``showmiss``: ``show`` of a key no shard holds)
report CPU seconds (user + system) and peak memory, so load on the machine does not move them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

CHILD = r"""
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np
what, where, key = sys.argv[1], sys.argv[2], sys.argv[3]
if what in ("append", "merge"):  # as the CLI runs them: without torch
    import shardkit.write.merge, shardkit.write.packer
else:
    from shardkit import ShardDataset, ShardView
    from shardkit.stream.show import list_lines, show_lines
def rchar():
    with open("/proc/self/io") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("rchar"))
def hwm():  # this process's peak RSS (ru_maxrss would keep the forking parent's peak)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
r0, t0, cpu0 = rchar(), time.perf_counter(), cpu()
out = {"base_mb": hwm()}  # after imports
if what == "subset":
    ds = ShardDataset(where, decode="raw", subset=0.01, with_keys=True)
    out["construct_s"] = time.perf_counter() - t0
    n = sum(len(s[0]) for s in ds)
    out["drawn"], out["image_bytes"] = len(ds), n
elif what == "split":
    ds = ShardDataset(where, decode="raw", split="val", val_fraction=0.1)
    out["len"] = len(ds)
elif what == "view":
    view = ShardView(where, decode="raw")
    out["len"] = len(view)
elif what == "ls":
    view = ShardView(where, decode="raw")
    out["line"] = next(iter(list_lines(view, 1)))
elif what == "show":
    view = ShardView(where, decode="raw")
    out["lines"] = len(list(show_lines(view, key)))
elif what == "epoch":
    ds = ShardDataset(where, decode="raw")
    out["samples"] = sum(1 for _ in ds)
elif what == "append":  # key: a folder of new images; where: a fresh copy of the dataset
    from shardkit.write.packer import pack
    out["samples"] = pack(key, where, append=True, progress=False, shard_size="5MB").samples
elif what == "merge":  # key: "B OUT"
    from shardkit.write.merge import merge
    other, into = key.split(" ")
    out["samples"] = merge([where, other], into).samples
elif what in ("get", "miss"):  # CPU per lookup, after the first two (the table is built)
    view = ShardView(where, decode="raw")
    rng = np.random.default_rng(0)
    asked = [view.key(int(i)) for i in rng.integers(0, len(view), 200)]
    if what == "miss":
        asked = [k + "-missing" for k in asked]
    def find(k):
        try:
            return view.index(k)
        except Exception:
            return None
    find(asked[0]), find(asked[1])
    c0 = cpu()
    for k in asked:
        find(k)
    out["cpu_per_lookup_ms"] = (cpu() - c0) / len(asked) * 1e3
elif what == "showmiss":  # one lookup of a key no shard holds, as `shardkit show` makes it
    view = ShardView(where, decode="raw")
    try:
        list(show_lines(view, "no/such-key"))
    except Exception as exc:
        out["error"] = type(exc).__name__
out["seconds"] = time.perf_counter() - t0
out["cpu_s"] = cpu() - cpu0
out["rchar"] = rchar() - r0
out["peak_mb"] = hwm()
print(json.dumps(out))
"""


def _jpeg() -> bytes:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def make(out: Path, n: int, fmt: str = "tar") -> tuple[str, str]:
    """N samples packed with indexes, and the same shards without them (hard links; LMDB: a
    copy with the record deleted)."""
    from shardkit import ShardWriter

    tag = "" if fmt == "tar" else f"-{fmt}"
    packed, bare = out / f"n{n}{tag}", out / f"n{n}{tag}-noindex"
    if not (packed / "manifest.json").exists():
        data = _jpeg()
        rng = __import__("numpy").random.default_rng(0)
        labels = rng.integers(0, 1000, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ShardWriter(
                str(packed),
                shard_size="5MB",
                format=fmt,
                classes=[f"n{c:08d}" for c in range(1000)],
            ) as w:
                for i in range(n):
                    c = int(labels[i])
                    w.add(f"n{c:08d}/n{c:08d}_{i}", "jpg", data, c)
    if fmt == "lmdb" and not bare.exists():
        _without_records(packed, bare)
    elif not bare.exists():
        bare.mkdir()
        for name in os.listdir(packed):
            if not name.endswith(".idx"):
                os.link(packed / name, bare / name)
    return str(packed), str(bare)


def _without_records(packed: Path, bare: Path) -> None:
    """A copy of an LMDB pack whose shards have no index record: what an older pack reads."""
    import shutil

    import lmdb

    from shardkit.formats.lmdb.index import INDEX_KEY

    tmp = bare.with_name(bare.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(packed, tmp)
    for name in os.listdir(tmp):
        if name.endswith(".lmdb"):
            env = lmdb.open(str(tmp / name), subdir=False, lock=False)
            with env.begin(write=True) as txn:
                txn.delete(INDEX_KEY)
            env.close()
    os.replace(tmp, bare)


def child(what: str, where: str, key: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, what, where, key],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: Growth: ``pack NEW OUT --append`` onto a fresh copy of the dataset (hard links, its manifest
#: copied), and ``merge A B OUT`` with B a pack of the same new images.
GROWTH = ["append", "merge"]
#: ``ShardView.index(key)``: CPU per lookup of present and of missing keys; ``show`` of a
#: missing key (memory).
LOOKUPS = ["get", "miss", "showmiss"]


def new_images(out: Path, n: int) -> str:
    """``n`` new 64x64 JPEG files in 10 of the dataset's classes (keys no sample has)."""
    folder = out / f"new{n}"
    if not (folder / ".done").exists():
        data = _jpeg()
        for i in range(n):
            cls = folder / f"n{i % 10:08d}"
            cls.mkdir(parents=True, exist_ok=True)
            (cls / f"new_{i}.jpg").write_bytes(data)
        (folder / ".done").touch()
    return str(folder)


def grow(what: str, where: str, out: Path, n_new: int) -> dict:
    import shutil

    from shardkit.write.packer import pack

    src = new_images(out, n_new)
    target = out / "grow-target"
    shutil.rmtree(target, ignore_errors=True)
    if what == "append":
        target.mkdir()
        for name in os.listdir(where):
            link = os.link if name != "manifest.json" else shutil.copyfile
            link(os.path.join(where, name), target / name)
        got = child("append", str(target), src)
    else:
        other = out / f"new{n_new}-packed"
        if not (other / "manifest.json").exists():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pack(src, str(other), progress=False, shard_size="5MB")
        got = child("merge", where, f"{other} {target}")
    shutil.rmtree(target, ignore_errors=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[128_000])
    ap.add_argument("--out", type=Path, default=Path("/tmp/shardkit-scale"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-epoch", action="store_true", help="Leave out the full epoch.")
    ap.add_argument("--format", choices=["tar", "lmdb"], default="tar")
    ap.add_argument("--what", nargs="+", default=None, help="Only these figures (split, view...).")
    ap.add_argument("--new", type=int, default=10_000, help="Samples an append or merge adds.")
    ap.add_argument(
        "--index-only", action="store_true", help="Only the side with indexes (no older pack)."
    )
    args = ap.parse_args()
    results = []
    for n in args.n:
        t0 = time.perf_counter()
        packed, bare = make(args.out, n, args.format)
        made = time.perf_counter() - t0
        tars = [f for f in os.listdir(packed) if f.endswith(f".{args.format}")]
        total = sum(os.path.getsize(os.path.join(packed, f)) for f in tars)
        from shardkit import ShardView

        key = ShardView(packed, decode="raw").key(n // 2)  # a sample halfway
        row = {"n": n, "dataset_bytes": total, "make_s": made, "load_before": os.getloadavg()}
        row["format"] = args.format
        whats = ["subset", "split", "view", "ls", "show"] + ([] if args.skip_epoch else ["epoch"])
        whats += GROWTH + LOOKUPS
        whats = [w for w in whats if args.what is None or w in args.what]
        for what in whats:
            for side, where in (("index", packed), ("no_index", bare)):
                if side == "no_index" and args.index_only:
                    continue
                if what in GROWTH:
                    row[f"{what}/{side}"] = grow(what, where, args.out, args.new)
                else:
                    row[f"{what}/{side}"] = child(what, where, key)
        row["load_after"] = os.getloadavg()
        results.append(row)
        _print(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


def _print(row: dict) -> None:
    n = row["n"]
    print(
        f"\nN = {n:,} samples, {row['dataset_bytes'] / 1e9:.2f} GB of {row.get('format', 'tar')} "
        f"(made in {row['make_s']:.0f} s); load {row['load_before']} -> {row['load_after']}"
    )
    base = max(r["base_mb"] for k, r in row.items() if k.endswith("/index"))
    print(
        f"memory: peak above the {base:.0f} MB a process holds after importing shardkit+torch "
        "(growth: the peak of a process that imports shardkit alone, as the CLI)"
    )
    print(f"{'figure':34s} {'with index':>30s} {'without':>30s}")
    for what, label in (
        ("subset", "subset=0.01 epoch: read / drawn"),
        ("split", 'split="val" construction'),
        ("view", "ShardView open"),
        ("ls", "ls first line"),
        ("show", "show KEY"),
        ("epoch", "full epoch (raw)"),
        ("append", "pack NEW --append (CPU)"),
        ("merge", "merge A NEW OUT (CPU)"),
        ("get", "view.index(key) CPU/lookup"),
        ("miss", "view.index(missing) CPU/lookup"),
        ("showmiss", "show a missing key"),
    ):
        if f"{what}/index" not in row:
            continue
        cells = []
        for side in ("index", "no_index"):
            if f"{what}/{side}" not in row:
                cells.append("-")
                continue
            r = row[f"{what}/{side}"]
            more = r["peak_mb"] - r["base_mb"]
            if what == "subset":
                drawn = r["drawn"] * _sample_bytes(row)
                cells.append(f"{r['rchar'] / 1e6:.1f} MB ({r['rchar'] / drawn:.2f}x)")
            elif what == "epoch":
                cells.append(f"{r['samples'] / r['seconds']:,.0f}/s +{more:.0f} MB")
            elif what in ("get", "miss"):
                cells.append(f"{r['cpu_per_lookup_ms']:.3f} ms +{more:.0f} MB")
            elif what in GROWTH:
                cells.append(f"{r['cpu_s']:.2f} s CPU, peak {r['peak_mb']:.0f} MB")
            else:
                cells.append(f"{r['seconds']:.2f} s +{more:.0f} MB, {r['rchar'] / 1e6:.1f} MB read")
        print(f"{label:34s} {cells[0]:>30s} {cells[1]:>30s}")


def _sample_bytes(row: dict) -> float:
    """Bytes of one sample in its shard (all samples are alike here: one JPEG, one label)."""
    return row["dataset_bytes"] / row["n"]


if __name__ == "__main__":
    main()
