#!/usr/bin/env python3
"""Pack benchmark: ``shardkit pack`` against ``tar -cf`` of the same folder, cold cache, one run.

Goal: pack with one worker takes at most 1.2x tar's wall time, and less than
tar's with two. Every timed command is a fresh subprocess, timed from start to exit, so Python's
start-up counts against pack as it would for a user. Before each command the source files are
evicted from the page cache with ``posix_fadvise(DONTNEED)`` (no root needed) and ``mincore``
confirms it; earlier outputs are deleted and synced so their write-back does not land in the next
timing. The order of the commands rotates between repeats, and ratios are taken within a repeat.

    python benchmarks/bench_pack.py                   # data/lfw (made if missing), 5 repeats
    python benchmarks/bench_pack.py --src data/lfw --repeats 7 --json bench-out/pack.json
    python benchmarks/bench_pack.py --engines --src data/imagenet --repeats 3

``--engines`` times ``--engine local --processes 2`` against today's in-process pack (reader
threads), with and without ``--resize-short 256``, side by side in each repeat (ratio
pack / engine: above 1 the process pool is faster), and prints the load average.
``--engines --ray`` times ``--engine ray`` (a local 2-CPU cluster started and stopped by the
command, in a scratch HOME and temp dir) against ``--engine local`` and the plain pack, and
``--tiny N`` first makes a folder of N tiny JPEGs (100 classes) at ``--src`` to time it on:

    python benchmarks/bench_pack.py --engines --ray --tiny 50000 --src bench-out/tiny50k

Caveats printed with the result: directory entries and inodes stay cached (dropping them needs
root and would disturb the whole machine), so this is a cold *data* cache for both commands alike;
and our shards are fsync'ed before they are renamed, tar's archive is not (the ``tar+sync``
column shows what that costs tar).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import data
import harness

from shardkit.bench.pagecache import evict, resident_fraction

ROOT = harness.ROOT


def _interleave(names: list[str], once, repeats: int, work: Path, note) -> tuple:
    """Every command once per repeat, the order rotating; ``once(name)`` returns a dict of
    figures with ``seconds``. Prints each repeat's seconds and ``note(seconds by name)``, empties
    ``work``; returns per repeat ``{name: figures}``, per repeat ``{name: seconds}`` (the shape
    the summaries read) and the rounds."""
    rounds = harness.interleave({n: (lambda r, n=n: once(n)) for n in names}, repeats)
    got = [{n: rounds.results[n][r] for n in names} for r in range(repeats)]
    runs = [{n: r[n]["seconds"] for n in names} for r in got]
    for rep, times in enumerate(runs):
        text = "  ".join(f"{n} {times[n]:.2f}s" for n in names)
        print(f"repeat {rep + 1}: {text}  | {note(times)}", flush=True)
    _clean(work)
    return got, runs, rounds


def _commands(src: Path, work: Path, shard_size: str) -> dict[str, list[str]]:
    pack = [sys.executable, "-m", "shardkit.cli", "pack", str(src)]
    common = ["-q", "--shard-size", shard_size]
    return {
        "tar": ["tar", "-cf", str(work / "src.tar"), "-C", str(src.parent), src.name],
        "tar+sync": [
            "sh",
            "-c",
            f'tar -cf "{work / "src_sync.tar"}" -C "{src.parent}" "{src.name}" && '
            f'sync "{work / "src_sync.tar"}"',
        ],
        "pack-w1": pack + [str(work / "pack-w1"), "--threads", "1", *common],
        "pack-w2": pack + [str(work / "pack-w2"), "--threads", "2", *common],
    }


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
    if args.engines:
        return _engines(args)
    src = Path(args.src).resolve()
    if not src.is_dir():
        if src != (ROOT / "data" / "lfw").resolve():
            raise SystemExit(f"error: source {src} does not exist")
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
    cmds = _commands(src, work, args.shard_size)
    names = list(cmds)
    print(
        f"source: {src} ({files} files, {size / 1e6:.1f} MB); {args.rounds} repeats, "
        f"cold page cache before every command",
        flush=True,
    )

    def once(name: str) -> dict:
        _clean(work)
        evict(src)
        resident = resident_fraction(src)
        return {**_time(cmds[name]), "resident": resident}

    def note(t: dict) -> str:
        return (
            f"pack-w1/tar {t['pack-w1'] / t['tar']:.2f}  pack-w2/tar {t['pack-w2'] / t['tar']:.2f}"
        )

    got, runs, rounds = _interleave(names, once, args.rounds, work, note)
    resident = [{n: r[n]["resident"] for n in names} for r in got]
    residency = [x for res in resident for x in res.values()]

    def ratios(name: str) -> list[float]:
        return [r[name] / r["tar"] for r in runs]

    summary = {
        "source": str(src),
        "files": files,
        "bytes": size,
        "repeats": args.rounds,
        "max_resident_fraction_before_run": max(residency),
        "median_seconds": {n: statistics.median(r[n] for r in runs) for n in names},
        "ratio_median": {n: statistics.median(ratios(n)) for n in names if n != "tar"},
        "ratio_min": {n: min(ratios(n)) for n in names if n != "tar"},
        "ratio_max": {n: max(ratios(n)) for n in names if n != "tar"},
        "runs": runs,
        "resident_fraction_before": resident,
        "cpus": os.cpu_count(),
    }
    harness.write_result(args.json, "bench_pack", args, summary, rounds)
    med = summary["median_seconds"]
    print()
    print(f"{'command':<10} {'median s':>9} {'MB/s':>7} {'ratio to tar (median [min-max])':>34}")
    for n in names:
        rng = (
            (
                f"{summary['ratio_median'][n]:.2f} [{summary['ratio_min'][n]:.2f}-"
                f"{summary['ratio_max'][n]:.2f}]"
            )
            if n != "tar"
            else "1.00"
        )
        print(f"{n:<10} {med[n]:>9.2f} {size / 1e6 / med[n]:>7.1f} {rng:>34}")
    w1, w2 = summary["ratio_median"]["pack-w1"], summary["ratio_median"]["pack-w2"]
    print(
        f"\ngoal pack-w1/tar <= 1.20: {w1:.2f} {'met' if w1 <= 1.2 else 'MISSED'};  "
        f"goal pack-w2/tar < 1.00: {w2:.2f} {'met' if w2 < 1.0 else 'MISSED'}"
    )
    print(
        f"page cache before each command: at most {max(residency):.1%} of the source resident; "
        "directory entries and inodes stay cached for all commands alike"
    )
    print(f"raw timings: {args.json}")
    return 0


def _make_tiny(src: Path, n: int) -> None:
    """``n`` 16x12 noise JPEGs in 100 class folders (file count, not bytes, is what is timed)."""
    import numpy as np
    from PIL import Image

    if src.is_dir() and sum(len(f) for _, _, f in os.walk(src)) == n:
        return
    rng = np.random.default_rng(0)
    for i in range(n):
        d = src / f"c{i % 100:03d}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(d / f"{i:06d}.jpg")


def _ray_commands(src: Path, work: Path, shard_size: str, processes: int, scratch: Path) -> dict:
    pack = [sys.executable, "-m", "shardkit.cli", "pack", str(src)]
    common = ["-q", "--shard-size", shard_size]
    env = f"HOME={scratch} TMPDIR={scratch} RAY_TMPDIR={scratch}"
    ray = [*pack, str(work / "c"), "--engine", "ray", "--processes", str(processes), *common]
    return {
        "pack-t1": pack + [str(work / "a"), "--threads", "1", *common],
        "local": pack
        + [str(work / "b"), "--engine", "local", "--processes", str(processes), *common],
        "ray": ["sh", "-c", f"{env} {' '.join(ray)}"],
    }


def _engine_commands(src: Path, work: Path, shard_size: str, processes: int) -> dict:
    pack = [sys.executable, "-m", "shardkit.cli", "pack", str(src)]
    common = ["-q", "--shard-size", shard_size]
    local = ["--engine", "local", "--processes", str(processes)]
    resize = ["--resize-short", "256"]
    return {
        "pack-t1": pack + [str(work / "a"), "--threads", "1", *common],
        "pack-t2": pack + [str(work / "b"), "--threads", "2", *common],
        "local": pack + [str(work / "c"), *local, *common],
        "pack-t1-r256": pack + [str(work / "d"), "--threads", "1", *common, *resize],
        "pack-t2-r256": pack + [str(work / "e"), "--threads", "2", *common, *resize],
        "local-r256": pack + [str(work / "f"), *local, *common, *resize],
    }


def _engines(args) -> int:
    """--engines: the process pool against the in-process pack, cold cache, one run."""
    src = Path(args.src).resolve()
    if args.tiny:
        _make_tiny(src, args.tiny)
    if not src.is_dir():
        raise SystemExit(f"error: source {src} does not exist (make one: shardkit synth imagenet)")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    files, size = _tree_size(src)
    shard_size = "16MB" if args.shard_size == "256MB" else args.shard_size  # tasks to share
    if args.ray:
        import tempfile

        scratch = Path(tempfile.mkdtemp(prefix="sk-ray-", dir="/tmp"))
        try:
            return _ray_overhead(args, src, work, files, size, shard_size, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    cmds = _engine_commands(src, work, shard_size, args.processes)
    names = list(cmds)
    load0 = harness.loadavg()
    print(
        f"source: {src} ({files} files, {size / 1e6:.1f} MB); {args.rounds} repeats; "
        f"load average before: {harness.load_text(load0)}",
        flush=True,
    )

    def once(name: str) -> dict:
        _clean(work)
        evict(src)
        return _time(cmds[name])

    def note(t: dict) -> str:
        r256 = t["pack-t1-r256"] / t["local-r256"]
        return f"pack-t1/local {t['pack-t1'] / t['local']:.2f}, r256 {r256:.2f}"

    got, runs, rounds = _interleave(names, once, args.rounds, work, note)
    cpus = [{n: r[n]["cpu"] for n in names} for r in got]
    load1 = harness.loadavg()
    speedups = {
        f"{base}{r}": [run[f"{base}{r}"] / run[f"local{r}"] for run in runs]
        for base in ("pack-t1", "pack-t2")
        for r in ("", "-r256")
    }
    summary = {
        "source": str(src),
        "files": files,
        "bytes": size,
        "repeats": args.rounds,
        "shard_size": shard_size,
        "processes": args.processes,
        "cpus": os.cpu_count(),
        "runs": runs,
        "cpu_seconds": cpus,
        "speedup_median": {k: statistics.median(v) for k, v in speedups.items()},
        "loadavg_before": load0,
        "loadavg_after": load1,
    }
    harness.write_result(args.json, "bench_pack", args, summary, rounds)
    print(f"\n{'command':<14} {'median s':>9} {'CPU s':>7}")
    for n in names:
        wall, used = statistics.median(r[n] for r in runs), statistics.median(c[n] for c in cpus)
        print(f"{n:<14} {wall:>9.2f} {used:>7.2f}")
    print(
        f"\nspeed-up of --engine local --processes {args.processes}: time of the in-process "
        "pack / time of the engine, per repeat (median [min-max])"
    )
    for k, v in speedups.items():
        print(
            f"  {k:<14} / local{'-r256' if 'r256' in k else '':<6} "
            f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
        )
    print(f"load average after: {harness.load_text(load1)}; raw: {args.json}")
    return 0


def _ray_overhead(args, src, work, files, size, shard_size, scratch) -> int:
    cmds = _ray_commands(src, work, shard_size, args.processes, scratch)
    names = list(cmds)
    load0 = harness.loadavg()
    print(
        f"source: {src} ({files} files, {size / 1e6:.1f} MB), shards of {shard_size}; "
        f"{args.rounds} repeats; load average before: {harness.load_text(load0)}",
        flush=True,
    )

    def once(name: str) -> dict:
        _clean(work)
        return _time(cmds[name])

    def note(t: dict) -> str:
        return f"ray - local {t['ray'] - t['local']:+.2f}s"

    _, runs, rounds = _interleave(names, once, args.rounds, work, note)
    load1 = harness.loadavg()
    over = [r["ray"] - r["local"] for r in runs]
    ratio = [r["ray"] / r["local"] for r in runs]
    summary = {
        "source": str(src),
        "files": files,
        "bytes": size,
        "shard_size": shard_size,
        "runs": runs,
        "ray_minus_local_s_median": statistics.median(over),
        "ray_over_local_median": statistics.median(ratio),
        "loadavg_before": load0,
        "loadavg_after": load1,
    }
    harness.write_result(args.json, "bench_pack", args, summary, rounds)
    for n in names:
        print(f"{n:<8} median {statistics.median(r[n] for r in runs):.2f} s")
    print(
        f"ray overhead against --engine local (start-up included): median "
        f"{statistics.median(over):+.2f} s, x{statistics.median(ratio):.2f}; load average "
        f"after: {harness.load_text(load1)}; raw: {args.json}"
    )
    return 0


if __name__ == "__main__":
    harness.script(__file__)
