"""The one harness every case in this folder runs on (docs/benchmarks.md, "`benchmarks/`":
what each part does and why every figure is taken in interleaved rounds).

``interleave`` and ``Rounds`` (medians of per-round ratios, each round's load), ``cpu_seconds``,
``in_child`` (a contender in a fresh process of ``--against``'s checkout), ``epoch`` (THE epoch
timing loop), ``ceiling`` (THE decode ceiling), ``table`` (THE report printer), the registry
(``@case``, ``Bench``, ``main``: ``python -m benchmarks list|run``) and ``write_result`` (one
JSON schema).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import multiprocessing as mp
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(ROOT)):  # run from a checkout without install
    if _p not in sys.path:
        sys.path.insert(0, _p)

if TYPE_CHECKING:
    from shardkit.bench.results import Load
    from shardkit.bench.stats import Comparison

# shardkit.bench's parts are imported when first used, not here: shardkit.bench imports torch,
# and bench_device.py imports torchvision before torch, as training scripts do.


def cores() -> int:
    """CPUs this process may run on (``shardkit.bench.runner.cores``)."""
    from shardkit.bench.runner import cores as bench_cores

    return bench_cores()


def load_now() -> Load:
    """The load average and CPU counts now (``shardkit.bench.results.Load``)."""
    from shardkit.bench.results import Load

    return Load.now(cores())


#: Schema version of ``write_result``'s JSON.
SCHEMA = 1


def say(*parts) -> None:
    """Progress on stderr (stdout carries the table a user reads)."""
    print(*parts, file=sys.stderr, flush=True)


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages now, as ``os.getloadavg`` gives them."""
    x = load_now()
    return (x.load_1m, x.load_5m, x.load_15m)


def load_text(avg: Sequence[float]) -> str:
    """``loadavg()``'s three figures as a reader sees them: "1.02 0.98 0.75"."""
    return " ".join(f"{x:.2f}" for x in avg)


# --- CPU seconds -------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its ended, waited-for children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def live_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds so far of live processes (persistent workers: not in RUSAGE_CHILDREN yet)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
        except OSError:
            continue
    return total / os.sysconf("SC_CLK_TCK")


def proc_kb(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A memory field of /proc/PID/status (VmRSS, VmHWM) in kB; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(x.split()[1]) for x in f if x.startswith(field + ":")), 0)
    except OSError:
        return 0


# --- interleaved rounds ------------------------------------------------------------------------


@dataclass
class Rounds:
    """Every contender's result per round, each round's load, in the order they ran.

    A contender's callable returns a dict of figures (a bare number is ``{"rate": x}``); the
    harness adds ``cpu_s`` (CPU seconds of the call: this process and its ended children) and
    ``wall_s`` unless the callable set them.
    """

    names: list[str]
    results: dict[str, list[dict]] = field(default_factory=dict)
    loads: list[Load] = field(default_factory=list)
    orders: list[list[str]] = field(default_factory=list)

    def values(self, name: str, key: str = "rate") -> list[float]:
        return [r[key] for r in self.results[name]]

    def median(self, name: str, key: str = "rate") -> float:
        return statistics.median(self.values(name, key))

    def ratios(self, a: str, b: str, key: str = "rate", b_key: str | None = None) -> list[float]:
        pairs = zip(self.values(a, key), self.values(b, b_key or key), strict=True)
        return [x / y if y else float("inf") for x, y in pairs]

    def ratio(self, a: str, b: str, key: str = "rate", b_key: str | None = None) -> float:
        """The median of per-round ratios ``a / b`` (of ``b``'s ``b_key`` where it is another
        figure, e.g. a ceiling's): each round's pair shares its load."""
        return statistics.median(self.ratios(a, b, key, b_key))

    def welch(self, a: str, b: str, key: str = "rate") -> Comparison:
        """Welch's t-test of the two contenders' values (``shardkit.bench.stats.welch``)."""
        from shardkit.bench.stats import welch

        return welch(self.values(a, key), self.values(b, key))

    def load_text(self) -> str:
        return " ".join(f"{x.load_1m:.2f}" for x in self.loads)

    def as_dict(self) -> dict:
        return {
            "names": self.names,
            "loads": [x.as_dict() for x in self.loads],
            "orders": self.orders,
            "results": self.results,
        }


