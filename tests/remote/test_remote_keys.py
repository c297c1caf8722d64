"""A URL dataset's key file (``manifest.keys``) over moto S3 on loopback: a pack to a URL
writes and uploads it before the manifest that lists it, and a remote split reads its counts
from it by ranged GETs, so a rank GETs only the indexes of the shards its plan reaches; a key
file that does not serve is named, and the split reads every index as before."""

from __future__ import annotations

import os
import tarfile
import uuid
import warnings

import pytest
from conftest import ranged_pack
from remote_servers import S3Server

from shardkit import Order, pack
from shardkit.errors import InputError, StorageError
from shardkit.formats.key_file import HEAD, KEYS_NAME, read_at
from shardkit.formats.sample_index import columns_size
from shardkit.manifest import read_manifest
from shardkit.remote import RemoteStorage
from shardkit.remote.ranged import RangedFile
from shardkit.stream import indexes
from shardkit.stream.dataset import ShardDataset
from shardkit.stream.mix import Source
from shardkit.stream.view import ShardView

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytestmark = [pytest.mark.slow]  # real servers on loopback

WORLD = 8


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """240 samples in ~48 small tar shards (with indexes and a key file), packed locally."""
    root = ranged_pack(tmp_path_factory.mktemp("urlkeys"), 240, "8kB")
    assert len(read_manifest(str(root / "tar")).shards) >= 40
    return root


def _bucket(s3, folder) -> str:
    name = f"keys-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(name, "tar", folder)
    return name


def _ds(where, opts=None, rank=0, world_size=1, cache_dir=None, **kw) -> ShardDataset:
    storage = RemoteStorage(opts, prefetch=0, cache_dir=cache_dir) if opts is not None else None
    return ShardDataset(
        Source(where, **kw),
        decode="raw",
        with_keys=True,
        storage=storage,
        order=Order(shuffle=False),
        rank=rank,
        world_size=world_size,
    )


def _keys(ds) -> list[str]:
    return [s[2] for s in ds]


def _held(url: str) -> list:
    """The heads of ``url``'s shards a split holds for its reader (``indexes._HELD``)."""
    return [k for k in indexes._HELD if k[0].startswith(url)]


def _idx_gets(s3) -> int:
    return len(s3.log.gets(".tar.idx"))


def test_a_pack_to_a_url_uploads_its_key_file_before_the_manifest(s3, packed, tmp_path):
    b = f"pack-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=b)
    s3.log.clear()
    opts = S3Server.options(s3.endpoint)
    pack(
        str(packed / "src"),
        f"s3://{b}/ds/",
        shard_size="8kB",
        storage_options=opts,
        progress=False,
        work_dir=str(tmp_path),
    )
    puts = [p for m, p, _ in s3.log.entries if m == "PUT" and "/ds/" in p]
    assert f"/{b}/ds/{KEYS_NAME}" in puts and puts[-1] == f"/{b}/ds/manifest.json"
    remote = read_manifest(f"s3://{b}/ds/", storage_options=opts)
    local = read_manifest(str(packed / "tar"))
    assert remote.keys == local.keys and "blocks_sha256" in remote.keys  # the same bytes
    body = s3.client().get_object(Bucket=b, Key=f"ds/{KEYS_NAME}")["Body"].read()
    assert body == (packed / "tar" / KEYS_NAME).read_bytes()
    assert os.listdir(tmp_path) == []  # the local staging copy is gone
    s3.log.clear()
    for split in ("train", "val"):  # read from it: the epoch of the local pack
        ds = _ds(f"s3://{b}/ds/", opts, split=split, val_fraction=0.1)
        assert _keys(ds) == _keys(_ds(str(packed / "tar"), split=split, val_fraction=0.1))
    assert s3.log.gets(KEYS_NAME)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_remote_split_rank_gets_only_the_indexes_its_plan_reaches(s3, packed, split):
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    local = str(packed / "tar")
    s3.log.clear()
    whole = _ds(url, opts, split=split, val_fraction=0.25)
    one = _idx_gets(s3)  # world size 1, construction: none yet; its epoch: every shard's
    assert _keys(whole) == _keys(_ds(local, split=split, val_fraction=0.25))
    world1 = _idx_gets(s3)
    assert one == 0 and world1 >= 40
    s3.log.clear()
    ds = _ds(url, opts, rank=0, world_size=WORLD, split=split, val_fraction=0.25)
    built = _idx_gets(s3)
    got = _keys(ds)
    rank0 = _idx_gets(s3)
    assert not _held(url)  # each head held for its reader was taken, or let go (streamed)
    # an eighth of world size 1's, plus the shards at its part's two ends (each shard's index
    # head GET once as the epoch reaches it: its split sides, then its samples' ranges read
    # through the same checked head)
    assert built == 0 and rank0 <= world1 / WORLD + 2, (built, rank0, world1)
    gets = [p for _, p, _ in s3.log.gets(KEYS_NAME)]
    assert 1 <= len(gets) <= 3  # head (with the small file's columns) and its block table
    kw = {"world_size": WORLD, "split": split, "val_fraction": 0.25}
    for rank in range(WORLD):  # every rank's epoch is the local pack's
        mine = got if rank == 0 else _keys(_ds(url, opts, rank=rank, **kw))
        assert mine == _keys(_ds(local, rank=rank, **kw))


