"""A table planned in pieces on an engine: each span's arrays written by the worker that
scanned it, joined on disk, the driver's columns memory-mapped (``shardkit.scan.pieces``).
The plan, its file and the pack are byte for byte those of the plan held in one process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import warnings
from dataclasses import replace

import numpy as np
import pytest

from shardkit import PackOptions, pack
from shardkit.fsutil import HOST, STAGING_PREFIX
from shardkit.manifest import read_manifest
from shardkit.write.plan import plan_pack
from shardkit.write.planfile import save_tasks
from shardkit.write.task import run_task


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


class Here:
    """An engine that runs its spans and tasks in this process, in order (as a user's own
    runner may): the pieces path without worker processes."""

    def __init__(self, plan_chunk: int, stop_after_scan: bool = False):
        self.plan_chunk, self.stop_after_scan = plan_chunk, stop_after_scan

    def map_chunks(self, fn, chunks):
        out = [fn(*c) for c in chunks]
        if self.stop_after_scan and getattr(fn, "__name__", "") == "scan_span_to":
            raise KeyboardInterrupt  # interrupted with every span's piece written
        return out

    def __call__(self, tasks):
        return [r for t in tasks for r in run_task(t, 1)]


def _image(path, k: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\xff\xd8" + bytes([k % 256]) * (40 + 13 * (k % 11)))
    os.utime(path, ns=(10**18, 10**18 + k))


def _paths_table(tmp, repeated: bool):
    """Image paths with every key rule: two spellings of a stem, names ending in ~2, rows
    naming an image again (``repeated``), quotes and non-ASCII."""
    names = ["a.jpg", "a.png", "a~2.jpg", "b.jpg", "b~2.jpg", "sub/x.jpg", "sub/x.JPEG", "ü.jpg"]
    names += [f"sub/m{k}.jpg" for k in range(30)]
    for k, name in enumerate(names):
        _image(tmp / "img" / name, k)
    rows = [f"img/{n},caption {k},c{k % 3}" for k, n in enumerate(names)]
    if repeated:
        rows += ["img/a.jpg,again,c0", "img/b.jpg,b again,c1", '"img/sub/m3.jpg","q ""x""",c2']
        rows += [f"img/sub/m{k}.jpg,again {k},c1" for k in range(0, 30, 4)]
    table = tmp / "t.csv"
    lines = "".join(f"{r},{'' if i % 4 else i}\n" for i, r in enumerate(rows))  # a json field
    table.write_text("image,caption,label,extra\n" + lines, encoding="utf-8")
    return table


def _keyed_table(tmp, repeated: bool):
    """img2dataset's layout (a ``key`` column, images in the folder named like the table):
    keys listed again, and a raw key that a repeat's ~2 would take."""
    keys = [f"{k:06d}" for k in range(35)] + ["000003~2"]
    for k, key in enumerate(keys):
        _image(tmp / "k" / f"{key}.jpg", k)
    rows = [f"{key},caption {i}" for i, key in enumerate(keys)]
    if repeated:
        rows += ["000003,again", "000003,third", "000010,again"]
    table = tmp / "k.csv"
    table.write_text("key,caption\n" + "".join(r + "\n" for r in rows), encoding="utf-8")
    return table


#: The planner takes the pack's options whole (``PackOptions``), as ``pack`` hands them on.
_OPTIONS = PackOptions(
    shard_size="2KB", format="tar", seed=3, validate="none", resize_short=None, progress=False
)


def _plan(table, out, engine, shuffle, allow):
    return quiet(
        plan_pack,
        str(table),
        str(out),
        replace(_OPTIONS, shuffle=shuffle, allow_duplicates=allow),
        engine=engine,
    )


