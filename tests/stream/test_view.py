"""ShardView: random access by index and key gives what sequential reading gives."""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from shardkit import InputError, Order, ShardDataset, ShardView, Source
from shardkit.errors import ShardFormatError
from shardkit.remote import RemoteStorage
from shardkit.write.packer import pack
from shardkit.write.writer import ShardWriter


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """The same 90 JPEGs packed as tar and as LMDB, each in several shards."""
    from conftest import image_tree

    base = tmp_path_factory.mktemp("view")
    src = image_tree(base / "src", 90, classes=4)
    tar, lmdb = str(base / "tar"), str(base / "lmdb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shards this small are warned about: wanted here
        pack(str(src), tar, shard_size="30KB", progress=False)
        pack(str(src), lmdb, format="lmdb", shard_size="60KB", progress=False)
    return tar, lmdb


def _sequential(src, **kw):
    return list(ShardDataset(src, decode="raw", with_keys=True, order=Order(shuffle=False), **kw))


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_every_sample_by_index_and_key_equals_sequential_reading(packs, fmt):
    src = packs[0] if fmt == "tar" else packs[1]
    seq = _sequential(src)
    view = ShardView(src, decode="raw", with_keys=True)
    assert len(view) == len(seq) == 90 and len(view.shards) > 1
    assert [view[i] for i in range(len(view))] == seq
    assert view[-1] == seq[-1]
    for sample in seq[::7]:
        assert view.get(sample[2]) == sample
    assert view.keys() == [s[2] for s in seq]


def test_extra_members_and_members(tmp_path):
    with ShardWriter(str(tmp_path / "d"), shard_size="1MB") as w:
        for i in range(6):
            w.add(f"k{i}", "jpg", b"x%d" % i, i % 2, extra={"json": b"{}"} if i % 2 else None)
    view = ShardView(str(tmp_path / "d"), decode="raw", with_keys=True, fields=("json",))
    seq = _sequential(str(tmp_path / "d"), fields=("json",))
    assert [view[i] for i in range(6)] == seq and seq[1][3] == b"{}" and seq[0][3] is None
    assert dict(view.members(1)) == {"jpg": b"x1", "cls": b"1", "json": b"{}"}


def test_decoded_like_the_dataset(packs):
    tar, _ = packs
    view = ShardView(tar, decode="tensor")
    image, label = view[5]
    first = list(ShardDataset(tar, decode="tensor", order=Order(shuffle=False)))[5]
    assert torch.equal(image, first[0]) and label == first[1]


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_bad_index_or_unknown_key_is_a_clear_error(packs, fmt):
    src = packs[0] if fmt == "tar" else packs[1]
    view = ShardView(src, decode="raw")
    with pytest.raises(IndexError, match=r"sample 90 is out of range: .* holds 90 \(0\.\.89\)"):
        view[90]
    with pytest.raises(IndexError, match="out of range"):
        view[-91]
    with pytest.raises(TypeError, match="int"):
        view["class0/img000"]
    with pytest.raises(InputError, match="no sample with key 'nope'.*shardkit ls"):
        view.get("nope")


def test_a_changed_shard_is_named(tmp_path):
    with ShardWriter(str(tmp_path / "d"), shard_size="1MB") as w:
        for i in range(5):
            w.add(f"k{i}", "jpg", b"x" * 100, 0)
    view = ShardView(str(tmp_path / "d"), decode="raw")
    shard = next((tmp_path / "d").glob("*.tar"))
    data = bytearray(shard.read_bytes())
    data[:2048] = data[1024:3072]  # sample 0's place now holds sample 1's members
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match="not where the index says|shard-000000"):
        view[0]


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_dataloader_with_distributed_sampler_covers_every_sample_once(packs, fmt):
    src = packs[0] if fmt == "tar" else packs[1]
    view = ShardView(src, decode="tensor", with_keys=True)
    keys = []
    for rank in range(2):
        sampler = DistributedSampler(view, num_replicas=2, rank=rank, shuffle=True, seed=1)
        loader = DataLoader(view, batch_size=8, sampler=sampler, num_workers=2)
        for _, _, batch_keys in loader:
            keys += list(batch_keys)
    assert sorted(keys) == sorted(view.keys())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_view_over_s3_equals_sequential_reading_with_one_ranged_get_per_tar_sample(packs, s3, fmt):
    pytest.importorskip("s3fs")
    from remote_servers import S3Server

    src = packs[0] if fmt == "tar" else packs[1]
    bucket = f"view-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(bucket, fmt, Path(src))
    url, opts = f"s3://{bucket}/{fmt}/", S3Server.options(s3.endpoint)
    seq = _sequential(src)
    view = ShardView(url, decode="raw", with_keys=True, storage=RemoteStorage(opts))
    s3.log.clear()
    got = [view[i] for i in range(len(view))]
    assert [(d, lab) for d, lab, _ in got] == [(d, lab) for d, lab, _ in seq]
    assert [k for *_, k in got] == [k for *_, k in seq]
    assert view.get(seq[11][2])[2] == seq[11][2]
    if fmt == "tar":
        gets = [e for e in s3.log.entries if e[0] == "GET" and e[1].endswith(".tar")]
        assert len(gets) == len(view) + 1 and all(e[2].startswith("bytes=") for e in gets)


