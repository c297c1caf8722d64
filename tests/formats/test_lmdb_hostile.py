"""Hostile inputs (issue 13): damaged LMDB pages, hostile manifests, secrets in URLs, foreign
files in the cache. Every case is a real file, a real ``lmdb`` environment or a loopback server;
every outcome must be correct data or a ``ShardkitError`` naming the file, never a signal."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import warnings

import pytest

from shardkit.errors import ShardFormatError, ShardkitError
from shardkit.formats import get_format
from shardkit.manifest import Manifest, ShardEntry, write_manifest

PAGE = 4096


def _lmdb_shard(path, n: int = 40, seed: int = 0) -> list[tuple[str, str, bytes, int]]:
    """A real LMDB shard with inline (small) and overflow-page (large) values."""
    rng = random.Random(seed)
    samples = [
        (f"c{i % 3}/k{i}", "jpg", rng.randbytes(rng.choice([30, 700, 5000])), i % 3)
        for i in range(n)
    ]
    w = get_format("lmdb").open_writer(str(path))
    for s in samples:
        w.add(*s)
    w.close()
    return samples


# --- item 7: one flipped byte in an LMDB shard -------------------------------------------------

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
    samples = _lmdb_shard(src)
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
    _lmdb_shard(src, n=400)
    data = bytearray(src.read_bytes())
    # Break a leaf page's type: the walk before opening refuses it, naming the shard.
    leaf = next(p for p in range(2, len(data) // PAGE) if data[p * PAGE + 10] == 0x02 and p > 2)
    data[leaf * PAGE + 10] = 0x01
    src.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match=r"s\.lmdb: damaged LMDB shard"):
        list(get_format("lmdb").iter_records(str(src)))


@pytest.mark.slow  # a child interpreter
def test_verify_reports_a_flipped_lmdb_shard_without_opening_it(tmp_path):
    from shardkit.verify import verify

    out = tmp_path / "ds"
    out.mkdir()
    _lmdb_shard(out / "shard-000000.lmdb")
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
        "import sys; from shardkit.verify import verify; r = verify(sys.argv[1]); "
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


# --- item 6 (LMDB half): the manifest says fewer samples than the shard holds ------------------


def test_lmdb_manifest_count_smaller_than_shard_is_an_error(tmp_path):
    from shardkit import ShardDataset

    out = tmp_path / "ds"
    out.mkdir()
    _lmdb_shard(out / "shard-000000.lmdb", n=40)
    import hashlib

    good = (out / "shard-000000.lmdb").read_bytes()
    entry = ShardEntry("shard-000000.lmdb", 30, len(good), hashlib.sha256(good).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(out))
    ds = ShardDataset(str(out), decode="raw", shuffle=False)
    assert len(ds) == 30
    with pytest.raises(
        ShardFormatError, match=r"shard-000000\.lmdb: the shard holds more samples than the 30"
    ):
        list(ds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(ShardFormatError("x"), ShardkitError)


# --- item 10: hostile manifest values -----------------------------------------------------------


def _good_doc() -> dict:
    m = Manifest("tar", ["a", "b", "c"], [ShardEntry("shard-000000.tar", 3, 4096, "ab" * 32)])
    return json.loads(m.to_json())


def _edit(doc: dict, path: list, value) -> dict:
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    "raw, message",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"version": 1, "shards": [{"path": "s.tar", "samples": 1e400}]}', "samples"),
        ('{"version": 1e400}', "version"),
        ("null", "JSON object"),
    ],
)
def test_hostile_manifest_text(tmp_path, raw, message):
    from shardkit.errors import ManifestError
    from shardkit.manifest import read_manifest

    (tmp_path / "manifest.json").write_text(raw)
    with pytest.raises(ManifestError, match=message) as info:
        read_manifest(str(tmp_path))
    assert str(tmp_path / "manifest.json") in str(info.value)


@pytest.mark.parametrize(
    "path, value, message",
    [
        (["classes"], "abc", "'classes' is 'abc', expected a list"),
        (["classes"], [1, 2], "class name is 1"),
        (["classes"], ["a\0b"], "without NUL"),
        (["shards"], {"path": "x"}, "'shards' is"),
        (["shards", 0, "path"], "sh\0ard.tar", "without NUL"),
        (["shards", 0, "path"], "sub/shard.tar", "outside the manifest's directory"),
        (["shards", 0, "path"], "..", "outside the manifest's directory"),
        (["shards", 0, "path"], "a\\b.tar", "outside the manifest's directory"),
        (["shards", 0, "path"], 7, "shard path is 7"),
        (["shards", 0, "samples"], -1, "samples is -1"),
        (["shards", 0, "samples"], 3.0, "samples is 3.0"),
        (["shards", 0, "samples"], True, "samples is True"),
        (["shards", 0, "samples"], "3", "samples is '3'"),
        (["shards", 0, "samples"], 2**80, "expected an integer"),
        (["shards", 0, "bytes"], 1e300, "bytes is 1e\\+300"),
        (["shards", 0, "sha256"], "zz" * 32, "64 hex digits"),
        (["shards", 0, "index"], "abc", "index is not a list"),
        (["skipped"], [["x"]], "skipped item"),
        (["pack"], [], "'pack' is"),
        (["num_samples"], "3", "num_samples is '3'"),
    ],
)
def test_hostile_manifest_values(tmp_path, path, value, message):
    from shardkit.errors import ManifestError
    from shardkit.manifest import read_manifest

    doc = _edit(_good_doc(), path, value)
    if path[0] == "shards" and len(path) > 1 and path[-1] == "index":
        doc["shards"][0]["index_every"] = 64
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=message) as info:
        read_manifest(str(tmp_path))
    assert str(tmp_path / "manifest.json") in str(info.value)


def test_manifest_size_is_capped_before_parsing(tmp_path, monkeypatch):
    from shardkit import manifest as manifest_mod
    from shardkit.errors import ManifestError

    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1000)
    (tmp_path / "manifest.json").write_text(" " * 5000 + json.dumps(_good_doc()))
    with pytest.raises(ManifestError, match="more than any manifest"):
        manifest_mod.read_manifest(str(tmp_path))


@pytest.mark.slow  # an HTTP server
def test_manifest_size_is_capped_for_urls_too(tmp_path, monkeypatch, http_server):
    """The one manifest reader refuses an oversized manifest over HTTP while it arrives."""
    from remote_servers import FaultProxy

    from shardkit import manifest as manifest_mod
    from shardkit.errors import ManifestError

    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1000)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "manifest.json").write_bytes(b" " * (32 << 20) + b"{}")
    http_server.root = tmp_path
    with FaultProxy(("127.0.0.1", http_server.port)) as proxy:  # counts the bytes sent
        url = f"{proxy.url}/big/manifest.json?sig=x"
        with pytest.raises(ManifestError, match="more than any manifest") as info:
            manifest_mod.read_manifest(url)
    assert "/big/manifest.json" in str(info.value)
    assert proxy.bytes_down < 8 << 20  # refused as it arrived, not after 32 MB in memory


def test_manifest_fuzz_raises_only_manifest_errors(tmp_path):
    """Random structural edits of a real manifest: each parses or raises ManifestError."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from shardkit.errors import ManifestError

    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    values = st.recursive(
        leaves,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
        max_leaves=10,
    )
    keys = st.sampled_from(
        ["version", "shards", "classes", "skipped", "pack", "num_samples", "shard_format"]
    )
    shard_keys = st.sampled_from(["path", "samples", "bytes", "sha256", "index", "index_every"])

    @settings(max_examples=300, deadline=None, database=None)
    @given(keys, shard_keys, values, st.booleans())
    def run(key, shard_key, value, in_shard):
        doc = _good_doc()
        if in_shard:
            doc["shards"][0][shard_key] = value
        else:
            doc[key] = value
        try:
            Manifest.from_json(json.dumps(doc), source="m.json")
        except ManifestError as exc:
            assert str(exc).startswith("m.json: ")

    run()