def interleave(
    contenders: dict[str, Callable[[int], dict | float]],
    rounds: int,
    order: str = "rotate",
    quiet: bool = False,
    first: Sequence[str] = (),
) -> Rounds:
    """Run every contender once per round; ``order``: "rotate" (each goes first in turn),
    "reverse" (the order flips every round: for two contenders the same thing), "shuffle"
    (a random order seeded by the round) or "fixed" (the given order every round).
    ``first``: contenders that open every round, before the others' order (a ceiling the
    round's other figures divide by)."""
    if order not in ("rotate", "reverse", "shuffle", "fixed"):
        raise SystemExit(f"interleave: order {order!r} is not rotate, reverse, shuffle or fixed")
    names = [n for n in contenders if n not in first]
    out = Rounds([*first, *names], {n: [] for n in contenders})
    for r in range(rounds):
        out.loads.append(load_now())
        if order == "rotate":
            now = names[r % len(names) :] + names[: r % len(names)]
        elif order == "reverse":
            now = names if r % 2 == 0 else names[::-1]
        elif order == "shuffle":  # seeded by the round: the same orders every run
            now = list(names)
            random.Random(r).shuffle(now)
        else:
            now = list(names)
        now = [*first, *now]
        out.orders.append(now)
        for name in now:
            c0, t0 = cpu_seconds(), time.perf_counter()
            got = contenders[name](r)
            res = dict(got) if isinstance(got, dict) else {"rate": float(got)}
            res.setdefault("cpu_s", cpu_seconds() - c0)
            res.setdefault("wall_s", time.perf_counter() - t0)
            out.results[name].append(res)
        if not quiet:
            say(f"round {r + 1}/{rounds}: load {out.loads[-1].text()}")
    return out


# --- the epoch timing loop ---------------------------------------------------------------------


def batch_len(batch) -> int:
    """Samples in one batch: a dict's ``image``, a tuple's first part, or the batch itself."""
    if isinstance(batch, dict):
        return len(batch["image"])
    if isinstance(batch, (tuple, list)):
        return len(batch[0])
    return len(batch)


def epoch(batches, limit: int | None = None, pids: Callable[[], list] | None = None) -> dict:
    """THE epoch timing loop: iterate ``batches`` (up to ``limit`` samples) and return
    ``images``; ``first_s`` (the wait for the first batch: workers starting, shards opening);
    ``rate`` (images per wall second, the whole epoch) and ``steady_rate`` (after the first
    batch); ``wall_s``; ``cpu_s`` (this process, its ended children and the live workers of a
    loader with ``worker_pids``: persistent workers are not reaped yet); ``workers_cpu_s``
    (those live workers alone); ``main_cpu_s`` (this process alone: what a trainer's own loop
    pays). ``pids``: how to find the live workers of a loader without ``worker_pids`` (a
    DataLoader with persistent workers), asked before the epoch and, if none yet, after it."""
    gc.collect()  # the garbage of what ran before is not this epoch's
    c0, m0 = cpu_seconds(), time.process_time()
    find = pids or (lambda: list(getattr(batches, "worker_pids", [])))
    pids = find()  # a loader's workers, once started
    w0 = live_cpu_seconds(pids)
    t0 = t1 = time.perf_counter()
    n = first = 0
    for b in batches:
        if not first:
            t1, first = time.perf_counter(), batch_len(b)
        n += batch_len(b)
        if limit is not None and n >= limit:
            break
    t2 = time.perf_counter()
    main = time.process_time() - m0
    pids = pids or find()  # workers started by this epoch
    workers = live_cpu_seconds(pids) - w0
    b = None
    gc.collect()  # DataLoader workers exit and are reaped: their CPU time is counted
    return {
        "images": n,
        "first_s": t1 - t0,
        "wall_s": t2 - t0,
        "cpu_s": cpu_seconds() - c0 + workers,
        "workers_cpu_s": workers,
        "main_cpu_s": main,
        "rate": n / (t2 - t0) if n else float("nan"),
        "steady_rate": (n - first) / (t2 - t1) if n > first else float("nan"),
    }


# --- child processes ---------------------------------------------------------------------------


#: What every child's code may use: its own CPU seconds, bytes read and /proc/self/status fields.
CHILD_PRELUDE = r"""
import json, os, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def rchar():
    with open("/proc/self/io") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("rchar"))
def status_mb(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) / 1024
"""