# --- LMDB shards that change under a view ----------------------------------------------------


def _lmdb_pack(out: Path, prefix: str, n: int = 20) -> None:
    """One LMDB shard of ``n`` samples keyed ``<prefix>/k000``..., each with a caption."""
    with ShardWriter(str(out), shard_size="1GB", format="lmdb") as w:
        for i in range(n):
            w.add(
                f"{prefix}/k{i:03d}",
                "jpg",
                b"%s-%d" % (prefix.encode(), i),
                i % 2,
                extra={"txt": b"caption %d" % i},
            )


@pytest.mark.parametrize("how", ["renamed_over", "rewritten_in_place", "kept_open"])
def test_an_lmdb_shard_changed_under_a_view_never_gives_other_samples(tmp_path, how):
    """Re-packed and renamed over the shard, or copied over it in place: the view refuses the
    shard by name; a shard the view already holds open keeps giving its own samples."""
    _lmdb_pack(tmp_path / "d", "old")
    _lmdb_pack(tmp_path / "new", "new", n=25)
    view = ShardView(str(tmp_path / "d"), decode="raw", with_keys=True)
    if how == "kept_open":
        assert view[3][2] == "old/k003"
    shard = next((tmp_path / "d").glob("*.lmdb"))
    fresh = next((tmp_path / "new").glob("*.lmdb"))
    if how == "rewritten_in_place":
        shard.write_bytes(fresh.read_bytes())  # same inode, other bytes
    else:
        fresh.rename(shard)
    if how == "kept_open":
        assert view.get("old/k017") == (b"old-17", 1, "old/k017")
        assert view[5][2] == "old/k005"
        return
    for ask in (lambda: view[5], lambda: view.get("old/k017")):
        with pytest.raises(ShardFormatError, match=rf"{shard.name}: .*(replaced or rewritten)"):
            ask()


def test_an_lmdb_sample_whose_key_is_not_the_indexed_one_is_refused(tmp_path, monkeypatch):
    """Should the identity not tell (a copy made in the same tick, a remote shard re-fetched),
    the key stored with the sample is checked against the index."""
    _lmdb_pack(tmp_path / "d", "a")
    view = ShardView(str(tmp_path / "d"), decode="raw", with_keys=True)
    table = view._table(0)
    table._keys = table.keys()
    table._keys[4] = "a/k009"  # as if the index had been made from another shard
    with pytest.raises(ShardFormatError, match=r"shard-000000\.lmdb: sample 4 is not where"):
        view[4]


def test_lmdb_members_include_every_field_as_tar_lists_them(tmp_path):
    for fmt in ("tar", "lmdb"):
        with ShardWriter(str(tmp_path / fmt), shard_size="1GB", format=fmt) as w:
            w.add(
                "a", "jpg", b"img-a", 1, extra={"json": b'{"x": 1}', "txt": b"cap"}
            )  # name order, as pack
            w.add("b", "jpg", b"img-b", -1, extra={"txt": b"only"})
    got = {
        fmt: [ShardView(str(tmp_path / fmt)).members(i) for i in (0, 1)] for fmt in ("tar", "lmdb")
    }
    assert got["lmdb"] == got["tar"]
    assert got["lmdb"][0] == [
        ("jpg", b"img-a"),
        ("cls", b"1"),
        ("json", b'{"x": 1}'),
        ("txt", b"cap"),
    ]
    assert got["lmdb"][1] == [("jpg", b"img-b"), ("txt", b"only")]