# --- item 11: credentials in URLs never shown ---------------------------------------------------

SECRET_URL = "https://alice:hunter22@example.org/ds/shard-000000.tar?X-Amz-Signature=deadbeef99"


@pytest.mark.parametrize(
    "cls",
    [
        __import__("shardkit.errors", fromlist=["x"]).__dict__[name]
        for name in __import__("shardkit.errors", fromlist=["x"]).__all__
    ],
)
def test_every_error_class_masks_urls(cls):
    exc = cls(f"{SECRET_URL}: something failed")
    for text in (str(exc), f"{exc}", f"skipped: {exc}"):
        assert "hunter22" not in text and "deadbeef99" not in text, text
        assert "example.org/ds/shard-000000.tar" in text  # the URL is still named


def test_skip_warning_masks_urls():
    from shardkit.records import Record
    from shardkit.stream import decode_records

    rec = Record("k", "jpg", b"not an image", 0, SECRET_URL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(decode_records([rec], "pil", on_error="skip")) == []
    (w,) = caught
    assert "hunter22" not in str(w.message) and "deadbeef99" not in str(w.message)
    assert "shard-000000.tar" in str(w.message)


def test_join_url_keeps_the_query_last():
    from shardkit.remote.upload import join_url, url_parent

    assert join_url("https://h/p?tok=1", "manifest.json") == "https://h/p/manifest.json?tok=1"
    assert join_url("s3://b/p/", "s.tar") == "s3://b/p/s.tar"
    assert url_parent("https://h/p/manifest.json?tok=1") == "https://h/p?tok=1"


@pytest.mark.slow  # the CLI in a child process
def test_cli_info_and_verify_mask_userinfo_and_signed_queries(tmp_path):
    """A loopback HTTP server behind URLs with credentials: nothing secret reaches the output,
    and a signed manifest URL is read as is (not with /manifest.json after its query)."""
    from remote_servers import HttpServer

    ds = tmp_path / "ds"
    ds.mkdir()
    import hashlib

    _lmdb_shard(ds / "shard-000000.lmdb")
    good = (ds / "shard-000000.lmdb").read_bytes()
    entry = ShardEntry("shard-000000.lmdb", 40, len(good), hashlib.sha256(good).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(ds))
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path))
    exe = [sys.executable, "-m", "shardkit.cli"]

    def run(*args):
        return subprocess.run([*exe, *args], env=env, capture_output=True, text=True, timeout=120)

    with HttpServer(tmp_path) as http:
        host = http.url.removeprefix("http://")
        signed = f"http://{host}/ds/manifest.json?X-Amz-Signature=deadbeef99&X-Amz-Credential=AKIAX"
        userinfo = f"http://alice:hunter22@{host}/ds/"
        outputs = []
        for url in (signed, userinfo):
            info = run("info", url)
            assert info.returncode == 0, info.stderr
            outputs.append(info.stdout + info.stderr)
            ok = run("verify", url, "-q")
            assert ok.returncode == 0 and ok.stdout.startswith("OK:"), ok.stderr
            outputs.append(ok.stdout + ok.stderr)
        assert ("GET", "/ds/manifest.json", "") in http.log.gets("manifest") or any(
            p == "/ds/manifest.json" for _, p, _ in http.log.gets("manifest")
        )
        (ds / "shard-000000.lmdb").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        bad = run("verify", userinfo, "-q")
        assert bad.returncode == 1
        outputs.append(bad.stdout + bad.stderr)
        missing = run("info", f"http://alice:hunter22@{host}/nothing/")
        assert missing.returncode != 0 and "Traceback" not in missing.stderr
        outputs.append(missing.stdout + missing.stderr)
    for text in outputs:
        assert "hunter22" not in text and "deadbeef99" not in text and "AKIAX" not in text, text
    assert f"{host}/ds/manifest.json" in outputs[0]