@pytest.mark.parametrize(
    "kw",
    [
        {"split": "val", "val_fraction": 0.25},
        {"split": "val", "val_fraction": 0.25, "subset": 0.5},
        {"subset": 0.3},
    ],
    ids=["val", "val-subset", "subset"],
)
@pytest.mark.parametrize("cached", [False, True], ids=["", "cache_dir"])
def test_a_remote_epoch_gets_each_reached_index_once(s3, packed, tmp_path, kw, cached):
    """The head a split reads for a shard's sides (checked against the manifest's
    ``columns_sha256``) is the one its samples' ranges are read through: one GET of each
    reached shard's index an epoch, at rank 0 of 8 and at world size 1, with or without a
    ``cache_dir`` (which holds shards, never index heads); the epochs are the local pack's."""
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    cache = str(tmp_path / "cache") if cached else None
    for rank, world in ((0, WORLD), (0, 1)):
        s3.log.clear()
        ds = _ds(url, opts, rank, world, cache, **kw)
        got = _keys(ds)
        paths = [p for _, p, _ in s3.log.gets(".tar.idx")]
        assert got == _keys(_ds(str(packed / "tar"), None, rank, world, **kw))
        assert paths and len(paths) == len(set(paths)), (world, sorted(paths))
        assert not _held(url)  # none held past the epoch


def test_a_remote_head_that_fails_its_check_is_never_held_for_the_reader(s3, packed):
    """A head whose bytes are not the manifest's (a digest flipped: neither its
    ``columns_sha256`` nor the file's ``index_sha256``) is named, the split takes the shard's
    keys from its headers and the reader streams it, checked whole: never a held head."""
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    want = _keys(_ds(str(packed / "tar"), split="val", val_fraction=0.25))
    shards = read_manifest(str(packed / "tar")).shards
    shard = next(s for s in shards if _holds(packed / "tar" / s.path, want[0]))
    name = f"tar/{shard.path}.idx"
    body = bytearray(s3.client().get_object(Bucket=b, Key=name)["Body"].read())
    body[columns_size(shard.samples) - 1] ^= 0x01  # its last sample's digest
    s3.client().put_object(Bucket=b, Key=name, Body=bytes(body))
    with pytest.warns(RuntimeWarning, match=rf"{name}: .*sample index"):
        got = _keys(_ds(url, opts, split="val", val_fraction=0.25))
    assert got == want
    assert not _held(url)


def _holds(path, key: str) -> bool:
    with tarfile.open(path) as tar:
        return any(n.startswith(key + ".") for n in tar.getnames())


