"""ShardDataset(fields=...): extra fields from tar and LMDB, decoded by extension."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from shardkit import Decode, Order, ShardDataset, ShardWriter, Source
from shardkit.errors import InputError, SampleError
from shardkit.manifest import read_manifest


def _png(mode, value, size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, value).save(buf, "PNG")
    return buf.getvalue()


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.fixture(params=["tar", "lmdb"])
def captioned(request, tmp_path):
    """Six samples with txt, json, seg.png, npy; sample k3 lacks its txt."""
    out = tmp_path / request.param
    with ShardWriter(out, format=request.param, shard_size="1MB") as w:
        for i in range(6):
            fields = {
                "txt": f"caption {i}",
                "json": {"i": i, "boxes": [[0, 0, i, i]]},
                "seg.png": _png("L", i),
                "npy": _npy(np.full((2,), i, dtype=np.int16)),
            }
            if i == 3:
                del fields["txt"]
            w.write(f"k{i}", _png("RGB", (i, 0, 0)), i % 2, **fields)
    return str(out)


def test_fields_decode_by_extension_on_tar_and_lmdb(captioned):
    ds = ShardDataset(
        captioned,
        decode="tensor",
        order=Order(shuffle=False),
        with_keys=True,
        on_error="skip",
        fields=("txt", "json", "seg.png", "npy"),
    )
    with pytest.warns(RuntimeWarning, match=r"sample 'k3' has no 'txt' field"):
        got = list(ds)
    assert [s[2] for s in got] == ["k0", "k1", "k2", "k4", "k5"]
    image, label, key, txt, meta, seg, arr = got[-1]
    assert image.shape == (3, 6, 8) and label == 1 and key == "k5"
    assert txt == "caption 5" and meta == {"i": 5, "boxes": [[0, 0, 5, 5]]}
    assert seg.dtype == torch.uint8 and seg.shape == (1, 6, 8) and int(seg.max()) == 5
    assert arr.dtype == np.int16 and arr.tolist() == [5, 5]
    assert ds.skipped == 1


def test_a_missing_field_is_an_error_naming_shard_and_key(captioned):
    ds = ShardDataset(captioned, decode="tensor", order=Order(shuffle=False), fields=("txt",))
    with pytest.raises(SampleError, match=r"shard-000000\.(tar|lmdb): sample 'k3' has no 'txt'"):
        list(ds)


def test_per_field_choices_and_the_raw_view(captioned):
    ds = ShardDataset(
        captioned,
        decode="tensor",
        order=Order(shuffle=False),
        fields={"json": "raw", "npy": lambda b: len(b), "seg.png": "auto"},
    )
    _, _, meta, size, seg = next(iter(ds))
    assert json.loads(meta) == {"boxes": [[0, 0, 0, 0]], "i": 0} and isinstance(meta, bytes)
    assert size > 0 and seg.shape == (1, 6, 8)
    raw = list(ShardDataset(captioned, decode="raw", order=Order(shuffle=False), fields=("txt",)))
    assert raw[0][2] == b"caption 0" and raw[3][2] is None  # stored bytes, None where none
    with pytest.raises(InputError, match="callable"):
        ShardDataset(captioned, fields={"json": "decoded"})


def test_a_field_that_does_not_decode_names_the_field(tmp_path):
    with ShardWriter(tmp_path / "d") as w:
        w.write("k0", _png("RGB", (1, 2, 3)), 0, json="{not json")
    ds = ShardDataset(str(tmp_path / "d"), decode="tensor", fields=("json",))
    with pytest.raises(SampleError, match=r"sample 'k0': field 'json' cannot be decoded"):
        list(ds)


def test_dataloader_batches_fields_with_default_collate(captioned):
    ds = ShardDataset(
        captioned,
        decode="tensor",
        order=Order(shuffle=False),
        on_error="skip",
        fields=("txt", "seg.png"),
    )
    with pytest.warns(RuntimeWarning):
        batches = list(DataLoader(ds, batch_size=2))
    images, labels, captions, masks = batches[0]
    assert images.shape == (2, 3, 6, 8) and labels.tolist() == [0, 1]
    assert list(captions) == ["caption 0", "caption 1"] and masks.shape == (2, 1, 6, 8)


def test_tars_with_fields_read_the_same_through_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 6), (i, 0, 0)).save(src / "a" / f"x{i}.jpg")
        (src / "a" / f"x{i}.txt").write_text(f"caption {i}")
        (src / "a" / f"x{i}.json").write_text(json.dumps({"i": i}))
        Image.new("L", (8, 6), i).save(src / "a" / f"x{i}.seg.png")
    from shardkit import pack

    pack(str(src), str(tmp_path / "out"), shuffle=False)
    shard = str(next((tmp_path / "out").glob("*.tar")))
    theirs = list(wds.WebDataset([shard], shardshuffle=False, empty_check=False))
    with tarfile.open(shard) as tf:
        members = {n: tf.extractfile(n).read() for n in tf.getnames()}
    assert [s["__key__"] for s in theirs] == ["a/x0", "a/x1", "a/x2"]
    for s in theirs:
        for ext in ("jpg", "cls", "txt", "json", "seg.png"):
            assert s[ext] == members[f"{s['__key__']}.{ext}"]
        assert s["txt"] == (src / f"{s['__key__']}.txt").read_bytes()
        assert s["seg.png"] == (src / f"{s['__key__']}.seg.png").read_bytes()
    ours = ShardDataset(
        str(tmp_path / "out"),
        decode="raw",
        order=Order(shuffle=False),
        with_keys=True,
        fields=("txt", "json", "seg.png"),
    )
    assert [(k, t, j, m) for _, _, k, t, j, m in ours] == [
        (s["__key__"], s["txt"], s["json"], s["seg.png"]) for s in theirs
    ]


def test_a_view_gives_the_same_fields_as_the_stream(captioned):
    from shardkit import ShardView

    names = ("json", "seg.png")
    view = ShardView(captioned, decode="tensor", with_keys=True, fields=names)
    stream = list(
        ShardDataset(
            captioned, decode="tensor", order=Order(shuffle=False), with_keys=True, fields=names
        )
    )
    for i in (0, 4):
        got, want = view[i], stream[i]
        assert got[2] == want[2] and got[3] == want[3] and torch.equal(got[4], want[4])
    with pytest.raises(SampleError, match="sample 'k3' has no 'txt'"):
        ShardView(captioned, fields=("txt",))[3]
    raw = ShardView(captioned, decode="raw", fields=("txt",))
    assert raw[3][2] is None and raw[0][2] == b"caption 0"


def test_resume_with_fields_continues_where_it_stopped(captioned):
    def make():
        return ShardDataset(
            captioned,
            decode="raw",
            seed=3,
            order=Order(buffer_size=4),
            with_keys=True,
            fields=("json", "txt"),
        )

    full = [(s[2], s[3]) for s in make()]
    ds = make()
    it = iter(ds)
    head = [next(it)[2] for _ in range(2)]
    state = ds.state_dict()
    again = make()
    again.load_state_dict(state)
    rest = [(s[2], s[3]) for s in again]
    assert head == [k for k, _ in full[:2]] and rest == full[2:] and len(ds) == 6


def test_fields_through_a_subset_which_reads_like_a_mixture(captioned):
    ds = ShardDataset(Source(captioned, subset=0.5), decode="raw", with_keys=True, fields=("json",))
    got = list(ds)
    assert len(got) == 3 and all(json.loads(s[3])["i"] == int(s[2][1:]) for s in got)


def test_a_webdataset_written_tar_reads_with_its_fields_after_shardkit_index(tmp_path):
    wds = pytest.importorskip("webdataset")
    from shardkit.write.index import index_shards

    (tmp_path / "w").mkdir()
    with wds.TarWriter(str(tmp_path / "w" / "a.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"s{i}", "jpg": _png("RGB", (i, 0, 0)), "cls": str(i % 2),
                        "txt": f"caption {i}", "json": json.dumps({"i": i})})  # fmt: skip
    index_shards([str(tmp_path / "w")])
    ds = ShardDataset(
        str(tmp_path / "w"),
        decode="tensor",
        order=Order(shuffle=False),
        with_keys=True,
        fields=("txt", "json"),
    )
    assert [(s[1], s[2], s[3], s[4]) for s in ds] == [
        (i % 2, f"s{i}", f"caption {i}", {"i": i}) for i in range(4)
    ]


def test_the_cli_packs_a_table_and_refuses_a_path_outside_it(tmp_path):
    from click.testing import CliRunner

    from shardkit.cli import main

    (tmp_path / "set").mkdir()
    Image.new("RGB", (8, 6)).save(tmp_path / "set" / "in.jpg")
    Image.new("RGB", (8, 6)).save(tmp_path / "out.jpg")
    table = tmp_path / "set" / "t.csv"
    table.write_text("image,caption\nin.jpg,inside\n../out.jpg,outside\n")
    res = CliRunner().invoke(main, ["pack", str(table), str(tmp_path / "o"), "-q"])
    assert res.exit_code == 2 and res.output.splitlines() == [
        f"error: {table}:3: image path '../out.jpg' leads outside {str(tmp_path / 'set')!r}; "
        "nothing outside the table's folder is read unless you pass a root that holds it "
        "(--root DIR, root=DIR)"
    ]
    table.write_text("image,caption\nset/in.jpg,inside\nout.jpg,outside\n")
    res = CliRunner().invoke(
        main, ["pack", str(table), str(tmp_path / "o"), "-q", "--root", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    assert read_manifest(str(tmp_path / "o")).fields == {"txt": 2}


def _declared_png(width: int, height: int) -> bytes:
    """A greyscale PNG whose header declares ``width`` x ``height`` and whose data is a few
    bytes: decoding it would allocate what the header says before finding the data short."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 99))


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL's own, at open
def test_an_image_field_is_held_to_the_pixel_limit_from_its_header(tmp_path, fmt):
    from shardkit import ShardView

    out = tmp_path / fmt
    with ShardWriter(out, format=fmt, shard_size="1MB") as w:
        w.write("bomb", _png("RGB", (1, 2, 3)), 0, **{"seg.png": _declared_png(11000, 10000)})
        w.write("big", _png("RGB", (1, 2, 3), (40, 40)), 0, **{"seg.png": _png("L", 1, (40, 40))})
    bomb = r"sample 'bomb': field 'seg.png' .*11000x10000 = 110000000 pixels, over the limit"
    with pytest.raises(SampleError, match=bomb + r" max_pixels=100000000"):  # the default
        list(ShardDataset(str(out), fields=("seg.png",), order=Order(shuffle=False)))
    with pytest.raises(SampleError, match=bomb):
        ShardView(str(out), fields=("seg.png",))[0]
    small = ShardDataset(
        str(out), fields=("seg.png",), decode=Decode(max_pixels=1000), on_error="skip"
    )
    with pytest.warns(RuntimeWarning) as caught:
        assert list(small) == []  # the dataset's own limit holds for its masks too
    assert sum("'big': field 'seg.png'" in str(w.message) for w in caught) == 1
    limited = [
        str(w.message) for w in caught if "over the limit max_pixels=1000 " in str(w.message)
    ]
    assert len(limited) == 2  # the mask of 'big' and the one of 'bomb'
    view = ShardView(str(out), fields=("seg.png",), decode=Decode(max_pixels=None))
    assert view.get("big")[2].shape == (1, 40, 40)