def in_child(checkout: Path | str, code: str, *args: str, cwd: Path | str | None = None) -> dict:
    """Run ``python -c code *args`` with ``checkout`` (and benchmarks/) first on sys.path, after
    ``CHILD_PRELUDE``; the child prints one JSON object as its last line, returned with
    ``child_wall_s`` and ``child_cpu_s`` (the child's own CPU and its children's) added. The
    child's shardkit is checked to come from ``checkout``."""
    checkout = Path(checkout).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(HERE)])}
    check = "import shardkit as _k, sys as _s; _s.stderr.write('SHARDKIT=' + _k.__file__ + '\\n')\n"
    check += CHILD_PRELUDE
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", check + code, *map(str, args)],
        env=env,
        cwd=str(cwd or checkout),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"failed in {checkout}: {' '.join(map(str, args))}\n{r.stderr[-3000:]}")
    where = next((x[9:] for x in r.stderr.splitlines() if x.startswith("SHARDKIT=")), "")
    if not where.startswith(str(checkout)):
        raise SystemExit(f"the child ran {where}, not {checkout}'s shardkit")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    doc.setdefault("child_wall_s", wall)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    doc.setdefault("child_cpu_s", cpu)
    return doc


def checkouts(case: Bench) -> dict[str, Path]:
    """``{"this": this checkout, "against": --against}`` for a case that compares two checkouts:
    ``--against`` is required, except under ``--small`` (this checkout against itself)."""
    if case.against is None and not case.smoke:
        raise SystemExit("--against DIR is required (another checkout)")
    return {"this": ROOT, "against": Path(case.against or ROOT).resolve()}


def table(rows: dict[str, dict], columns: Sequence[str], title: str = "") -> None:
    """THE report printer: one line per row, one column per ``"key:format"`` (``"rate:.0f"``;
    no format: ``str``), "-" where a row lacks the key; a case declares its columns."""
    cols = [c.partition(":")[::2] for c in columns]
    width = max([len(str(name)) for name in rows] + [4])
    if title:
        print(f"\n{title}")
    print(" " * width, *(f"{k:>{max(8, len(k))}}" for k, _ in cols))
    for name, row in rows.items():
        cells = []
        for k, fmt in cols:
            v = row.get(k)
            text = "-" if v is None else format(v, fmt) if isinstance(v, (int, float)) else str(v)
            cells.append(f"{text:>{max(8, len(k))}}")
        print(f"{str(name):{width}}", *cells, flush=True)


def side_by_side(rounds: Rounds, this: str, other: str, key: str = "rate") -> dict:
    """Two contenders' medians of ``key``, the median of per-round ratios and those ratios."""
    return {
        "this": rounds.median(this, key),
        "against": rounds.median(other, key),
        "ratio": rounds.ratio(this, other, key),
        "ratios": [round(x, 3) for x in rounds.ratios(this, other, key)],
    }


# --- the decode ceiling ------------------------------------------------------------------------


@dataclass(frozen=True)
class Ceiling:
    """The decode ceiling of one set of JPEG bytes, decoded whole from memory (no reading, no
    loader): what no loader can beat on this machine.

    ``one``: images/s of this process on one thread; ``cpu_us``: its CPU microseconds per image
    (what other processes' load changes least); ``cores``: the cores it is scaled to;
    ``scaled``: ``one * cores`` (the ceiling the docs' "of the ceiling" figures divide by);
    ``at_once``: images/s of ``cores`` processes decoding shares at the same time (what the
    cores really give right now on a shared machine; None when not asked for).
    """

    decoder: str
    one: float
    cpu_us: float
    cores: int
    scaled: float
    at_once: float | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _decoder(name: str, fastdct: bool = False) -> Callable[[bytes], object]:
    if name == "simplejpeg":
        import simplejpeg

        return lambda d: simplejpeg.decode_jpeg(d, fastdct=fastdct)
    if name == "pil":
        import io

        import numpy as np
        from PIL import Image

        return lambda d: np.asarray(Image.open(io.BytesIO(d)).convert("RGB"))
    raise SystemExit(f"unknown decoder {name!r}: simplejpeg or pil")


def _decode_part(name, fastdct, datas, start, done) -> None:
    dec = _decoder(name, fastdct)
    start.wait()
    for d in datas:
        dec(d)
    done.put(time.perf_counter())