# --- some members of a sample: their byte ranges alone -----------------------------------------


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    """30 samples of a 20 kB image and a short caption each, in three tar shards."""
    out = tmp_path_factory.mktemp("captioned") / "d"
    with ShardWriter(str(out), shard_size="220kB", classes=["a", "b"]) as w:
        for i in range(30):
            image = b"\xff\xd8" + bytes([i]) * 20_000
            w.add(f"s/k{i:02d}", "jpg", image, i % 2, extra={"txt": b"caption %d" % i})
    return str(out)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts reads through /proc")
def test_members_by_name_read_their_sample_once_checked(captioned, tmp_path):
    """With sample digests, a member is handed out only once its sample's bytes are checked:
    the sample's range is read whole (one read), never a member alone."""
    import os

    from conftest import as_previous_release

    view = ShardView(captioned)
    assert len(view.shards) > 2 and len(view.keys()) == 30  # each shard's index read once
    before = _rchar()
    got = [view.members(i, ("txt",)) for i in range(30)]
    read = _rchar() - before
    assert got == [[("txt", b"caption %d" % i)] for i in range(30)]
    assert 30 * 20_000 < read <= 30 * (22_000 + 512 + 1024) + 1024  # each sample once (+ /proc)
    assert view.members(3, ["TXT", "cls"]) == [("cls", b"1"), ("txt", b"caption 3")]
    assert view.members(3, ()) == [] and len(view.members(3)) == 3
    old = tmp_path / "old"  # packed by the previous release: version-1 indexes
    os.makedirs(old)
    for n in os.listdir(captioned):
        with open(os.path.join(captioned, n), "rb") as a, open(old / n, "wb") as b:
            b.write(a.read())
    as_previous_release(old)
    view_v1 = ShardView(str(old))
    before = _rchar()
    with pytest.warns(RuntimeWarning, match="no per-sample digests"):
        assert [view_v1.members(i, ("txt",)) for i in range(30)] == got  # unchecked: said once
    assert _rchar() - before > 30 * 20_000
    assert [view_v1.summary(i) for i in range(30)] == [view.summary(i) for i in range(30)]


@pytest.mark.slow
def test_members_by_name_over_s3_are_one_ranged_get_of_their_sample_each(captioned, s3):
    pytest.importorskip("s3fs")
    from remote_servers import S3Server

    bucket = f"members-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(bucket, "d", Path(captioned))
    view = ShardView(f"s3://{bucket}/d/", storage=RemoteStorage(S3Server.options(s3.endpoint)))
    view.members(0, ("txt",))
    s3.log.clear()
    assert view.members(7, ("txt",)) == [("txt", b"caption 7")]
    (get,) = [e for e in s3.log.entries if e[0] == "GET"]  # the index was read before
    lo, hi = (int(x) for x in get[2].removeprefix("bytes=").split("-"))
    offsets = view._table(0).offsets  # the sample's range: what its digest covers
    assert get[1].endswith("shard-000000.tar") and (lo, hi + 1) == (offsets[7], offsets[8])


def test_members_by_name_of_a_shard_changed_under_the_view_are_refused(tmp_path):
    out = tmp_path / "d"
    with ShardWriter(str(out), shard_size="30kB") as w:
        for i in range(6):
            w.add(f"k{i}", "jpg", b"\xff\xd8" + bytes(10_000), 0, extra={"txt": b"caption %d" % i})
    view = ShardView(str(out))
    assert len(view.shards) > 1 and view.members(0, ("txt",)) == [("txt", b"caption 0")]
    view.close()
    (out / "shard-000001.tar").replace(out / "shard-000000.tar")  # other samples, same layout
    with pytest.raises(ShardFormatError, match=r"shard-000000\.tar: sample 0 \(key 'k0'\) is not"):
        view.members(0, ("txt",))


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_lookup_by_key_loads_one_index_and_a_missing_key_none(packs, fmt, monkeypatch):
    import shardkit.stream.view as view_mod

    src = packs[0] if fmt == "tar" else packs[1]
    keys = ShardView(src, decode="raw").keys()
    loads = []  # the shards whose index (keys, byte ranges) a view loads and holds
    real = view_mod.ShardView._index
    monkeypatch.setattr(view_mod.ShardView, "_index", lambda v, s: loads.append(s) or real(v, s))
    view = ShardView(src, decode="raw", with_keys=True)
    assert len(view.shards) > 2
    for _ in range(3):
        with pytest.raises(InputError, match="no sample with key 'nope'"):
            view.get("nope")
    # a missing key: no hash of it in the key file's checked blocks (its hashes were the
    # keys' when written): called missing at once, no shard's index loaded
    assert len(loads) == 0 and len(view._tables) == 0
    loads.clear()
    last = keys[-1]
    assert view.get(last)[2] == last and len(loads) == 1  # one index: the shard holding it
    for i, k in enumerate(keys):
        assert view.index(k) == i
    assert len(loads) == len(view.shards)  # each index once, on its first key


