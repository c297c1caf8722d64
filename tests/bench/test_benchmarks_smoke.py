"""Every case in benchmarks/ still runs, and the harness they share computes what it says.

The cases are not part of the package, so nothing else imports them: a refactor of shardkit
would break them silently (two did break that way: a mixture of two class lists and the bench
runner's preparation). The slow test runs each one through ``python -m benchmarks run CASE
--small`` (tiny data, one round) in a child process and checks the JSON it writes; the cases
that need a GPU are skipped without one, and a contender whose package is missing (webdataset,
ffcv) is left out by the case.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402

#: A retired keyword in a script fails its run: the benchmarks use only the new spellings.
RETIRED_IS_AN_ERROR = "error:retired keyword:FutureWarning"

SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("bench_*.py"))
#: One case per file: ``bench_fields.py`` registers ``fields``.
CASES = [s.removeprefix("bench_").removesuffix(".py") for s in SCRIPTS]

#: Extra flags per case: the --against path is exercised against this very checkout.
EXTRA = {
    name: ["--against", str(ROOT)]
    for name in (
        "against", "crops", "open", "scale", "split", "table",
    )
}  # fmt: skip


def _gpu() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


NEEDS_GPU = {"device"}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """One data root for every script: the tiny trees are made once and shared."""
    return tmp_path_factory.mktemp("bench-data")


@pytest.mark.slow
@pytest.mark.timeout(900)  # a busy 2-core machine: bench_scale starts ~30 child processes
@pytest.mark.parametrize("name", CASES)
def test_every_case_runs_small(name, data_root, tmp_path):
    if name in NEEDS_GPU and not _gpu():
        pytest.skip("needs a CUDA device")
    out = tmp_path / "result.json"
    env = {
        **os.environ,
        "SHARDKIT_BENCH_DATA": str(data_root),
        "PYTHONWARNINGS": RETIRED_IS_AN_ERROR,
    }
    argv = [sys.executable, "-m", "benchmarks", "run", name, "--small", "--json", str(out)]
    r = subprocess.run(
        [*argv, *EXTRA.get(name, [])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, f"{name} --small failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert doc["schema"] == harness.SCHEMA
    assert doc["benchmark"] == f"bench_{name}"
    assert doc["args"]["smoke"] is True
    assert doc["machine"]["cores"] >= 1
    if doc["rounds"] is not None:
        assert len(doc["rounds"]["loads"]) == 1  # one round in smoke mode, its load recorded


@pytest.mark.slow
def test_bench_device_stub_measures_the_decode_threads_python_without_a_gpu(data_root, tmp_path):
    """``bench_device.py --stub``: the device path with its decode and resize stubbed runs on
    any machine and reports the decode thread's CPU per image for both output sizes."""
    out = tmp_path / "result.json"
    env = {
        **os.environ,
        "SHARDKIT_BENCH_DATA": str(data_root),
        "PYTHONWARNINGS": RETIRED_IS_AN_ERROR,
    }
    argv = [sys.executable, str(BENCHMARKS / "bench_device.py"), "--smoke", "--stub"]
    r = subprocess.run(
        [*argv, "--workers", "1", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"--stub failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    stub = json.loads(out.read_text())["result"]["stub"]
    for size in ("size_16", "size_224"):
        row = stub[size]
        assert row["batches"] >= 3, (size, row)  # every timed batch went through the stubs
        assert 0 < row["in_decode_stub_us_per_image"] < row["decode_thread_cpu_us_per_image"]
        assert row["device_path_python_us_per_image"] > 0


def test_list_names_every_case_and_a_script_runs_as_its_case(tmp_path):
    """``python -m benchmarks list`` names one case per file; ``python benchmarks/bench_x.py``
    is the same case with the same flags (the docs' commands)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks", "list"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x.split()[0] for x in r.stdout.splitlines() if x[:1] not in " "] == CASES
    assert "no case 'nope'" in subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "nope"], cwd=ROOT, capture_output=True,
        text=True, timeout=300).stderr  # fmt: skip
    r = subprocess.run([sys.executable, str(BENCHMARKS / "bench_fields.py"), "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "--batch-size" in r.stdout and "--small" in r.stdout and "--repeats" in r.stdout


_PARSE = """
import json, sys
sys.path.insert(0, "benchmarks")
import harness
bad = []
for name, argv in json.loads(sys.argv[1]):
    try:
        __import__("bench_" + name)  # its import registers the case
        harness.make_case(harness.CASES[name], argv)
    except SystemExit as exc:
        bad.append([name, argv, str(exc)])
print(json.dumps(bad))
"""


@pytest.mark.slow
def test_the_docs_bench_commands_are_the_cases_flags():
    """Every ``python benchmarks/bench_x.py FLAGS`` the docs quote parses as its case's flags
    (the scripts are the registered cases: a renamed or dropped flag breaks the docs)."""
    import re
    import shlex

    commands = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"python benchmarks/bench_(\w+)\.py([^`]*)`", doc.read_text()):
            rest = " ".join(m.group(2).split())
            if not any(c in rest for c in "[]|#\\") and "ARGS" not in rest:
                commands.append([m.group(1), shlex.split(rest)])
    assert len(commands) > 30
    r = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(commands)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []


def test_a_case_is_a_frozen_dataclass_whose_fields_are_its_flags():
    @harness.case(data="none", measures="nothing", small={"n": 2}, aliases={"n": ["count"]})
    class Probe(harness.Bench):
        n: int = harness.arg(10, "how many")
        sizes: tuple[int, ...] = (1, 2)
        where: Path | None = None
        cold: bool = False
        warm: bool = True

    try:
        p = harness.make_case(Probe, ["--count", "4", "--sizes", "3", "4", "--no-warm"])
        assert (p.n, p.sizes, p.where, p.cold, p.warm, p.rounds) == (
            4,
            (3, 4),
            None,
            False,
            False,
            3,
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.n = 5  # frozen: a case's parameters are one value
        small = harness.make_case(Probe, ["--small", "--where", "/x"])
        assert (small.n, small.rounds, small.smoke, small.where) == (2, 1, True, Path("/x"))
        with pytest.raises(SystemExit):
            harness.make_case(Probe, ["--n", "1.5"])  # typed: no float where an int is meant
    finally:
        harness.CASES.pop(Probe.NAME)


def test_epoch_is_the_one_timing_loop():
    batches = [{"image": [0] * 4}, ([0] * 3, None), b"ab"]
    e = harness.epoch(iter(batches))
    assert e["images"] == 4 + 3 + 2 and e["wall_s"] >= e["first_s"] >= 0
    assert harness.epoch(iter(batches), limit=5)["images"] == 7


def test_epoch_counts_the_live_workers_its_pids_option_finds():
    """A DataLoader's persistent workers have no ``worker_pids``: ``pids=`` finds them, asked
    again after the epoch where none had started; their CPU is ``workers_cpu_s``."""
    asked = []

    def pids():  # none before the epoch (workers not started), this process after it
        asked.append(len(asked))
        return [os.getpid()] if len(asked) > 1 else []

    def busy():
        for _ in range(3):
            c = time.process_time()
            while time.process_time() - c < 0.05:  # CPU, not wall time: 50 ms per batch
                pass
            yield b"ab"  # two samples

    e = harness.epoch(busy(), pids=pids)
    assert asked == [0, 1] and e["images"] == 6
    assert e["workers_cpu_s"] >= 0.15  # started by this epoch: all their CPU is its own

    e = harness.epoch(busy(), pids=lambda: [os.getpid()])  # live all along: the epoch's part
    assert 0.1 <= e["workers_cpu_s"] <= e["cpu_s"]  # /proc counts whole clock ticks


def test_ratio_of_another_figure_and_the_against_checkouts(tmp_path):
    r = harness.Rounds(["a", "ceil"], {"a": [{"rate": 2.0}, {"rate": 3.0}],
                                       "ceil": [{"one": 4.0}, {"one": 3.0}]})  # fmt: skip
    assert r.ratio("a", "ceil", b_key="one") == 0.75  # median of 0.5 and 1.0
    assert r.ratios("a", "ceil", "rate", "one") == [0.5, 1.0]

    @dataclasses.dataclass(frozen=True)
    class Case:
        against: Path | None = None
        smoke: bool = False

    with pytest.raises(SystemExit, match="--against DIR is required"):
        harness.checkouts(Case())
    assert harness.checkouts(Case(smoke=True)) == {"this": ROOT, "against": ROOT.resolve()}
    assert harness.checkouts(Case(tmp_path))["against"] == tmp_path.resolve()
    assert harness.proc_kb() > 0 and harness.proc_kb(2**22 + 1) == 0  # no such process


def test_every_script_is_on_the_harness():
    """No script keeps a harness of its own: the load, the JSON and the rounds come from
    harness.py, and no private shardkit name is used."""
    for name in SCRIPTS:
        text = (BENCHMARKS / name).read_text()
        assert "import harness" in text, name
        assert "os.getloadavg" not in text, name
        assert "write_text(json.dumps" not in text, name
        for private in ("._balance", "._overlap_epochs", "._res.", "._copier", "._nvimgcodec"):
            assert private not in text, (name, private)
        assert "import _" not in text and "_prepare," not in text, name


@pytest.mark.slow
def test_harness_in_child_failure_names_the_checkout_and_its_arguments(tmp_path):
    """A contender that fails in its child stops the run with one message naming the checkout,
    the arguments (paths and numbers, as the scripts pass them) and the child's stderr."""
    code = "import sys; sys.exit('no batch timed in ' + sys.argv[1])"
    with pytest.raises(SystemExit) as exc:
        harness.in_child(ROOT, code, tmp_path / "pack", 64)
    text = str(exc.value)
    assert f"failed in {ROOT}: {tmp_path / 'pack'} 64" in text
    assert f"no batch timed in {tmp_path / 'pack'}" in text


def test_interleave_rotates_records_load_and_cpu():
    calls = []

    def side(name):
        def run(r):
            calls.append((r, name))
            return {"rate": {"a": 2.0, "b": 1.0, "c": 4.0}[name] * (r + 1)}

        return run

    rounds = harness.interleave({n: side(n) for n in "abc"}, 3, quiet=True)
    assert rounds.orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [n for _, n in calls] == [n for order in rounds.orders for n in order]
    assert len(rounds.loads) == 3 and all(x.cores >= 1 for x in rounds.loads)
    assert all("cpu_s" in x and "wall_s" in x for x in rounds.results["a"])
    assert rounds.ratios("a", "b") == [2.0, 2.0, 2.0]
    assert rounds.median("c") == 8.0


def test_ratio_is_the_median_of_per_round_ratios_not_the_ratio_of_medians():
    values = {"a": [10.0, 1.0, 4.0], "b": [5.0, 4.0, 1.0]}
    rounds = harness.interleave(
        {n: (lambda r, n=n: values[n][r]) for n in values}, 3, order="reverse", quiet=True
    )
    assert rounds.orders == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert rounds.ratio("a", "b") == 2.0  # per round 2.0, 0.25, 4.0
    assert rounds.median("a") / rounds.median("b") == 1.0  # what a ratio of medians says


def test_first_contenders_open_every_round_and_shuffle_is_seeded():
    names = {n: (lambda r: 1.0) for n in ("ceiling", "x", "y", "z")}
    rounds = harness.interleave(names, 3, first=["ceiling"], quiet=True)
    assert all(order[0] == "ceiling" for order in rounds.orders)
    assert rounds.orders[1][1:] == ["y", "z", "x"]
    again = harness.interleave(names, 3, order="shuffle", quiet=True).orders
    assert again == harness.interleave(names, 3, order="shuffle", quiet=True).orders


def test_smoke_drop_leaves_out_only_missing_packages_and_only_in_smoke_mode(tmp_path):
    cons = {"ShardLoader": 1, "webdataset + DataLoader": 2, "FFCV Loader": 3}
    smoke, real = harness.make_case(harness.Bench, ["--small"]), harness.Bench()
    assert harness.smoke_drop(cons, smoke, "surely_not_installed_pkg") == cons
    gone = harness.smoke_drop(cons, smoke, "ffcv") if not harness.available("ffcv") else None
    if gone is not None:
        assert "FFCV Loader" not in gone and "ShardLoader" in gone
    assert harness.smoke_drop(cons, real, "ffcv") == cons
    assert smoke.rounds == 1 and real.rounds == 3


def test_write_result_is_one_schema(tmp_path):
    args = harness.make_case(harness.Bench, ["--rounds", "2"])
    rounds = harness.interleave({"a": lambda r: 1.0}, 2, quiet=True)
    doc = harness.write_result(tmp_path / "r.json", "bench_x", args, {"k": 1}, rounds)
    back = json.loads((tmp_path / "r.json").read_text())
    assert back == json.loads(json.dumps(doc, default=str))
    assert set(back) == {"schema", "benchmark", "args", "machine", "load_end", "rounds", "result"}
    assert back["rounds"]["names"] == ["a"] and len(back["rounds"]["results"]["a"]) == 2


def test_table_is_the_one_report_printer(capsys):
    """A case declares its columns as ``key:format``; a row without a key shows "-", a value
    that is not a number is shown as it is, and a title comes first."""
    rows = {"ShardLoader": {"rate": 1234.5, "ratio": 0.98765, "note": "ok"}, "folder": {"rate": 7}}
    harness.table(rows, ["rate:,.0f", "ratio:.2f", "note"], "epochs")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "epochs" and lines[2].split() == ["rate", "ratio", "note"]
    assert lines[3].split() == ["ShardLoader", "1,234", "0.99", "ok"]
    assert lines[4].split() == ["folder", "7", "-", "-"]


def test_ceiling_is_one_definition_with_its_variants():
    import data

    blobs = [data.tiny_jpeg(64, seed) for seed in range(8)]
    c = harness.ceiling(blobs, processes=2)
    assert c.decoder == "simplejpeg" and c.cores == 2
    assert c.scaled == pytest.approx(c.one * 2) and c.cpu_us > 0 and c.at_once is None
    pil = harness.ceiling(blobs, decoder="pil", processes=1)
    assert pil.scaled == pytest.approx(pil.one)
