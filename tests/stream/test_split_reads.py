"""Split and subset epochs read the wanted samples alone, and give the samples they gave before:
the same samples in the same order as the reader that read them one by one (digests taken from
that reader, for a fixed pack, seed and epoch), with the read calls counted."""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings

import numpy as np
import pytest
from PIL import Image

from shardkit import Order, ShardDataset, ShardWriter
from shardkit.errors import ShardFormatError
from shardkit.stream import ranges
from shardkit.stream.mix import Source


def _without_columns_sha256(mpath: str) -> None:
    """The manifest at ``mpath`` as an older pack wrote it: no entry lists ``columns_sha256``."""
    with open(mpath) as f:
        doc = json.load(f)
    for entry in doc["shards"]:
        del entry["columns_sha256"]
    with open(mpath, "w") as f:
        json.dump(doc, f)


def _jpeg() -> bytes:
    arr = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=80)
    return buf.getvalue()


def _make(out, fmt: str, shard_size: str = "40kB") -> str:
    """1,200 samples in shards of ~40 kB: keys and labels fixed, each sample's bytes its own."""
    data = _jpeg()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        classes = [f"c{c}" for c in range(5)]
        with ShardWriter(str(out), shard_size=shard_size, format=fmt, classes=classes) as w:
            for i in range(1200):
                w.add(f"c{i % 5}/k{i:05d}", "jpg", data + b"%d" % i, i % 5)
    return str(out)


@pytest.fixture(scope="module", params=["tar", "lmdb"])
def pack(request, tmp_path_factory):
    return request.param, _make(tmp_path_factory.mktemp("split") / "out", request.param)


def _digest(where, **kw) -> tuple[int, str]:
    ds = ShardDataset(where, decode="raw", with_keys=True, seed=7, **kw)
    ds.set_epoch(1)
    h = hashlib.sha256()
    n = 0
    for img, label, key in ds:
        h.update(b"%s %d %s\n" % (key.encode(), label, hashlib.sha256(img).hexdigest().encode()))
        n += 1
    return n, h.hexdigest()[:24]


#: (samples, digest of key, label and bytes in order) of epoch 1, seed 7, as the reader that
#: read split and subset samples one range (tar) or one streamed slice (LMDB) at a time gave.
BEFORE = {
    ("tar", "val"): (131, "e0eb6c0484193a6d3bc4fdeb"),
    ("tar", "train"): (1069, "aedfe326e89c53f580f0dfe9"),
    ("tar", "subset"): (24, "d0df5b0fd071eb1ac41d73bb"),
    ("tar", "subset30"): (360, "8ddbc1b5a50ded7e24044632"),
    ("tar", "mix"): (300, "98a7c8ece23985081fbf4bdc"),
    ("lmdb", "val"): (131, "3fb1b9e57fd4cf9d95e26732"),
    ("lmdb", "train"): (1069, "a4bc9fa7460a5aa628075849"),
    ("lmdb", "subset"): (24, "57c212e7b46933fefeda88a0"),
    ("lmdb", "subset30"): (360, "b6bf078671cb1c54a5e44ade"),
    ("lmdb", "mix"): (300, "92e8d5512e5757a71e7d812b"),
}


@pytest.mark.parametrize("what", ["val", "train", "subset", "subset30", "mix"])
def test_split_and_subset_epochs_give_the_samples_they_gave_before(pack, what):
    fmt, where = pack
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if what == "mix":
            got = _digest(
                [Source(where, subset=0.05, weight=0.5), Source(where, split="val", weight=0.5)],
                epoch_size=300,
            )
        else:
            kw = {
                "val": {"split": "val", "val_fraction": 0.1},
                "train": {"split": "train", "val_fraction": 0.1},
                "subset": {"subset": 0.02},
                "subset30": {"subset": 0.3},
            }[what]
            got = _digest(Source(where, **kw))
    assert got == BEFORE[fmt, what]