@pytest.mark.parametrize("kind", ["paths", "keyed"])
@pytest.mark.parametrize("repeated", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("allow", [False, True])
def test_a_table_planned_in_pieces_is_the_plan_of_one_process(
    tmp_path, kind, repeated, shuffle, allow
):
    table = (_paths_table if kind == "paths" else _keyed_table)(tmp_path, repeated)
    alone = _plan(table, tmp_path / "o", None, shuffle, allow)  # the same OUT: the same job
    spread = _plan(table, tmp_path / "o", Here(plan_chunk=4), shuffle, allow)
    # the driver maps the table's columns from disk: it holds none of them
    for col in (spread.scan.files, spread.scan.keys, spread.scan.inline):
        assert isinstance(col.blob, np.memmap) and isinstance(col.offsets, np.memmap)
    assert isinstance(spread.scan.labels, np.memmap)
    assert not isinstance(alone.scan.files.blob, np.memmap)
    assert spread.fingerprint == alone.fingerprint
    assert np.array_equal(spread.order, alone.order)
    assert np.array_equal(spread.starts, alone.starts)
    assert list(spread.scan.keys) == list(alone.scan.keys)
    assert len(set(spread.scan.keys)) == len(spread.scan.keys)
    assert (spread.scan.again is None) == (alone.scan.again is None)
    if alone.scan.again is not None:
        assert np.array_equal(spread.scan.again, alone.scan.again)
    assert spread.repeated == alone.repeated
    assert (len(alone.order) < len(alone.scan.files)) == (repeated and not allow)  # the rule ran
    for plan, name in ((alone, "a.plan"), (spread, "b.plan")):
        save_tasks(plan.tasks(3), str(tmp_path / name), "commit")
    assert (tmp_path / "a.plan").read_bytes() == (tmp_path / "b.plan").read_bytes()
    assert os.listdir(tmp_path / "o") == []  # the pieces are gone; the maps hold the columns


def _digest(out) -> tuple:
    m = read_manifest(str(out))
    h = hashlib.sha256(open(os.path.join(out, "manifest.json"), "rb").read())
    for e in m.shards:
        h.update(hashlib.sha256((out / e.path).read_bytes()).digest())
    return len(m.shards), h.hexdigest()


@pytest.mark.parametrize("kind", ["paths", "keyed"])
@pytest.mark.parametrize("allow", [False, True])
def test_a_table_packed_on_an_engine_in_pieces_is_the_pack_of_one_process(tmp_path, kind, allow):
    table = (_paths_table if kind == "paths" else _keyed_table)(tmp_path, True)
    kw = dict(shard_size="2KB", validate="none", allow_duplicates=allow, progress=False)
    quiet(pack, table, tmp_path / "a", **kw)
    quiet(pack, table, tmp_path / "b", **kw, runner=Here(plan_chunk=4), shards_per_task=2)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert not [n for n in os.listdir(tmp_path / "b") if n.startswith(STAGING_PREFIX)]
    again = quiet(pack, table, tmp_path / "b", **kw, runner=Here(plan_chunk=4))
    assert again.up_to_date  # the up-to-date check scans in pieces too, to the same fingerprint


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_an_interrupted_plan_in_pieces_leaves_nothing_and_its_rerun_is_the_same(tmp_path):
    table = _paths_table(tmp_path, True)
    kw = dict(shard_size="2KB", validate="none", progress=False)
    quiet(pack, table, tmp_path / "a", **kw, runner=Here(plan_chunk=4))
    out = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):  # stopped with every span's piece on disk
        quiet(pack, table, out, **kw, runner=Here(plan_chunk=4, stop_after_scan=True))
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
    # what a killed driver leaves (its pieces, under its host and pid) the next pack removes
    stale = out / f"{STAGING_PREFIX}{HOST}-{_dead_pid()}-0123456789ab"
    (stale / "000000").mkdir(parents=True)
    (stale / "000000" / "files.blob.npy").write_bytes(b"half a piece")
    quiet(pack, table, out, **kw, runner=Here(plan_chunk=4))
    assert not stale.exists()
    assert _digest(tmp_path / "a") == _digest(out)


def test_a_table_planned_in_one_process_past_its_size_says_so_once(tmp_path, monkeypatch):
    import shardkit.scan.table as table_scan

    table = _paths_table(tmp_path, False)
    monkeypatch.setattr(table_scan, "TABLE_PLAN_IN_MEMORY", 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loud = plan_pack(str(table), str(tmp_path / "o"), _OPTIONS)
    said = [w for w in caught if issubclass(w.category, table_scan.TablePlanWarning)]
    assert len(said) == 1 and len(loud.order) == 38
    text = str(said[0].message)
    assert "38 rows planned in this process" in text and "--engine local" in text
    assert "\n" not in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan_pack(
            str(table),
            str(tmp_path / "o"),
            _OPTIONS,
            engine=Here(plan_chunk=4),
        )
    assert not [w for w in caught if issubclass(w.category, table_scan.TablePlanWarning)]


def test_the_rows_whose_hashes_meet_are_found_a_bucket_at_a_time():
    """The key rule's and repeated-row check's sort of every row's hash is the driver's last
    per-row working set but the order: it sorts a sixteenth of the hashes at a time."""
    import tracemalloc

    from shardkit.scan.keys import _meeting

    rng = np.random.default_rng(5)
    n = 1 << 20
    hashes = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
    hashes[rng.integers(0, n, 5000)] = hashes[rng.integers(0, n, 5000)]
    hashes[:40] = 7
    order = np.argsort(hashes, kind="stable")
    same = hashes[order[1:]] == hashes[order[:-1]]
    mark = np.zeros(n, dtype=bool)
    mark[1:] |= same
    mark[:-1] |= same
    want = np.sort(order[mark])
    del order, same, mark
    tracemalloc.start()
    try:
        got = _meeting(hashes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got, want)
    assert peak / n < 8, peak / n  # bytes a row beside the hashes; one sort of all: ~26


def test_the_key_rule_by_buckets_is_the_rule_on_lists(monkeypatch):
    """Past its size the key rule finds shared stems and meeting keys a bucket at a time: the
    same keys as the rule on lists (stems of two spellings, names ending in ~2, repeats)."""
    from shardkit.scan import StrTable
    from shardkit.scan import keys as scan_keys

    monkeypatch.setattr(scan_keys, "MEET_BUCKETS", 2)  # buckets from 8,192 rows
    names = []
    for k in range(3000):
        names.append(f"d{k % 7}/x{k}.jpg")
        if k % 5 == 0:
            names.append(f"d{k % 7}/x{k}.png")  # a stem of two spellings
        if k % 11 == 0:
            names.append(f"d{k % 7}/x{k}~2.jpg")  # a name a repeat's ~2 would take
        if k % 13 == 0:
            names.append(f"d{k % 7}/x{k}.jpg")  # a row naming an image again
    names += [f"e/{k}.JPG" for k in range(6000)]
    assert len(names) > 8192
    exts = [n.rsplit(".", 1)[1].lower() for n in names]
    keys = scan_keys._table_keys(StrTable(names), StrTable(exts))
    assert list(keys) == scan_keys._assign_keys(names, exts)
