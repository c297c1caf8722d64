"""Hostile LMDB shards: damaged pages, a manifest count smaller than the shard, a label outside
the classes. Every case is a real ``lmdb`` environment; every outcome must be correct data or a
``ShardkitError`` naming the file, never a signal."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import textwrap
import warnings

import pytest
from conftest import lmdb_shard

from shardkit import Order
from shardkit.errors import ShardFormatError, ShardkitError
from shardkit.formats import get_format
from shardkit.manifest import Manifest, ShardEntry, write_manifest

PAGE = 4096


# --- one flipped byte in an LMDB shard -------------------------------------------------

_FLIP_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from shardkit.errors import ShardkitError
    from shardkit.formats import get_format

    src, work, positions = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    data = open(src, "rb").read()
    fmt = get_format("lmdb")
    for pos in positions:
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        path = os.path.join(work, f"flip-{pos}.lmdb")
        with open(path, "wb") as f:
            f.write(damaged)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the reader runs in a child: a SIGBUS or abort() ends only the child
            os.close(r)
            try:
                got = [[x.key, x.ext, x.data.hex(), x.label] for x in fmt.iter_records(path)]
                out = {"ok": got}
            except ShardkitError as exc:
                out = {"error": type(exc).__name__, "message": str(exc)}
            except BaseException as exc:
                out = {"raw": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        chunks = []
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        os.unlink(path)
        if os.WIFSIGNALED(status):
            result = {"signal": os.WTERMSIG(status)}
        else:
            result = json.loads(b"".join(chunks) or b"{}")
        print(json.dumps([pos, result]), flush=True)
    """
)


