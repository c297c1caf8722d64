#!/usr/bin/env python3
"""``shardkit pack`` against ``tar -cf`` of the same folder, cold data cache, each command a
fresh subprocess, the order rotating between repeats, ratios within a repeat (sources evicted
with ``posix_fadvise``; directory entries stay cached; ``tar+sync`` shows what fsync costs
tar). ``--engines``: ``--engine local --processes 2`` against the in-process pack (with and
without ``--resize-short``); ``--ray`` adds ``--engine ray``; ``--tiny N`` makes N tiny JPEGs
to time it on. Figures: docs/benchmarks.md ("Pack") and docs/distributed.md.

    python benchmarks/bench_pack.py --src data/lfw --repeats 7 --json bench-out/pack.json
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import data
import harness

from shardkit.bench.pagecache import evict, resident_fraction

ROOT = harness.ROOT


def _commands(args: Pack, src: Path, work: Path, scratch: str) -> tuple[dict, dict]:
    """The mode's commands, and for each the command its time is divided by per repeat (tar;
    with ``--engines``, ``--engine local`` with the same resize)."""
    shard_size = args.shard_size
    if args.engines and shard_size == "256MB":
        shard_size = "16MB"  # tasks to share
    pack = [sys.executable, "-m", "shardkit.cli", "pack", str(src)]
    local = ["--engine", "local", "--processes", str(args.processes)]

    def p(out: str, *flags: str) -> list[str]:
        return [*pack, str(work / out), *flags, "-q", "--shard-size", shard_size]

    if args.engines and args.ray:
        ray = p("c", "--engine", "ray", "--processes", str(args.processes))
        env = f"HOME={scratch} TMPDIR={scratch} RAY_TMPDIR={scratch}"
        cmds = {"local": p("b", *local), "pack-t1": p("a", "--threads", "1"),
                "ray": ["sh", "-c", f"{env} {' '.join(ray)}"]}  # fmt: skip
    elif args.engines:
        cmds = {}
        for r, resize in (("", ()), ("-r256", ("--resize-short", "256"))):
            cmds[f"local{r}"] = p(f"local{r}", *local, *resize)
            for t in ("1", "2"):
                cmds[f"pack-t{t}{r}"] = p(f"pack-t{t}{r}", "--threads", t, *resize)
    else:
        tar = ["tar", "-cf", str(work / "src.tar"), "-C", str(src.parent), src.name]
        cmds = {
            "tar": tar,
            "tar+sync": ["sh", "-c", f"{shlex.join(tar)} && sync {shlex.quote(tar[2])}"],
        }
        cmds.update({f"pack-w{t}": p(f"pack-w{t}", "--threads", t) for t in ("1", "2")})
    base = "local" if args.engines else "tar"
    return cmds, {n: base + ("-r256" if n.endswith("-r256") else "") for n in cmds}


def _clean(work: Path) -> None:
    for p in work.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    os.sync()


def _time(cmd: list[str]) -> dict:
    """Wall ``seconds`` of the command and the ``cpu`` seconds (user + system) it and its
    children used: on a shared machine, less disturbed by others than wall time."""
    c0, t0 = harness.cpu_seconds(), time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt, cpu = time.perf_counter() - t0, harness.cpu_seconds() - c0
    if r.returncode != 0:
        raise SystemExit(f"benchmark command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return {"seconds": dt, "cpu": cpu}


def _tree_size(src: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(src):
        for n in names:
            if not n.startswith("."):
                files += 1
                size += os.path.getsize(os.path.join(dirpath, n))
    return files, size


@harness.case(
    data="a class-per-folder tree (--src; default LFW-shaped), or --tiny N tiny JPEGs",
    measures="shardkit pack against tar -cf, cold cache; --engines: process pool and Ray",
    small={"src": str(data.root() / "lfw-smoke"), "work": str(data.root() / "pack-work")},
    aliases={"rounds": ["repeats"]},
)
class Pack(harness.Bench):
    rounds: int = 5
    json: Path | None = ROOT / "bench-out" / "bench_pack.json"
    src: str = harness.arg(
        str(ROOT / "data" / "lfw"),
        "class-per-folder tree (default data/lfw, made with synth if missing)",
    )
    work: str = harness.arg(
        str(ROOT / "bench-out" / "pack-work"),
        "scratch directory for outputs (emptied before every command)",
    )
    shard_size: str = "256MB"
    private_copy: bool = harness.arg(
        False,
        "time a copy of SRC made next to --work, so other processes reading SRC "
        "on a shared machine cannot warm its page cache between eviction and timing",
    )
    engines: bool = harness.arg(
        False, "compare --engine local --processes 2 with the in-process pack instead of tar"
    )
    processes: int = harness.arg(2, "--engines: worker processes")
    ray: bool = harness.arg(False, "--engines: Ray against the process pool")
    tiny: int = harness.arg(0, "make N tiny JPEGs at --src first")


def main(args: Pack) -> None:
    if args.smoke and not args.tiny:
        data.lfw(Path(args.src), 0.01)
    src = Path(args.src).resolve()
    if args.tiny:  # file count, not bytes, is what is timed
        data.noisy(src, args.tiny, 16, 12, classes=100)
    if not src.is_dir():
        if args.engines or src != (ROOT / "data" / "lfw").resolve():
            raise SystemExit(f"error: source {src} does not exist (make one: shardkit synth)")
        data.lfw(src)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.private_copy:
        copy = work.parent / "pack-src" / src.name
        if not copy.is_dir():
            print(f"copying {src} to {copy} ...", file=sys.stderr)
            shutil.copytree(src, copy.with_name(copy.name + ".tmp"), dirs_exist_ok=True)
            os.replace(copy.with_name(copy.name + ".tmp"), copy)
        src = copy
    files, size = _tree_size(src)
    scratch = tempfile.mkdtemp(prefix="sk-ray-", dir="/tmp")  # Ray's HOME and temp dir
    cmds, base = _commands(args, src, work, scratch)
    load0 = harness.loadavg()
    print(f"source: {src} ({files} files, {size / 1e6:.1f} MB); {args.rounds} repeats", flush=True)

    def once(name: str) -> dict:
        _clean(work)
        if not (args.engines and args.ray):  # cold page cache before every command
            evict(src)
        resident = resident_fraction(src)
        return {**_time(cmds[name]), "resident": resident}

    try:
        rounds = harness.interleave({n: (lambda r, n=n: once(n)) for n in cmds}, args.rounds)
    finally:
        _clean(work)
        shutil.rmtree(scratch, ignore_errors=True)
    rows = {}
    for n in cmds:
        ratios = rounds.ratios(n, base[n], "seconds")
        pairs = zip(rounds.values(n, "seconds"), rounds.values(base[n], "seconds"), strict=True)
        minus = [a - b for a, b in pairs]
        rows[n] = {"median s": rounds.median(n, "seconds"), "CPU s": rounds.median(n, "cpu"),
                   "MB/s": size / 1e6 / rounds.median(n, "seconds"), "base": base[n],
                   "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                   "minus base s": statistics.median(minus)}  # fmt: skip
    residency = max(x["resident"] for runs in rounds.results.values() for x in runs)
    summary = {"source": str(src), "files": files, "bytes": size, "commands": rows,
               "max_resident_fraction_before_run": residency, "cpus": os.cpu_count(),
               "loadavg_before": load0, "loadavg_after": harness.loadavg()}  # fmt: skip
    harness.write_result(args.json, "bench_pack", args, summary, rounds)
    cols = ["median s:.2f", "CPU s:.2f", "MB/s:.1f", "base", "ratio:.2f", "min:.2f", "max:.2f"]
    harness.table(rows, [*cols, "minus base s:+.2f"])
    if "pack-w1" in rows:
        w1, w2 = rows["pack-w1"]["ratio"], rows["pack-w2"]["ratio"]
        print(f"goal pack-w1/tar <= 1.20: {w1:.2f} {'met' if w1 <= 1.2 else 'MISSED'};  "
              f"goal pack-w2/tar < 1.00: {w2:.2f} {'met' if w2 < 1.0 else 'MISSED'}")  # fmt: skip
    after = harness.load_text(summary["loadavg_after"])
    print(f"page cache before each command: at most {residency:.1%} of the source resident "
          "(directory entries and inodes stay cached for all commands alike); load average "
          f"{harness.load_text(load0)}, after {after}")  # fmt: skip


if __name__ == "__main__":
    harness.script(__file__)