def test_a_lookup_confirms_the_hash_by_the_key_and_finds_the_first_of_twins(tmp_path, monkeypatch):
    import shardkit.stream.view as view_mod

    with warnings.catch_warnings(), ShardWriter(str(tmp_path / "d"), shard_size="1kB") as w:
        warnings.simplefilter("ignore")  # a shard per sample: warned about, wanted here
        for i in range(5):
            w.add(f"k{i % 3}", "jpg", b"x%d" % i, i)
    view = ShardView(str(tmp_path / "d"), decode="raw", with_keys=True)
    assert len(view.shards) == 5
    assert [view.index(k) for k in ("k0", "k1", "k2", "k0")] == [0, 1, 2, 0]  # the first twin
    real = view_mod.key_hashes  # a 64-bit collision: "k9" hashes as "k1" does
    monkeypatch.setattr(
        view_mod, "key_hashes", lambda keys: real(["k1" if k == "k9" else k for k in keys])
    )
    for fresh in (False, True):  # the sorted table, then the first lookup's walk
        view = ShardView(str(tmp_path / "d"), decode="raw") if fresh else view
        with pytest.raises(InputError, match="no sample with key 'k9'"):
            view.index("k9")


# --- a view takes the groups ShardDataset takes: Source, Decode, storage ------------------------


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
@pytest.mark.parametrize("split", ["val", "train"])
def test_a_view_of_a_split_holds_the_samples_the_dataset_streams(packs, fmt, split):
    src = packs[0] if fmt == "tar" else packs[1]
    source = Source(src, split=split, val_fraction=0.3)
    streamed = _sequential(source)
    view = ShardView(source, decode="raw", with_keys=True)
    every = ShardView(src, decode="raw", with_keys=True).keys()
    assert 0 < len(view) == len(streamed) < 90
    assert sorted(view[i] for i in range(len(view))) == sorted(streamed)
    assert view.keys() == [k for k in every if k in set(view.keys())]  # packed order
    for i in (0, len(view) // 2, -1):
        key = view.key(i)
        assert view[i][2] == key and view.index(key) == i % len(view) and view.get(key) == view[i]
    other = next(k for k in every if k not in set(view.keys()))
    with pytest.raises(InputError, match=f"no sample with key '{other}'.*not in the selection"):
        view.get(other)


def test_a_view_of_a_subset_holds_the_dataset_s_subset(packs):
    tar = packs[0]
    every = ShardView(tar, decode="raw").keys()
    view = ShardView(Source(tar, subset=[every[40], every[3]]), decode="raw", with_keys=True)
    assert view.keys() == [every[3], every[40]] and view[1][2] == every[40]
    drawn = ShardView(Source(tar, subset=0.2), decode="raw", with_keys=True)  # seed 0's draw
    streamed = _sequential(Source(tar, subset=0.2))
    assert len(drawn) == 18 and set(drawn.keys()) == {s[2] for s in streamed}
    assert ShardView(Source(tar), decode="raw").keys() == every


def test_what_a_view_cannot_honour_is_refused_by_name(packs):
    tar = packs[0]
    with pytest.raises(InputError, match=r"weight=0\.5\).*a view reads one: leave weight out"):
        ShardView(Source(tar, weight=0.5))
    with pytest.raises(InputError, match="reads one source.*view_a \\+ view_b"):
        ShardView([Source(tar), Source(packs[1])])
    with pytest.raises(InputError, match="leaves out the view's field 'txt'"):
        ShardView(Source(tar, fields=()), fields=("txt",))
    opts = {"anon": True}
    with pytest.raises(InputError, match="give them in one place"):
        ShardView(Source(tar, storage_options=opts), storage=RemoteStorage(opts))
    with pytest.raises(TypeError, match="unknown keyword shuffle="):
        ShardView(tar, shuffle=False)


def test_the_loose_storage_keywords_are_retired_spellings_of_remote_storage(packs, tmp_path):
    tar = packs[0]
    new = ShardView(tar, decode="raw", storage=RemoteStorage(cache_dir=str(tmp_path)))
    with pytest.warns(FutureWarning, match=r"write ShardView\(storage=RemoteStorage\(cache_dir="):
        old = ShardView(tar, decode="raw", cache_dir=str(tmp_path))
    assert [old[i] for i in range(90)] == [new[i] for i in range(90)]
    with pytest.warns(FutureWarning, match=r"storage=RemoteStorage\(storage_options=\{\}\)"):
        ShardView(tar, storage_options={})
    with pytest.raises(InputError, match="give only storage="):
        ShardView(tar, storage=RemoteStorage(), cache_dir=str(tmp_path))


def test_the_retired_spelling_s_warning_masks_the_credentials(packs):
    opts = {"key": "AKIAFAKEFAKE12345678", "secret": "fAkEsEcReT/0123456789abcdef"}
    with pytest.warns(FutureWarning) as caught:
        ShardView(packs[0], storage_options=opts)
    text = str(caught[0].message)
    assert "storage=RemoteStorage(storage_options=" in text and opts["secret"] not in text


# --- random access in bounded memory ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_view_holds_indexes_within_its_budget_and_closes_what_it_lets_go(packs, fmt):
    from shardkit import ViewCache

    src = packs[0] if fmt == "tar" else packs[1]
    seq = _sequential(src)
    view = ShardView(src, decode="raw", with_keys=True, cache=ViewCache(indexes=0))
    assert len(view.shards) > 2 and ViewCache(indexes="2kB").indexes == 2000
    rng = __import__("random").Random(0)
    for i in rng.sample(range(90), 90):
        assert view[i] == seq[i]
        assert view.get(seq[i][2]) == seq[i]
        assert len(view._tables) == 1 and len(view._open) <= 1  # over budget: the last alone
    whole = ShardView(src, decode="raw", cache=ViewCache())
    for i in range(90):
        whole[i]
    assert len(whole._tables) == len(whole.shards) == len(whole._open)  # within 64 MiB: all
    with pytest.raises(InputError, match="indexes"):
        ViewCache(indexes=-1)
    with pytest.raises(InputError, match="give a shardkit.ViewCache"):
        ShardView(src, cache=64)


def _copy(src, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_lookups_read_the_dataset_s_key_file_and_write_nothing_outside_the_paths_given(
    packs, tmp_path, monkeypatch
):
    import shardkit.stream.view as view_mod

    home, tmp = tmp_path / "home", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    for name in ("XDG_CACHE_HOME", "SHARDKIT_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    columns = []
    real = view_mod.ShardView._stored_hashes
    monkeypatch.setattr(
        view_mod.ShardView, "_stored_hashes", lambda v, k: columns.append(k) or real(v, k)
    )
    for src in packs:
        before = sorted(os.listdir(src))
        assert "manifest.keys" in before
        keys = [ShardView(src).key(i) for i in range(90)]
        view = ShardView(src, decode="raw", with_keys=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback, no warning
            for i in (7, 89, 0, 50):
                assert view.index(keys[i]) == i
            assert view.get(keys[33])[2] == keys[33]
        assert not home.exists() and os.listdir(tmp) == []  # no cache: nothing written
        assert columns == [] and view._keyfile is None  # no hash column read, nothing built
        assert len(view._tables) <= 5  # the shards asked about, no other
        assert sorted(os.listdir(src)) == before


def test_the_key_file_follows_the_dataset_as_it_grows_by_append_and_merge(tmp_path):
    from conftest import image_tree

    from shardkit.write.merge import merge

    out, other = str(tmp_path / "out"), str(tmp_path / "other")
    pack(str(image_tree(tmp_path / "a", 12)), out, progress=False)
    before = ShardView(out)
    assert before.index(before.key(3)) == 3
    for name, where in (("b", out), ("c", other)):
        more = image_tree(tmp_path / name, 6)
        for f in more.rglob("*.jpg"):
            f.rename(f.with_name(f"{name}-" + f.name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pack(str(more), where, progress=False, append=where == out)
    after = ShardView(out)
    assert len(after) == 18 and all(after.index(after.key(i)) == i for i in range(18))
    assert after._keyfile is None and after._dataset_keys
    val = ShardView(Source(out, split="val", val_fraction=0.5))  # its manifest read when asked
    assert len(val) < 18 and all(val.index(val.key(i)) == i for i in range(len(val)))
    assert val._keyfile is None and val._dataset_keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merge([out, other], str(tmp_path / "merged"))
    merged = ShardView(str(tmp_path / "merged"))
    assert len(merged) == 24 and all(merged.index(merged.key(i)) == i for i in range(24))
    assert merged._keyfile is None and merged._dataset_keys


def test_a_forged_or_stale_key_file_costs_a_search_never_a_wrong_sample(packs, tmp_path):
    import hashlib
    import json

    import numpy as np

    from shardkit.formats.key_file import HEAD, block_table, key_file_sha256

    tar = _copy(packs[0], tmp_path / "tar")
    keys = ShardView(tar).keys()
    path = os.path.join(tar, "manifest.keys")
    data = bytearray(open(path, "rb").read())
    n = len(keys)
    shards = np.frombuffer(bytes(data[HEAD + 8 * n : HEAD + 12 * n]), "<u4")
    wrong = (shards.max() - shards).astype("<u4")
    data[HEAD + 8 * n : HEAD + 12 * n] = wrong.tobytes()  # wrong shards
    open(path, "wb").write(bytes(data))
    view = ShardView(tar, decode="raw", with_keys=True)
    with pytest.warns(RuntimeWarning, match=r"manifest.keys: its block 0 .* is not its digest"):
        assert view.index(keys[40]) == 40  # the block read fails its digest: a table
    assert [view.index(k) for k in keys] == list(range(n))
    assert view.get(keys[5])[2] == keys[5]

    manifest = os.path.join(tar, "manifest.json")  # forged together with the manifest
    doc = json.load(open(manifest))
    hashes = np.frombuffer(bytes(data[HEAD : HEAD + 8 * n]), "<u8")
    table = block_table(hashes, wrong)  # its block table forged too
    data[HEAD + 12 * n :] = table
    open(path, "wb").write(bytes(data))
    doc["keys"]["sha256"] = key_file_sha256(path, n)
    doc["keys"]["blocks_sha256"] = hashlib.sha256(table).hexdigest()
    open(manifest, "w").write(json.dumps(doc))
    view = ShardView(tar, decode="raw", with_keys=True)
    assert [view.index(k) for k in keys] == list(range(n))  # a miss: the shards' columns
    assert view.get(keys[77])[2] == keys[77]

    open(path, "wb").write(bytes(data[: HEAD + 8 * n]))  # cut short: never mapped
    with pytest.warns(RuntimeWarning, match="manifest.keys: not the"):
        view = ShardView(tar, decode="raw", with_keys=True)
        assert view.index(keys[12]) == 12
    os.unlink(path)  # gone: a private table, with a warning saying how to get one back
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert ShardView(tar, decode="raw").index(keys[3]) == 3
    del doc["keys"]  # a pack made before key files: the warning says how to get one
    open(manifest, "w").write(json.dumps(doc))
    with pytest.warns(RuntimeWarning, match="no key file .* re-pack it, or grow it"):
        assert ShardView(tar, decode="raw").index(keys[4]) == 4


def test_a_dataset_no_manifest_vouches_for_gets_a_private_key_table_forked_workers_read(tmp_path):
    with ShardWriter(str(tmp_path / "d"), shard_size="1MB") as w:
        for i in range(6):
            w.add(f"k{i}", "jpg", b"x%d" % i, 0)
    (tmp_path / "d" / "manifest.json").unlink()  # a glob of tars: nothing vouches for them
    view = ShardView(str(tmp_path / "d" / "*.tar"), decode="raw", with_keys=True)
    assert view.index("k4") == 4 and view._keyfile.private
    assert not os.path.exists(view._keyfile.path)  # unlinked: this view's alone

    loader = DataLoader(_Gets(view), batch_size=None, num_workers=2)
    assert sorted(int(i) for i in loader) == list(range(6))  # forked: the inherited file


class _Gets(torch.utils.data.Dataset):
    def __init__(self, view):
        self.view = view

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.view.index(f"k{i}")