# --- item 12: a cache_dir shared with other files -----------------------------------------------


def _user_files(folder) -> dict[str, bytes]:
    """A user's things in the cache folder, all older than anything the cache writes."""
    files = {"notes.txt": b"mine" * 1000, ".tmp-plan.txt": b"keep", "g" * 20 + "-x": b"not hex"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        os.utime(folder / name, (1, 1))
    (folder / "subdir").mkdir()
    (folder / "subdir" / "inner.bin").write_bytes(b"x" * 5000)
    os.utime(folder / "subdir", (1, 1))
    (folder / "link").symlink_to(folder / "notes.txt")
    return files


def test_cache_evicts_only_its_own_entries(tmp_path):
    from shardkit.remote.cache import ShardCache

    cache = ShardCache(tmp_path, limit=10)
    files = _user_files(tmp_path)
    for i in range(3):
        f, _ = cache.get(f"https://h/s{i}.tar", lambda out, i=i: out.write(bytes([i]) * 100))
        f.close()
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    assert (tmp_path / "subdir" / "inner.bin").exists() and (tmp_path / "link").is_symlink()
    own = [os.path.basename(p) for _, _, p in cache.entries()]
    assert len(own) == 1 and own[0].endswith("-s2.tar")  # the last one stays, the others went
    assert cache.stats.evicted == 2


@pytest.mark.slow  # an HTTP server
def test_streaming_through_a_cache_dir_with_foreign_files(tmp_path):
    from remote_servers import HttpServer

    from shardkit import ShardDataset

    ds = tmp_path / "ds"
    ds.mkdir()
    import hashlib

    entries = []
    for i in range(3):
        name = f"shard-{i:06d}.lmdb"
        _lmdb_shard(ds / name, n=10, seed=i)
        data = (ds / name).read_bytes()
        entries.append(ShardEntry(name, 10, len(data), hashlib.sha256(data).hexdigest()))
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], entries), str(ds))
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    files = _user_files(cache_dir)
    with HttpServer(tmp_path) as http:
        got = ShardDataset(
            f"{http.url}/ds/manifest.json",
            decode="raw",
            shuffle=False,
            cache_dir=str(cache_dir),
            cache_limit=sum(e.bytes for e in entries),  # room for the shards, not the user's
        )
        assert len(list(got)) == 30
    for name, data in files.items():
        assert (cache_dir / name).read_bytes() == data
    assert (cache_dir / "subdir" / "inner.bin").exists()


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
    ds = ShardDataset(str(out), decode="raw", shuffle=False)
    with pytest.raises(SampleError, match=r"shard-000000\.lmdb: sample 'c1/b' has label 7") as info:
        list(ds)
    assert info.value.key == "c1/b" and info.value.shard.endswith("shard-000000.lmdb")