def test_a_flipped_byte_in_the_remote_key_file_is_named_and_the_epoch_stays_right(s3, packed):
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    body = bytearray((packed / "tar" / KEYS_NAME).read_bytes())
    body[HEAD + 8] ^= 0x01  # the second hash: the first block, which every split reads
    s3.client().put_object(Bucket=b, Key=f"tar/{KEYS_NAME}", Body=bytes(body))
    want = _keys(_ds(str(packed / "tar"), rank=1, world_size=WORLD, split="val"))
    with pytest.warns(RuntimeWarning, match=rf"{url}{KEYS_NAME}: its block 0 .* digest"):
        ds = _ds(url, opts, rank=1, world_size=WORLD, split="val")
    assert _keys(ds) == want
    s3.client().delete_object(Bucket=b, Key=f"tar/{KEYS_NAME}")  # gone: named too
    with pytest.warns(RuntimeWarning, match=rf"{url}{KEYS_NAME}: unreadable .*no such object"):
        ds = _ds(url, opts, rank=1, world_size=WORLD, split="val")
    assert _keys(ds) == want


def test_a_store_failing_on_the_key_file_is_one_storage_error_naming_it(s3, packed):
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    storage = RemoteStorage(opts, prefetch=0, retries=1)
    s3.faults.set(None, 503, contains=KEYS_NAME)
    with pytest.raises(StorageError) as err:
        ShardDataset(Source(url, split="val"), decode="raw", storage=storage)
    assert f"{url}{KEYS_NAME}" in str(err.value) and "\n" not in str(err.value)


def test_a_ranged_file_reads_like_pread_by_windows(s3, packed):
    b = _bucket(s3, packed / "tar")
    opts = S3Server.options(s3.endpoint)
    data = (packed / "tar" / KEYS_NAME).read_bytes()
    url = f"s3://{b}/tar/{KEYS_NAME}"
    f = RangedFile(url, RemoteStorage(opts, prefetch=0), len(data), window=256)
    assert read_at(f, HEAD, 0) == data[:HEAD]
    assert read_at(f, 8, 200) == data[200:208] and f.gets == 1  # within the first window
    assert read_at(f, 16, len(data) - 16) == data[-16:] and f.gets == 2
    assert read_at(f, 8, 100) == data[100:108] and f.gets == 2  # both windows held
    with pytest.raises(OSError, match="cut short"):
        read_at(RangedFile(url, RemoteStorage(opts, prefetch=0), len(data) + 8), 16, len(data) - 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FileNotFoundError, match="no such object"):
            RangedFile(url + ".gone", RemoteStorage(opts, prefetch=0), 100).pread(8, 0)


def test_verify_url_checks_the_key_file_its_manifest_lists(s3, packed, tmp_path):
    """``verify URL`` fetches the key file and checks it as a local one's (its size, sha256,
    head, block table, and each shard's hashes in it those of the shard's keys), naming it and
    the fix; nothing is left in ``work_dir``."""
    from shardkit.write.verify import verify

    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    report = verify(url, storage_options=opts, work_dir=str(tmp_path))
    assert report.ok and report.key_file is None
    body = bytearray((packed / "tar" / KEYS_NAME).read_bytes())
    body[HEAD + 8] ^= 0x01
    s3.client().put_object(Bucket=b, Key=f"tar/{KEYS_NAME}", Body=bytes(body))
    report = verify(url, storage_options=opts, work_dir=str(tmp_path))
    (said,) = report.key_file.problems
    assert report.key_file.path == KEYS_NAME and not report.ok
    assert "sha256 is not the manifest's" in said and f"{url}{KEYS_NAME}, or pack" in said
    s3.client().delete_object(Bucket=b, Key=f"tar/{KEYS_NAME}")
    report = verify(url, storage_options=opts, work_dir=str(tmp_path))
    assert report.key_file.problems[0].startswith("missing (the manifest lists it); upload")
    assert os.listdir(tmp_path) == []