@pytest.mark.parametrize("what", ["val", "subset30", "mix"])
def test_slices_read_in_many_chunks_give_the_same_samples(tmp_path, monkeypatch, what):
    """A slice whose wanted bytes pass the reader's chunk (a large shard) is read a chunk at a
    time and parsed a few samples at a call: the same samples as in one chunk. A mixture's two
    range readers interleave in one thread, each on its own buffer (``ranges._BUFFERS``), over
    two epochs (the second on the buffers the first gave back)."""
    where = _make(tmp_path / "out", "tar")
    monkeypatch.setattr(ranges, "CHUNK", 5000)  # two or three samples a chunk
    monkeypatch.setattr(ranges, "BATCH", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if what == "mix":
            for _ in range(2):
                got = _digest(
                    [
                        Source(where, subset=0.05, weight=0.5),
                        Source(where, split="val", weight=0.5),
                    ],
                    epoch_size=300,
                )
                assert got == BEFORE["tar", what]
            return
        kw = {"val": {"split": "val", "val_fraction": 0.1}, "subset30": {"subset": 0.3}}[what]
        assert _digest(Source(where, **kw)) == BEFORE["tar", what]


class _Preads:
    """Counts ``os.pread`` and ``os.preadv`` calls (how both readers read a local shard's
    bytes) and the spans the range reader's C calls read, one ``pread`` each
    (``ranges._pread_spans``, ``ranges._pread_at``)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("pread", "preadv"):
            monkeypatch.setattr(os, name, self._counted(getattr(os, name)))
        real = ranges._pread_spans
        if real is not None:

            def spans(fd, buf, lo, hi):
                self.calls += len(lo)
                return real(fd, buf, lo, hi)

            monkeypatch.setattr(ranges, "_pread_spans", spans)
        at = ranges._pread_at
        if at is not None:

            def pread_at(*args):
                got = at(*args)
                self.calls += got[3] if isinstance(got, tuple) else 0  # its spans: a pread each
                return got

            monkeypatch.setattr(ranges, "_pread_at", pread_at)

    def _counted(self, real):
        def counting(*args):
            self.calls += 1
            return real(*args)

        return counting


@pytest.mark.parametrize("kw", [{"subset": 0.02}, {"split": "val", "val_fraction": 0.05}])
def test_a_sparse_lmdb_epoch_reads_a_few_pages_per_drawn_sample(tmp_path, monkeypatch, kw):
    """Counted: a lookup reads the leaf page and the value, the shard opened once for all its
    drawn samples; the tree is not walked first (the walk reads every page of the shard:
    about a hundred reads per drawn sample of a 1% subset). Shards of ~400 samples: opening
    one costs a few reads of its own (meta pages, the count), as a large shard's does."""
    where = _make(tmp_path / "out", "lmdb", "400kB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = ShardDataset(Source(where, **kw), decode="raw", with_keys=True, seed=7)
    reads = _Preads(monkeypatch)
    drawn = sum(1 for _ in ds)
    assert 0 < drawn <= 80
    assert reads.calls <= 4 * drawn


def _runs(ds) -> int:
    """Runs of adjacent wanted samples (within a shard) of a one-source dataset."""
    s = ds.sources[0]
    members = s.members.array() if hasattr(s.members, "array") else np.asarray(s.members)
    shard_of = np.searchsorted(np.cumsum([sh.samples for sh in s.shards]), members, "right")
    breaks = (np.diff(members) != 1) | (np.diff(shard_of) != 0)
    return int(breaks.sum()) + 1 if len(members) else 0


@pytest.mark.parametrize("kw", [{"split": "val"}, {"subset": 0.05}], ids=["val", "subset"])
def test_a_sparse_tar_epoch_reads_each_wanted_run_once(tmp_path, monkeypatch, kw):
    """Counted: one read a run of adjacent wanted samples, the holes between runs never read;
    the index heads are read in the first epoch only (kept across epochs)."""
    where = _make(tmp_path / "out", "tar")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = ShardDataset(Source(where, **kw), decode="raw", with_keys=True, seed=7)
    reads = _Preads(monkeypatch)
    drawn = sum(1 for _ in ds)
    runs = _runs(ds)
    assert 0 < runs < drawn and reads.calls == runs
    heads = []
    real = ranges.shard_columns
    monkeypatch.setattr(ranges, "shard_columns", lambda *a: heads.append(a) or real(*a))
    reads.calls = 0
    ds.set_epoch(1)
    assert sum(1 for _ in ds) == drawn and reads.calls == runs and heads == []


def _overflow_pages(path: str, psize: int = 4096) -> list[int]:
    """Page numbers of an LMDB file's overflow pages (flags 0x04, each naming itself)."""
    raw = open(path, "rb").read()
    pages = []
    for p in range(2, len(raw) // psize):
        pgno = int.from_bytes(raw[p * psize : p * psize + 8], "little")
        flags = int.from_bytes(raw[p * psize + 10 : p * psize + 12], "little")
        if pgno == p and flags == 0x04:
            pages.append(p)
    return pages


def test_a_lookup_without_the_walk_still_refuses_a_damaged_overflow_page(tmp_path):
    """The sparse read skips the walk, so each value's overflow header is checked as it is read:
    a damaged one is an error naming the shard, never another sample's bytes."""
    where = _make(tmp_path / "out", "lmdb")
    data = _jpeg() * 2
    with ShardWriter(str(tmp_path / "big"), format="lmdb", classes=["c0"]) as w:
        for i in range(60):
            w.add(f"c0/b{i:03d}", "jpg", data + bytes(3000) + b"%d" % i, 0)  # overflow values
    shard = next(str(p) for p in (tmp_path / "big").iterdir() if p.suffix == ".lmdb")
    pages = _overflow_pages(shard)
    assert len(pages) >= 60
    with open(shard, "r+b") as f:
        for p in pages:
            f.seek(p * 4096)
            f.write((p + 1).to_bytes(8, "little"))  # each names the next page
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = ShardDataset(Source(str(tmp_path / "big"), subset=0.05), decode="raw", seed=7)
    with pytest.raises(ShardFormatError) as err:
        list(ds)
    assert shard in str(err.value) and "overflow page" in str(err.value)
    assert where  # the other pack is untouched


@pytest.mark.parametrize("split", ["val", "train"])
def test_split_construction_holds_a_fraction_of_a_byte_per_sample(tmp_path, split):
    """Counted (tracemalloc, numpy's arrays included): building ``split=`` over 6,000 and over
    18,000 samples (400 a shard), from the shard list to the checkpoint digest, peaks at one
    shard's index columns and hashes at a time (the same at both sizes) and the val bits, 1/8 byte a
    sample, on either side: the 12,000 more samples add under half a byte each, not a byte or a
    position (8 bytes) each. Before, the train side's positions took 7.2 bytes a sample of the
    dataset, twice while the checkpoint digest copied them; the val side's mask 2."""
    import tracemalloc

    import shardkit.stream.dataset as dataset_module
    import shardkit.stream.selection as selection_module

    data = _jpeg()
    seen = {}
    counted, facts = selection_module._counted, dataset_module.mix_facts

    def after_counting(*args, **kw):  # the split starts here: the shard list is read
        got = counted(*args, **kw)
        tracemalloc.reset_peak()
        seen["base"] = tracemalloc.get_traced_memory()[0]
        return got

    def digested(*args, **kw):
        got = facts(*args, **kw)
        seen["peak"] = tracemalloc.get_traced_memory()[1] - seen["base"]
        return got

    peaks, shards = {}, {}
    for n in (6000, 18000):
        out = tmp_path / f"n{n}"
        with ShardWriter(str(out), shard_size="800kB", classes=["c0"]) as w:
            for i in range(n):
                w.add(f"c0/k{i:05d}", "jpg", data, 0)
        selection_module._counted, dataset_module.mix_facts = after_counting, digested
        tracemalloc.start()
        try:
            ds = ShardDataset(Source(str(out), split=split, val_fraction=0.1), decode="raw", seed=7)
        finally:
            tracemalloc.stop()
            selection_module._counted, dataset_module.mix_facts = counted, facts
        assert n // 400 <= len(ds.shards) and 0.08 * n < min(len(ds), n - len(ds)) < 0.12 * n
        peaks[n], shards[n] = seen["peak"], len(ds.shards)
    # the shard list's own objects (each shard's URL, count, digests: ~480 B a shard, held at
    # the peak now that one shard costs only its columns read) are O(shards); a byte a sample
    # more (12,000 B) would still not fit beside them
    more_shards = shards[18000] - shards[6000]
    assert peaks[18000] - peaks[6000] <= 0.5 * 12000 + 640 * more_shards, (peaks, shards)
    assert peaks[18000] <= 4 * 18000, peaks  # the bound at any size, one shard's index included


def _rchar() -> int:
    """Bytes this process has read through read calls so far (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts /proc/self/io")
def test_split_construction_reads_the_vouched_columns_of_each_index_alone(tmp_path):
    """Counted (``rchar``): where the manifest lists each index's ``columns_sha256``, building
    a split and planning its epoch (where a key file counts the split, each shard's index is
    read when the plan reaches it) reads the manifest and each index's fixed-width columns (16
    bytes a sample), not the key table and members after them (~5x that); an entry without it
    reads and hashes the whole index, as before. The same samples either way."""
    from shardkit.formats.sample_index import columns_size
    from shardkit.manifest import read_manifest
    from shardkit.stream.world import World

    out = str(tmp_path / "out")
    data = _jpeg()
    with ShardWriter(out, shard_size="2MB", classes=["c0"]) as w:
        for i in range(3000):
            w.add(f"c0/a-longer-key-{i:08d}", "jpg", data, 0)
    entries = read_manifest(out).shards
    assert len(entries) > 2 and all(e.columns_sha256 for e in entries)
    mpath = os.path.join(out, "manifest.json")
    columns = sum(columns_size(e.samples) for e in entries)
    whole = sum(os.path.getsize(os.path.join(out, e.path + ".idx")) for e in entries)
    assert whole > 4 * columns

    def construct() -> tuple[int, list[str]]:
        src = Source(out, split="val", val_fraction=0.1)
        before = _rchar()
        ds = ShardDataset(src, decode="raw", with_keys=True, order=Order(shuffle=False))
        ds.plan(World(), 0)
        read = _rchar() - before
        return read, [s[2] for s in ds]

    construct()  # modules imported, caches warm: what follows is the split's own reading
    read, keys = construct()
    assert 0 < len(keys) < 3000
    assert read <= os.path.getsize(mpath) + columns + 16384, (read, columns, whole)
    _without_columns_sha256(mpath)
    construct()
    read_all, keys_all = construct()
    assert read_all >= whole and keys_all == keys


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts /proc/self/io")
def test_lmdb_split_construction_hashes_no_key_where_the_manifest_vouches(tmp_path, monkeypatch):
    """Counted (calls of ``key_hashes`` and ``rchar``): every LMDB writer lists each shard's
    ``columns_sha256`` (its index record's head, split hashes and digests), and building a
    split reads those 16 bytes a sample of each record and hashes no key; an entry without it
    (a pack made before) reads the whole record and hashes every key, as before. The same
    samples either way. Before, every key was hashed again in Python (1.75 s CPU at 1.28M)."""

    import shardkit.stream.indexes as indexes_module
    from shardkit.formats.lmdb.index import lmdb_columns_size
    from shardkit.manifest import read_manifest
    from shardkit.stream.world import World

    out = str(tmp_path / "out")
    data = _jpeg()
    with ShardWriter(out, shard_size="2MB", classes=["c0"], format="lmdb") as w:
        for i in range(3000):
            w.add(f"c0/a-longer-key-{i:08d}", "jpg", data, 0)
    entries = read_manifest(out).shards
    assert len(entries) > 2 and all(e.columns_sha256 and not e.index_sha256 for e in entries)
    mpath = os.path.join(out, "manifest.json")
    columns = sum(lmdb_columns_size(e.samples) for e in entries)
    hashed = []
    real = indexes_module.key_hashes

    def counting(keys):
        hashed.append(len(keys))
        return real(keys)

    monkeypatch.setattr(indexes_module, "key_hashes", counting)

    def construct() -> tuple[int, list[str]]:
        src = Source(out, split="val", val_fraction=0.1)
        hashed.clear()
        before = _rchar()
        ds = ShardDataset(src, decode="raw", with_keys=True, order=Order(shuffle=False))
        ds.plan(World(), 0)  # a key file's split reads each record when its plan reaches it
        read = _rchar() - before
        return read, sum(hashed), [s[2] for s in ds]

    construct()  # modules imported, caches warm: what follows is the split's own reading
    read, keys_hashed, keys = construct()
    assert 0 < len(keys) < 3000
    assert keys_hashed == 0
    # the manifest, each shard's meta page and branch pages, and the records' fronts
    pages = 4096 * 6 * len(entries)
    assert read <= os.path.getsize(mpath) + columns + pages, (read, columns)
    _without_columns_sha256(mpath)
    construct()
    read_all, hashed_all, keys_all = construct()
    assert hashed_all == 3000 and keys_all == keys
    assert read_all > read + 3000 * 20  # the key table (20-byte keys) read too


def test_a_chunks_samples_are_parsed_in_calls_bounded_in_samples_and_bytes(monkeypatch):
    """``ranges._batches``: at most ``BATCH`` samples a call, and a call ends once its bytes pass
    ``BATCH_BYTES`` (so a chunk of large images is never all alive at once); every sample in
    exactly one call, in order."""
    monkeypatch.setattr(ranges, "BATCH", 4)
    monkeypatch.setattr(ranges, "BATCH_BYTES", 1000)
    for sizes in ([10] * 3, [10] * 9, [600] * 5, [10, 2000, 10, 10, 10, 10, 10], [5000]):
        cuts = ranges._batches(np.array(sizes, np.int64))
        assert cuts[0] == 0 and cuts[-1] == len(sizes) and cuts == sorted(set(cuts))
        for c, d in zip(cuts[:-1], cuts[1:], strict=True):
            assert d - c <= 4
            assert sum(sizes[c : d - 1]) < 1000  # past the budget only by its last sample
    assert ranges._batches(np.array([10] * 9, np.int64)) == [0, 4, 8, 9]
    assert ranges._batches(np.array([600] * 5, np.int64)) == [0, 2, 4, 5]


def _frames_per_sample(ds) -> float:
    """Python frames entered (calls and generator resumes) per sample an epoch delivers."""
    import sys

    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1

    ds.set_epoch(1)
    it = iter(ds)
    next(it)  # the plan and the first shard's reads: once an epoch, not per sample
    sys.setprofile(count)
    try:
        n = 1 + sum(1 for _ in it)
    finally:
        sys.setprofile(None)
    return calls[0] / n


def test_a_split_epoch_enters_about_as_many_frames_a_sample_as_a_full_epoch(tmp_path):
    """A one-source split's records pass its stages a list at a time and are laid end to end
    in C (``stages.read_batches``), with no mixture interleave and no arrangement around them
    at an epoch's start: a tar val sample enters at most one Python frame more than a full
    epoch's, the plan's and the reads' own calls counted in (it entered about 16 to the full
    epoch's 10: a frame a stage and record for the range reader, the plan's pieces, the label
    check, the arrangement and the interleave)."""
    where = _make(tmp_path / "out", "tar", shard_size="400kB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = Source(where, split="val", val_fraction=0.1)
        val = ShardDataset(source, decode="raw", seed=3, order=Order(shuffle=False))
        full = ShardDataset(where, decode="raw", seed=3, order=Order(shuffle=False))
    assert _frames_per_sample(val) <= _frames_per_sample(full) + 1


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_read_batches_hands_out_read_slices_records_in_lists(tmp_path, fmt):
    """The same records as ``read_slices(drop=True)``, ranged slices (a few wanted samples of a
    shard) and streamed ones (most of a shard) alike, each list at most a parse's."""
    from shardkit.formats import FORMATS
    from shardkit.records import ShardSlice
    from shardkit.stream.stages import read_batches, read_slices
    from shardkit.stream.storage import LocalStorage

    where = _make(tmp_path / "out", fmt, shard_size="400kB")
    shards = ShardDataset(where).shards
    slices = [ShardSlice(i, 0, s.samples) for i, s in enumerate(shards)]
    keep = np.random.default_rng(0).random(sum(s.samples for s in shards)) < 0.08
    keep[: shards[0].samples] = True  # the first shard streamed, the others ranged
    args = (slices, shards, FORMATS[fmt], LocalStorage())
    one = [r.key for r in read_slices(*args, keep=keep, drop=True)]
    lists = list(read_batches(*args, keep=keep))
    assert [r.key for got in lists for r in got] == one
    assert len(one) == int(keep.sum())
    assert all(0 < len(got) <= ranges.BATCH for got in lists)


def test_a_label_outside_the_classes_ends_a_list_after_the_records_before_it():
    """``mix._labels_checked``: the records before a bad label are handed out, then the error
    ``check_labels`` raises for it, as one by one."""
    from shardkit.errors import SampleError
    from shardkit.records import Record
    from shardkit.stream.mix import _labels_checked

    recs = [Record(f"k{i}", "jpg", b"", lab, "s.tar") for i, lab in enumerate([0, 2, 3, 1])]
    it = _labels_checked(iter([recs[:1], recs[1:]]), 3)
    assert next(it) == recs[:1]
    assert next(it) == recs[1:2]
    with pytest.raises(SampleError, match="'k2' has label 3"):
        next(it)


@pytest.mark.parametrize("chunk,batch_bytes", [(5000, 1 << 20), (5000, 2500), (4 << 20, 3000)])
def test_a_local_shards_spans_worked_out_in_c_read_and_cut_as_in_numpy(
    tmp_path, monkeypatch, chunk, batch_bytes
):
    """``_local_batches`` (the spans, chunks and parse calls of a local shard worked out in one
    C call, ``_native.pread_at``) hands out the lists ``_spans_batches`` (the same in numpy)
    does, with the same sample numbers and the same reads, for masks sparse to dense, chunks of
    a few samples and parse calls cut by count and by bytes."""
    from shardkit.records import ShardSlice
    from shardkit.stream.storage import LocalStorage

    if ranges._pread_at is None:
        pytest.skip("built without the C extension")
    monkeypatch.setattr(ranges, "CHUNK", chunk)
    monkeypatch.setattr(ranges, "BATCH", 3)
    monkeypatch.setattr(ranges, "BATCH_BYTES", batch_bytes)
    where = _make(tmp_path / "out", "tar", shard_size="400kB")
    shards = ShardDataset(where).shards
    rng = np.random.default_rng(5)
    for density in (0.02, 0.1, 0.5, 1.0):
        for shard in shards:
            sl = ShardSlice(0, 0, shard.samples)
            want = rng.random(shard.samples) < density
            if not want.any():
                continue
            got = []
            for path in ("_local_batches", "_spans_batches"):
                reader = ranges.RangeReader("tar", LocalStorage())
                assert reader.exact(sl, shard, 0)
                index = reader._indexes[shard.url]
                if path == "_local_batches":
                    out = reader._local_batches(shard, index, want.nonzero()[0], (), None)
                else:
                    out = reader._spans_batches(sl, shard, index, want, (), None)
                lists = [([r.key for r in recs], at.tolist()) for recs, at in out]
                got.append((lists, reader.reads))
                reader.close()
            assert got[0] == got[1]
            assert [n for _, at in got[0][0] for n in at] == want.nonzero()[0].tolist()


def test_pread_at_checks_every_bound_before_it_reads(tmp_path):
    """``_native.pread_at`` refuses a sample outside its index or out of order (ValueError,
    nothing read), says what a small buffer must hold (an int), and None where the file ends
    before a span (the reader names the shard): never a read past its buffer."""
    from shardkit.images._native import pread_at

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 8)  # 2048 bytes
    offsets = np.array([0, 100, 300, 600, 1000, 1500], np.int64)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(4096)

        def at(pos, first=0, chunk=1 << 20, block=8, buffer=buf, offs=offsets):
            args = (first, chunk, block, 2, 1 << 20)  # two samples a parse call
            return pread_at(fd, buffer, offs, np.array(pos, np.int64), *args)

        stop, starts, ends, spans, cuts = at([0, 1, 3])
        assert stop == 3 and spans == 2 and cuts == [0, 2, 3]
        s, e = memoryview(starts).cast("q").tolist(), memoryview(ends).cast("q").tolist()
        assert (s, e) == ([0, 100, 308], [100, 300, 708])  # span [0, 308) then [600, 1008)
        assert buf[308:708] == (bytes(range(256)) * 8)[600:1000]
        assert at([0, 3], chunk=200)[0] == 1  # the second span past the chunk: the next call's
        assert at([0, 3], first=1)[0] == 2
        for bad in ([5], [-1], [3, 1], [1, 1]):
            with pytest.raises(ValueError, match="outside its index or out of order"):
                at(bad)
        with pytest.raises(ValueError, match="outside its index or out of order"):
            at([0, 1], offs=np.array([0, 100, 50], np.int64))
        with pytest.raises(ValueError, match="bad arguments"):
            at([0], first=1)
        assert at([0, 1, 2, 3], buffer=bytearray(10)) == 1008  # nothing read: grow to this
        assert at([4])[3] == 1  # [1000, 1508) of 2048 bytes
        assert at([4], offs=np.array([0, 100, 300, 600, 1000, 3000], np.int64)) is None
    finally:
        os.close(fd)


def test_a_shards_off_side_samples_are_worked_out_once_for_each_split():
    """``ranges._off_side_of`` (the whole shard's samples whose stored hash is off the side the
    split put them, kept on its index head) names the places ``_off_side`` names for any
    wanted samples, under each split's sides in turn (another fraction, other bits, another
    place in the bits): never another split's answer."""
    from shardkit.formats.sample_index import ShardSides

    rng = np.random.default_rng(3)
    n = 300
    hashes = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    index = ranges._Columns(np.arange(n + 1, dtype=np.int64), hashes.astype(">u8"))
    for threshold in (2**62, 2**63, 2**62):
        for base in (0, 5, 16):
            val = (hashes < np.uint64(threshold)).astype(np.uint8)
            val[rng.choice(n, 4, replace=False)] ^= 1  # four samples the split put elsewhere
            bits = np.packbits(np.concatenate((np.zeros(base, np.uint8), val)))
            sides = ShardSides(bits, base, threshold)
            for _ in range(3):
                pos = np.flatnonzero(rng.random(n) < 0.3)
                want = ranges._off_side(index.hashes[pos], pos, sides)
                assert ranges._off_side_of(index, pos, sides) == want
            assert len(ranges._off_side_of(index, np.arange(n), sides)) == 4