def ceiling_at_once(
    blobs: Sequence[bytes], processes: int, *, decoder: str = "simplejpeg", fastdct: bool = False
) -> float:
    """Images/s of ``processes`` processes decoding shares of ``blobs`` at the same time (what
    the cores really give right now): the ``at_once`` part of ``ceiling``."""
    n = processes
    ctx = mp.get_context("fork")
    start, done = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_decode_part, args=(decoder, fastdct, blobs[i::n], start, done))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    start.set()
    ends = [done.get() for _ in procs]
    for p in procs:
        p.join()
    return len(blobs) / (max(ends) - t0)


def ceiling(
    blobs: Sequence[bytes],
    *,
    decoder: str = "simplejpeg",
    processes: int | None = None,
    at_once: bool = False,
    fastdct: bool = False,
) -> Ceiling:
    """THE decode ceiling: full decodes of ``blobs`` to RGB in memory, one pass.

    ``decoder``: "simplejpeg" (libjpeg-turbo, what shardkit's tensor path decodes with) or
    "pil" (Pillow, what a torchvision-style pipeline decodes with). ``processes``: the cores to
    scale to (default ``min(2, cores())``, the loader goals' "2-core ceiling"); ``at_once``:
    also measure that many processes decoding shares at the same time. ``fastdct``: the
    faster, less accurate IDCT FFCV decodes with.
    """
    n = processes or min(2, cores())
    dec = _decoder(decoder, fastdct)
    t, c = time.perf_counter(), time.thread_time()
    for d in blobs:
        dec(d)
    cpu_us = (time.thread_time() - c) / len(blobs) * 1e6
    one = len(blobs) / (time.perf_counter() - t)
    both = ceiling_at_once(blobs, n, decoder=decoder, fastdct=fastdct) if at_once else None
    return Ceiling(decoder, one, cpu_us, n, one * n, both)


# --- the registry of cases ---------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """The parameters every case shares; a case subclasses it with its own typed fields (a new
    default for ``rounds`` where it wants more); ``run()`` measures and writes."""

    rounds: int = 3
    json: Path | None = None
    smoke: bool = False

    #: Set by ``@case``: the case's name, what data it makes, what it measures, its small values
    #: (``--small``) and extra spellings of its flags.
    NAME: typing.ClassVar[str] = ""
    DATA: typing.ClassVar[str] = ""
    MEASURES: typing.ClassVar[str] = ""
    SMALL: typing.ClassVar[dict] = {}
    ALIASES: typing.ClassVar[dict] = {}

    def run(self) -> None:
        """Make the data, set up the contenders, measure, write: the case's module's
        ``main(case)``, unless the case says otherwise."""
        sys.modules[type(self).__module__].main(self)


#: name -> the case's class, in the order they were registered.
CASES: dict[str, type[Bench]] = {}


def arg(default, help: str = "", positional: bool = False):
    """A case parameter with its help text (``positional``: given without a flag)."""
    meta = {"help": help, "positional": positional}
    if isinstance(default, (list, dict, set)):
        raise TypeError("a case parameter's default must be immutable: give a tuple")
    return dataclasses.field(default=default, metadata=meta)


def case(*, data: str, measures: str, small: dict | None = None, aliases: dict | None = None):
    """Register a case: the class becomes a frozen dataclass named after its file
    (``bench_fields.py`` -> ``fields``)."""

    def register(cls):
        cls = dataclass(frozen=True)(cls)
        cls.NAME = Path(sys.modules[cls.__module__].__file__).stem.removeprefix("bench_")
        cls.DATA, cls.MEASURES = data, measures
        cls.SMALL, cls.ALIASES = dict(small or {}), dict(aliases or {})
        unknown = set(cls.SMALL) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"{cls.NAME}: small values for no parameter: {sorted(unknown)}")
        CASES[cls.NAME] = cls
        return cls

    return register


def cases() -> dict[str, type[Bench]]:
    """Every case in benchmarks/, each file imported once (the imports are the registrations)."""
    for path in sorted(HERE.glob("bench_*.py")):
        if path.stem.removeprefix("bench_") not in CASES and path.stem not in sys.modules:
            importlib.import_module(path.stem)
    return dict(sorted(CASES.items()))


def _flag_type(hint) -> tuple:
    """(argparse type, nargs, choices) of a field's annotation: X, X | None, tuple[X, ...],
    Literal["a", "b"]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if origin is tuple:
        kind, _, choices = _flag_type(args[0])
        return kind, "*", choices
    if origin is typing.Literal:
        return type(args[0]), None, args
    return hint, None, None