def _view(where, opts=None) -> ShardView:
    storage = RemoteStorage(opts, prefetch=0) if opts is not None else None
    return ShardView(where, decode="raw", with_keys=True, storage=storage)


def test_a_url_views_first_lookup_gets_the_key_file_and_one_shards_index(s3, packed):
    """A view of a URL reads the key file its manifest lists by ranged GETs (its head, its
    block table, the one checked block of the hash), then the one shard's index: a few GETs,
    where it sorted every shard's index into a private table before (one .idx GET each)."""
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    local = _view(str(packed / "tar"))
    keys = local.keys()
    view = _view(url, opts)
    s3.log.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = view.get(keys[137])
    assert got == local.get(keys[137])
    assert 1 <= _idx_gets(s3) <= 2 and 1 <= len(s3.log.gets(KEYS_NAME)) <= 4, s3.log.gets()
    s3.log.clear()
    assert view.index(keys[3]) == 3 and view.index(keys[-1]) == len(keys) - 1
    with pytest.raises(InputError, match="no sample with key 'nope'"):
        view.index("nope")  # no checked block holds its hash: missing, no index read for it
    assert _idx_gets(s3) <= 4


def test_a_flipped_byte_in_a_url_views_key_file_is_named_and_the_answer_stays_right(s3, packed):
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    local = _view(str(packed / "tar"))
    key = local.keys()[200]
    body = bytearray((packed / "tar" / KEYS_NAME).read_bytes())
    body[HEAD + 8] ^= 0x01  # block 0: the only one of 240 samples
    s3.client().put_object(Bucket=b, Key=f"tar/{KEYS_NAME}", Body=bytes(body))
    with pytest.warns(RuntimeWarning, match=rf"{url}{KEYS_NAME}: its block 0 .* digest.*upload"):
        assert _view(url, opts).get(key) == local.get(key)
    s3.client().delete_object(Bucket=b, Key=f"tar/{KEYS_NAME}")  # gone: named too
    with pytest.warns(RuntimeWarning, match=rf"{url}{KEYS_NAME}: unreadable .*no such object"):
        assert _view(url, opts).get(key) == local.get(key)


def test_a_key_subset_at_a_url_gets_only_its_ranks_shards_indexes(s3, packed):
    """``Source(url, subset=[keys])`` finds each key's shard in the key file by ranged GETs,
    so rank 0 of 8 GETs an eighth of world size 1's .idx plus a constant, none at
    construction (before: every shard's keys, in every rank)."""
    b = _bucket(s3, packed / "tar")
    opts, url = S3Server.options(s3.endpoint), f"s3://{b}/tar/"
    local = str(packed / "tar")
    subset = _view(local).keys()[::3]
    s3.log.clear()
    whole = _ds(url, opts, subset=subset)
    built = _idx_gets(s3)
    assert _keys(whole) == _keys(_ds(local, subset=subset))
    world1 = _idx_gets(s3)
    assert built == 0 and world1 >= 40
    s3.log.clear()
    ds = _ds(url, opts, rank=0, world_size=WORLD, subset=subset)
    built = _idx_gets(s3)
    assert _keys(ds) == _keys(_ds(local, rank=0, world_size=WORLD, subset=subset))
    assert built == 0 and _idx_gets(s3) <= world1 / WORLD + 4, (_idx_gets(s3), world1)


@pytest.mark.parametrize("where", ["tar/manifest.json", "tar/", "tar"])
def test_a_url_splits_construction_gets_its_manifest_once(http, packed, where):
    """Over HTTP an existence check is a GET of the whole manifest: the manifest is read in
    one GET (a missing one is told apart by that GET), then the key file's ranges."""
    http.root = packed
    ds = _ds(f"{http.url}/{where}", split="val")
    assert len(http.log.gets("manifest.json")) == 1, http.log.gets()
    assert _keys(ds) == _keys(_ds(str(packed / "tar"), split="val"))
    with pytest.raises(InputError, match="no such manifest"):
        ShardDataset(Source(f"{http.url}/tar/gone/manifest.json"), decode="raw")