def _flip_positions(path) -> list[int]:
    """Bytes where LMDB takes offsets, sizes and page numbers from (meta records, page headers,
    node pointers, node headers at the page end), a stride through them plus random others."""
    size = os.path.getsize(path)
    rng = random.Random(1)
    positions: set[int] = set(range(16, 16 + 136, 3)) | set(range(PAGE + 16, PAGE + 16 + 136, 5))
    for p in range(2, size // PAGE):
        base = p * PAGE
        positions.update(range(base, base + 32, 4))  # header and the first node pointers
        positions.update(rng.sample(range(base + PAGE - 256, base + PAGE), 2))
        positions.update(rng.sample(range(base, base + PAGE), 1))
    return sorted(x for x in positions if x < size)


@pytest.mark.slow  # a child interpreter (a crash must not kill the run)
def test_lmdb_byte_flips_never_kill_the_reader(tmp_path):
    src = tmp_path / "good.lmdb"
    samples = lmdb_shard(src)
    positions = _flip_positions(src)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [sys.executable, "-c", _FLIP_CHILD, str(src), str(tmp_path), json.dumps(positions)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [pos for pos, _ in results] == positions
    want = [[k, e, d.hex(), lab] for k, e, d, lab in samples]
    errors = 0
    for pos, res in results:
        assert "signal" not in res, f"flip at byte {pos}: reader killed by signal {res}"
        assert "raw" not in res, f"flip at byte {pos}: raw exception {res['raw']}"
        if "error" in res:
            errors += 1
            assert res["error"] == "ShardFormatError"
            assert str(tmp_path) in res["message"], res  # names the shard
            continue
        got = res["ok"]
        # A flip inside one stored value (its key, label or image bytes) cannot be seen without
        # the checksum; every other sample must come back intact and in order.
        assert len(got) == len(want), f"flip at byte {pos}"
        assert sum(g != w for g, w in zip(got, want, strict=True)) <= 1, f"flip at byte {pos}"
    assert errors > 20  # the flips did hit structure, not just payload


def test_lmdb_damaged_after_open_names_shard_and_sample(tmp_path):
    """A page LMDB reports as corrupt mid-stream becomes a ShardFormatError naming the sample."""
    src = tmp_path / "s.lmdb"
    lmdb_shard(src, n=400)
    data = bytearray(src.read_bytes())
    # Break a leaf page's type: the walk before opening refuses it, naming the shard.
    leaf = next(p for p in range(2, len(data) // PAGE) if data[p * PAGE + 10] == 0x02 and p > 2)
    data[leaf * PAGE + 10] = 0x01
    src.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match=r"s\.lmdb: damaged LMDB shard"):
        list(get_format("lmdb").iter_records(str(src)))


@pytest.mark.slow  # a child interpreter
def test_verify_reports_a_flipped_lmdb_shard_without_opening_it(tmp_path):
    from shardkit.write.verify import verify

    out = tmp_path / "ds"
    out.mkdir()
    lmdb_shard(out / "shard-000000.lmdb")
    stats = get_format("lmdb")  # manifest from the good file, then damage it
    import hashlib

    good = (out / "shard-000000.lmdb").read_bytes()
    entry = ShardEntry("shard-000000.lmdb", 40, len(good), hashlib.sha256(good).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(out))
    damaged = bytearray(good)
    damaged[2 * PAGE + 20] ^= 0xFF  # a node pointer of the first leaf: SIGBUS before the fix
    (out / "shard-000000.lmdb").write_bytes(bytes(damaged))
    assert stats.name == "lmdb"
    code = (
        "import sys; from shardkit.write.verify import verify; r = verify(sys.argv[1]); "
        "print(r.summary()); print(r.bad[0])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 of 1 shards" in proc.stdout
    assert "sha256 differs" in proc.stdout
    report = verify(str(out))
    assert [(b.path, b.problems) for b in report.bad] == [
        ("shard-000000.lmdb", ["sha256 differs from the manifest"])
    ]


# --- the manifest says fewer samples than the shard holds ------------------


def test_lmdb_manifest_count_smaller_than_shard_is_an_error(tmp_path):
    from shardkit import ShardDataset

    out = tmp_path / "ds"
    out.mkdir()
    lmdb_shard(out / "shard-000000.lmdb", n=40)
    import hashlib

    good = (out / "shard-000000.lmdb").read_bytes()
    entry = ShardEntry("shard-000000.lmdb", 30, len(good), hashlib.sha256(good).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(out))
    ds = ShardDataset(str(out), decode="raw", order=Order(shuffle=False))
    assert len(ds) == 30
    with pytest.raises(
        ShardFormatError, match=r"shard-000000\.lmdb: the shard holds more samples than the 30"
    ):
        list(ds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(ShardFormatError("x"), ShardkitError)


# --- a label outside the class range -----------------------------------------------------------


def test_label_outside_the_classes_is_a_sample_error(tmp_path):
    import hashlib

    from shardkit import ShardDataset
    from shardkit.errors import SampleError

    out = tmp_path / "ds"
    out.mkdir()
    w = get_format("lmdb").open_writer(str(out / "shard-000000.lmdb"))
    w.add("c0/a", "jpg", b"x", 0)
    w.add("c1/b", "jpg", b"y", 7)  # only 3 classes
    w.close()
    data = (out / "shard-000000.lmdb").read_bytes()
    entry = ShardEntry("shard-000000.lmdb", 2, len(data), hashlib.sha256(data).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(out))
    ds = ShardDataset(str(out), decode="raw", order=Order(shuffle=False))
    with pytest.raises(SampleError, match=r"shard-000000\.lmdb: sample 'c1/b' has label 7") as info:
        list(ds)
    assert info.value.key == "c1/b" and info.value.shard.endswith("shard-000000.lmdb")


def test_readers_of_one_shard_side_by_side_and_abandoned_ones_close_their_files(tmp_path):
    """A mixture or a view beside a stream reads one shard from several places at once; an
    abandoned reader collected by the garbage collector closes its descriptor."""
    import gc

    from shardkit.formats import lmdb as lmdb_format

    path = tmp_path / "a.lmdb"
    samples = lmdb_shard(path, n=30)
    gc.collect()  # what earlier tests left for the collector
    before = len(os.listdir("/proc/self/fd"))
    first = lmdb_format.iter_lmdb_records(str(path))
    second = lmdb_format.iter_lmdb_records(str(path), start=10)
    view = lmdb_format.LmdbSampleReader(str(path))
    assert next(first).key == samples[0][0] and next(second).key == samples[10][0]
    assert [view.get(i).key for i in (29, 0)] == [samples[29][0], samples[0][0]]
    assert [r.key for r in first] == [s[0] for s in samples[1:]]
    view.close()
    cycle = [second]
    cycle.append(cycle)  # only the collector frees it
    del second, cycle
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


# --- a shard that changes under an open reader; readers in forked processes ----------------------

_CHANGE_CHILD = textwrap.dedent(
    """
    import os, shutil, sys
    from shardkit import ShardView
    from shardkit.errors import ShardkitError
    from shardkit.formats import get_format

    path, other, how, what = sys.argv[1:5]
    if what == "stream":
        it = get_format("lmdb").iter_records(path)
        read = lambda i: next(it).key
    else:
        view = ShardView(os.path.dirname(path), decode="raw", with_keys=True)
        read = lambda i: view[i][2]
    print(read(0), flush=True)
    if how == "truncated":
        os.truncate(path, os.path.getsize(path) // 3)
    else:  # another shard's bytes copied over this one, in place (same inode)
        shutil.copyfile(other, path)
    try:
        print(" ".join(read(i) for i in range(1, 40)), flush=True)
    except ShardkitError as exc:
        print(type(exc).__name__, exc, flush=True)
    """
)


@pytest.mark.slow  # a child interpreter: a SIGBUS must end only the child
@pytest.mark.parametrize("how", ["truncated", "rewritten_in_place"])
@pytest.mark.parametrize("what", ["stream", "view"])
def test_an_lmdb_shard_changed_while_open_is_an_error_naming_it(tmp_path, how, what):
    out = tmp_path / "ds"
    out.mkdir()
    path = out / "shard-000000.lmdb"
    samples = lmdb_shard(path, n=40)
    good = path.read_bytes()
    import hashlib

    entry = ShardEntry(path.name, 40, len(good), hashlib.sha256(good).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(out))
    other = tmp_path / "other.lmdb"
    lmdb_shard(other, n=40, seed=1)
    w = get_format("lmdb").open_writer(str(other))  # same size class, other keys
    for i in range(40):
        w.add(f"x/other{i}", "jpg", samples[i][2], 0)
    w.close()
    proc = subprocess.run(
        [sys.executable, "-c", _CHANGE_CHILD, str(path), str(other), how, what],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        timeout=120,
    )
    assert proc.returncode == 0, f"reader ended by {proc.returncode}: {proc.stderr[-1500:]}"
    first, then = proc.stdout.splitlines()
    assert first == samples[0][0]
    assert "other" not in then  # never another shard's samples
    assert then.startswith("ShardFormatError"), then
    assert str(path) in then or f"ds/{path.name}" in then
    assert ("truncated" if how == "truncated" else "changed") in then


_FORK_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from shardkit import ShardDataset, ShardView
    from shardkit.formats import get_format

    out = sys.argv[1]
    view = ShardView(out, decode="raw", with_keys=True)
    view[0]  # a reader open in this process
    it = iter(ShardDataset(out, decode="raw", shuffle=False, with_keys=True))
    next(it)  # and a stream
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            path = os.path.join(out, "shard-000000.lmdb")
            keys = [x.key for x in get_format("lmdb").iter_records(path)]
            keys += [view[i][2] for i in range(3)]  # the inherited view, read in the child
            res = {"keys": keys}
        except BaseException as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.waitpid(pid, 0)
    print(data.decode())
    print(json.dumps([view[i][2] for i in range(3)] + [next(it)[2]]))
    """
)


@pytest.mark.slow  # a child interpreter that forks
def test_a_shard_open_in_the_parent_reads_in_forked_children(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    path = out / "shard-000000.lmdb"
    samples = lmdb_shard(path, n=12)
    import hashlib

    good = path.read_bytes()
    entry = ShardEntry(path.name, 12, len(good), hashlib.sha256(good).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(out))
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD, str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-1500:]
    child, parent = (json.loads(line) for line in proc.stdout.splitlines())
    keys = [s[0] for s in samples]
    assert child == {"keys": keys + keys[:3]}
    assert parent == keys[:3] + [keys[1]]


# --- a tree whose branch pages all name one child ----------------------------------------


def _one_child_tree(path, depth: int = 4) -> int:
    """A crafted single-file LMDB: two meta pages, then ``depth - 1`` branch pages each holding
    as many nodes as fit (2,036), every node naming the next page, and one leaf. A walk that
    follows every node visits the leaf 2036**(depth - 2) times; returns the file's pages."""
    from shardkit.formats.lmdb import btree as L

    psize, pages = PAGE, 2 + depth
    root, last = 2, pages - 1

    def meta(pgno: int, txnid: int) -> bytes:
        raw = bytearray(psize)
        L.PAGE_HDR.pack_into(raw, 0, pgno, 0, 0x08, 0, 0)
        L.META.pack_into(raw, 16, L.MAGIC, L.DATA_VERSION, 0, pages * psize)
        L.DB.pack_into(raw, 16 + 24, psize, 0, 0, 0, 0, 0, 0, 2**64 - 1)  # free DB
        L.DB.pack_into(raw, 16 + 72, 0, 0, depth, depth - 1, 1, 0, 1, root)  # main DB
        struct.pack_into("<QQ", raw, 16 + 120, last, txnid)
        return bytes(raw)

    def page(pgno: int, flags: int, child: int) -> bytes:
        raw = bytearray(psize)
        node = psize - 8
        n = (node - 16) // 2 if flags == 0x01 else 1
        L.PAGE_HDR.pack_into(raw, 0, pgno, 0, flags, 16 + 2 * n, node)
        struct.pack_into(f"<{n}H", raw, 16, *[node] * n)  # every pointer at the one node
        L.NODE.pack_into(raw, node, child & 0xFFFF, child >> 16 & 0xFFFF, child >> 32, 0)
        return bytes(raw)

    body = [meta(0, 1), meta(1, 2)]
    body += [page(p, 0x01, p + 1) for p in range(root, last)] + [page(last, 0x02, 0)]
    with open(path, "wb") as f:
        f.write(b"".join(body))
    return pages


def test_a_tree_whose_branches_all_name_one_page_is_refused_after_each_page_once(
    tmp_path, monkeypatch
):
    """Counted, not timed: each page read is counted, and the walk may read each page of the
    file once (a walk that follows every node would read the leaf 2036**2 times)."""
    from shardkit.formats.lmdb import btree as L
    from shardkit.formats.lmdb import count_lmdb_samples

    path = tmp_path / "crafted.lmdb"
    pages = _one_child_tree(path)
    assert os.path.getsize(path) == pages * PAGE
    reads = []
    real = L.read_page

    def counted(*args):
        reads.append(args[3])
        if len(reads) > 4 * pages:
            raise RuntimeError(f"the walk read {len(reads)} pages of a {pages}-page file")
        return real(*args)

    monkeypatch.setattr(L, "read_page", counted)
    with pytest.raises(ShardFormatError) as err:
        count_lmdb_samples(str(path))
    message = str(err.value)
    assert str(path) in message and "reached twice" in message and "\n" not in message
    assert len(reads) <= pages