def case_parser(cls: type[Bench]) -> argparse.ArgumentParser:
    """The flags of a case, made from its fields."""
    doc = sys.modules[cls.__module__].__doc__ or ""
    ap = argparse.ArgumentParser(
        prog=f"python -m benchmarks run {cls.NAME}",
        description=doc.strip().split("\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "smoke":
            ap.add_argument("--small", "--smoke", dest="smoke", action="store_true",
                            help="tiny data, one round: does the case still run?")  # fmt: skip
            continue
        kind, nargs, choices = _flag_type(hints[f.name])
        helptext = f.metadata.get("help") or None
        if f.metadata.get("positional"):
            ap.add_argument(f.name, nargs="?", type=kind, default=f.default, help=helptext,
                            choices=choices)  # fmt: skip
            continue
        names = ["--" + x.replace("_", "-") for x in [f.name, *cls.ALIASES.get(f.name, ())]]
        kw: dict = {"dest": f.name, "default": f.default, "help": helptext}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif nargs:  # many: --n 1 2, --n 1 --n 2 or --n 1,2
            kw.update(nargs="+", action="extend", default=None)
            if choices:
                kw["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        else:
            kw["type"], kw["choices"] = kind, choices
        ap.add_argument(*names, **kw)
    return ap


def make_case(cls: type[Bench], argv: Sequence[str] = ()) -> Bench:
    """The case's parameters from ``argv``; under ``--small`` its small values and one round."""
    ap = case_parser(cls)
    given = vars(ap.parse_args(list(argv)))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, nargs, choices = _flag_type(hints[f.name])
        if nargs and isinstance(given[f.name], list):
            try:
                items = [kind(x) for v in given[f.name] for x in v.split(",") if x]
            except ValueError as exc:
                ap.error(f"--{f.name.replace('_', '-')}: {exc}")
            if choices and not set(items) <= set(choices):
                ap.error(f"--{f.name.replace('_', '-')}: choose from {', '.join(choices)}")
            given[f.name] = tuple(items)
        elif nargs:
            given[f.name] = f.default
    if given["smoke"]:
        given.update(rounds=1, **cls.SMALL)
    return cls(**given)


def run_case(name: str, argv: Sequence[str] = ()) -> None:
    """Import ``bench_NAME`` alone (its import registers it) and run it with ``argv``."""
    if name not in CASES:
        if not (HERE / f"bench_{name}.py").exists():
            raise SystemExit(f"no case {name!r}: `python -m benchmarks list` names them")
        importlib.import_module(f"bench_{name}")
    make_case(CASES[name], argv).run()


def script(file: str) -> None:
    """``python benchmarks/bench_x.py ARGS`` = ``python -m benchmarks run x ARGS``."""
    run_case(Path(file).stem.removeprefix("bench_"), sys.argv[1:])


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks list`` | ``run CASE [--small] [--against DIR] [case flags]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["list"]:
        for cls in cases().values():
            print(f"{cls.NAME:18} {cls.MEASURES}\n{'':18} data: {cls.DATA}")
        return
    if argv[:1] == ["run"] and len(argv) > 1:
        return run_case(argv[1], argv[2:])
    raise SystemExit("usage: python -m benchmarks list | run CASE [--small] [case flags]")


# --- small mode, results ----------------------------------------------------------------


def available(module: str) -> bool:
    """Whether ``module`` can be imported (a contender's package: webdataset, ffcv...)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def smoke_drop(contenders: dict, args: Bench, *packages: str) -> dict:
    """Under ``--smoke``, the contenders without the ones named after a package that is not
    installed; otherwise all of them (a real run fails loudly on a missing package)."""
    gone = [p for p in packages if args.smoke and not available(p)]
    return {k: v for k, v in contenders.items() if not any(p in k.lower() for p in gone)}


def write_result(
    path: Path | None,
    name: str,
    args: Bench,
    result: dict,
    rounds: Rounds | None = None,
) -> dict:
    """One schema: ``{schema, benchmark, args, machine, load_end, rounds, result}``."""
    from shardkit.bench.runner import machine_facts

    doc = {
        "schema": SCHEMA,
        "benchmark": name,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_facts(),
        "load_end": load_now().as_dict(),
        "rounds": rounds.as_dict() if rounds is not None else None,
        "result": result,
    }
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str))
    return doc
