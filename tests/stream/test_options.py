"""ShardDataset's option groups: ``Decode``, ``Order``, ``Source``, one storage object.

Each retired keyword still works for one release: it builds its group's object, warns with the
new spelling, and gives the same samples and the same ``state_dict()`` as the new call. An old
and a new spelling of one group together is refused by name. A mixture takes ``storage=`` and
answers ``plan()``; a captioned and an uncaptioned set mix (``Source(fields=())``), through
``ShardDataset`` and ``ShardLoader``. The last test walks the combinations of the groups.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from shardkit import (
    CenterCrop,
    Decode,
    InputError,
    Order,
    RandomResizedCrop,
    SampleError,
    ShardDataset,
    ShardLoader,
    Source,
)
from shardkit.stream.retired import GROUPS, PREFIX
from shardkit.stream.storage import LocalStorage
from shardkit.write.packer import pack

N_CLIP, N_CLS = 24, 18


def _images(root, n: int, captions: bool, seed: int) -> str:
    for i in range(n):
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed + i)
        Image.fromarray(rng.integers(0, 256, (14, 18, 3), dtype=np.uint8)).save(
            d / f"im{i:02d}.jpg"
        )
        if captions:
            (d / f"im{i:02d}.txt").write_text(f"caption {seed + i}")
    return str(root)


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, str]:
    """A CLIP-style set (jpg + txt) and a classification set (jpg only), each in a few tar
    shards."""
    base = tmp_path_factory.mktemp("options")
    out = {}
    for name, n, captions, seed in (("clip", N_CLIP, True, 0), ("cls", N_CLS, False, 100)):
        src = _images(base / f"{name}-src", n, captions, seed)
        out[name] = str(base / name)
        pack(src, out[name], shard_size=12000, progress=False)
    return out


def _read(ds, n: int | None = None) -> tuple[list, dict]:
    """The first ``n`` samples (keys and images as comparable values) and the state after."""
    got = []
    for sample in itertools.islice(iter(ds), n):
        img = sample[0]
        if isinstance(img, torch.Tensor):
            img = img.numpy().tobytes()
        elif isinstance(img, Image.Image):
            img = img.tobytes()
        got.append((img, sample[1], *sample[2:]))
    return got, ds.state_dict()


def _old(path, **kw):
    with pytest.warns(FutureWarning, match=PREFIX) as record:
        ds = ShardDataset(path, with_keys=True, seed=3, **kw)
    return ds, str(record[0].message)


# Each retired keyword: the old call's keywords, then the new call's (source given as "PATH").
ALIASES = {
    "size": (dict(decode="tensor", size=8), dict(decode=Decode(crop=CenterCrop(8, 8)))),
    "crop": (
        dict(decode="tensor", size=8, crop="random"),
        dict(decode=Decode(crop=RandomResizedCrop(8))),
    ),
    "flip": (
        dict(decode="tensor", crop=RandomResizedCrop(8), flip=True),
        dict(decode=Decode(crop=RandomResizedCrop(8), flip=True)),
    ),
    "max_pixels": (dict(max_pixels=10**6), dict(decode=Decode("pil", max_pixels=10**6))),
    "dct": (dict(decode="tensor", dct="fast"), dict(decode=Decode(dct="fast"))),
    "shuffle": (dict(shuffle=False), dict(order=Order(shuffle=False))),
    "buffer_size": (dict(buffer_size=5), dict(order=Order(buffer_size=5))),
    "equalize": (
        dict(equalize="drop", rank=1, world_size=2),
        dict(order=Order(equalize="drop"), rank=1, world_size=2),
    ),
    "subset": (dict(subset=0.5), dict(source=lambda p: Source(p, subset=0.5))),
    "split": (dict(split="train"), dict(source=lambda p: Source(p, split="train"))),
    "val_fraction": (
        dict(split="val", val_fraction=0.4),
        dict(source=lambda p: Source(p, split="val", val_fraction=0.4)),
    ),
    # the storage group configures URL sources: read through file:// URLs
    "storage_options": (
        dict(storage_options={"auto_mkdir": False}),
        dict(storage=lambda tmp: _remote(storage_options={"auto_mkdir": False})),
    ),
    "cache_dir": (
        dict(cache_dir="CACHE"),
        dict(storage=lambda tmp: _remote(cache_dir=tmp / "new")),
    ),
    "cache_limit": (
        dict(cache_dir="CACHE", cache_limit="10MB"),
        dict(storage=lambda tmp: _remote(cache_dir=tmp / "new", cache_limit="10MB")),
    ),
    "prefetch": (dict(prefetch=0), dict(storage=lambda tmp: _remote(prefetch=0))),
}


def _remote(**kw):
    from shardkit.remote.storage import RemoteStorage

    return RemoteStorage(**kw)


def test_every_retired_keyword_has_an_alias_test():
    assert set(ALIASES) == set(GROUPS)


@pytest.mark.parametrize("keyword", sorted(ALIASES))
def test_retired_keyword_gives_the_new_calls_samples_and_state(keyword, sets, tmp_path):
    old_kw, new_kw = (dict(d) for d in ALIASES[keyword])
    path = sets["clip"]
    if GROUPS[keyword] == "storage":
        path = "file://" + path
        if "cache_dir" in old_kw:
            old_kw["cache_dir"] = str(tmp_path / "old")
        new_kw["storage"] = new_kw["storage"](tmp_path)
    old, message = _old(path, **old_kw)
    source = new_kw.pop("source", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = ShardDataset(source(path) if source else path, with_keys=True, seed=3, **new_kw)
    assert old.decode == new.decode and old.order == new.order
    # the warning names the keyword and prints the new spelling
    assert f"{keyword}=" in message and "write ShardDataset(" in message
    old.set_epoch(1)
    new.set_epoch(1)
    assert _read(old, 7) == _read(new, 7)
    assert _read(old) == _read(new)  # a whole epoch, and the state at its end


def test_the_warning_spells_the_new_call(sets):
    _, message = _old(sets["clip"], decode="tensor", size=8, crop="random", shuffle=False)
    assert "decode=Decode('tensor', crop=RandomResizedCrop(size=8" in message
    assert "order=Order(shuffle=False)" in message


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        (dict(size=8), dict(decode=Decode()), ("size=", "decode=Decode")),
        (dict(flip=True, dct="fast"), dict(decode=Decode()), ("flip=", "dct=", "decode=Decode")),
        (dict(shuffle=False), dict(order=Order()), ("shuffle=", "order=Order")),
        (dict(cache_dir="x"), dict(storage=LocalStorage()), ("cache_dir=", "storage=")),
    ],
)
def test_an_old_and_a_new_spelling_of_one_group_are_refused_by_name(sets, old, new, names):
    with pytest.raises(InputError) as err:
        ShardDataset(sets["clip"], **old, **new)
    text = str(err.value)
    assert "\n" not in text and all(n in text for n in names)


def test_selection_keywords_with_sources_are_refused(sets):
    with pytest.raises(InputError, match="give subset= and split= to each Source"):
        ShardDataset(Source(sets["clip"]), subset=0.5)


def test_an_unknown_keyword_is_named(sets):
    with pytest.raises(InputError, match="unknown keyword sise="):
        ShardDataset(sets["clip"], sise=8)


def test_the_signature_has_at_most_18_named_parameters():
    import inspect

    params = inspect.signature(ShardDataset.__init__).parameters
    named = [p for p in params.values() if p.kind is not p.VAR_KEYWORD and p.name != "self"]
    assert len(named) <= 18


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Decode("jpeg"), "mode='jpeg'"),
        (lambda: Decode(dct="slow"), "dct='slow'"),
        (lambda: Decode(max_pixels=0), "max_pixels=0"),
        (lambda: Decode(flip=True), "flip=True"),
        (lambda: Decode(crop="random"), "crop='random'"),
        (lambda: Decode("pil", crop=CenterCrop(8)), 'mode="tensor"'),
        (lambda: Decode(crop=object()), "crop="),
        (lambda: Order(buffer_size=-1), "buffer_size=-1"),
        (lambda: Order(equalize="even"), "equalize='even'"),
        (lambda: Order(shuffle="yes"), "shuffle='yes'"),
        (lambda: Source("x", fields="txt"), "fields='txt'"),
    ],
)
def test_the_objects_check_themselves_in_one_line(make, words):
    with pytest.raises(InputError) as err:
        make()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_decode_and_order_are_frozen_values():
    d, o = Decode(crop=RandomResizedCrop(8)), Order.sequential()
    assert d == Decode(crop=RandomResizedCrop(8)) and d.size == 8
    assert o == Order(shuffle=False, equalize="none")
    with pytest.raises(AttributeError):
        d.mode = "pil"


def test_a_mode_string_is_its_decode(sets):
    ds = ShardDataset(sets["clip"], decode="tensor")
    assert ds.decode == Decode("tensor") and ds.order == Order()


# --- storage and plan() for mixtures ----------------------------------------------------------


def test_a_mixture_takes_storage_each_source_its_own_copy(sets):
    sources = [Source(sets["clip"], weight=2), Source(sets["cls"], weight=1)]
    storage = LocalStorage(latency_ms=0)
    ds = ShardDataset(sources, storage=storage, with_keys=True, decode="raw", epoch_size=30)
    plain = ShardDataset(sources, with_keys=True, decode="raw", epoch_size=30)
    stores = [s.storage for s in ds.sources]
    assert all(isinstance(s, LocalStorage) for s in stores) and stores[0] is not stores[1]
    assert list(ds) == list(plain)


def test_one_remote_storage_serves_a_mixture_of_urls_and_paths(sets, tmp_path):
    remote = _remote(cache_dir=tmp_path / "cache")
    sources = [Source("file://" + sets["clip"]), Source(sets["cls"])]
    ds = ShardDataset(sources, storage=remote, with_keys=True, decode="raw")
    plain = ShardDataset(
        [Source("file://" + sets["clip"]), Source(sets["cls"])], with_keys=True, decode="raw"
    )
    assert type(ds.sources[0].storage).__name__ == "RemoteStorage"
    assert ds.sources[0].storage is not remote  # a copy: configuration only
    assert isinstance(ds.sources[1].storage, LocalStorage)
    assert list(ds) == list(plain)


def test_plan_answers_for_a_mixture(sets):
    ds = ShardDataset(Source(sets["clip"], subset=0.5), order=Order.sequential())
    slices = ds.plan()  # the runs it reads: a subset's samples and the few between them
    assert len(ds) == N_CLIP // 2 <= sum(len(s) for s in slices) < N_CLIP
    assert all(0 <= s.shard < len(ds.shards) for s in slices)
    mix = ShardDataset([Source(sets["clip"]), Source(sets["cls"])], order=Order.sequential())
    slices = mix.plan()
    assert sum(len(s) for s in slices) == len(mix) == N_CLIP + N_CLS
    assert {s.shard for s in slices} == set(range(len(mix.shards)))


# --- fields per source ------------------------------------------------------------------------


def _clip_and_cls(sets, **kw):
    sources = [Source(sets["clip"], weight=0.5), Source(sets["cls"], weight=0.5, fields=())]
    return ShardDataset(sources, decode="tensor", fields=("txt",), with_keys=True, **kw)


def test_a_captioned_and_an_uncaptioned_set_mix(sets):
    samples = list(_clip_and_cls(sets, epoch_size=40))
    by_source = {0: [], 1: []}
    for _img, _label, key, txt in samples:
        by_source[0 if txt is not None else 1].append((key, txt))
    assert len(by_source[0]) == len(by_source[1]) == 20
    assert all(t.startswith("caption ") for _, t in by_source[0])
    # without the declaration, a missing field stays an error naming shard and key
    strict = [Source(sets["clip"]), Source(sets["cls"])]
    with pytest.raises(SampleError, match=r"has no 'txt' field"):
        list(ShardDataset(strict, decode="tensor", fields=("txt",)))


def test_a_captioned_and_an_uncaptioned_set_mix_through_the_loader(sets):
    expected = {key: txt for _i, _l, key, txt in _clip_and_cls(sets, epoch_size=40)}
    loader = ShardLoader(_clip_and_cls(sets, epoch_size=40), 8, num_workers=1)
    seen = {}
    for batch in loader:
        assert batch["image"].shape == (len(batch["key"]), 3, 14, 18)
        seen.update(zip(batch["key"], batch["txt"], strict=True))
    assert seen == expected and None in seen.values()
    loader.close()


def test_a_source_cannot_leave_out_a_mask(sets):
    sources = [Source(sets["clip"]), Source(sets["cls"], fields=())]
    with pytest.raises(InputError, match=r"leaves out 'seg.png'.*mask"):
        ShardDataset(sources, decode=Decode(crop=CenterCrop(8, 8)), fields=("seg.png",))


# --- the groups combined ----------------------------------------------------------------------

DECODES = ["raw", "pil", "tensor", Decode(crop=RandomResizedCrop(8), flip=True)]
ORDERS = [Order(), Order.sequential()]
SELECTIONS = ["plain", "subset", "mixture"]
STORAGES = [None, LocalStorage()]
FIELDS = [(), ("txt",)]
SAMPLE_TRANSFORMS = [None, lambda s: (s["image"], s["label"], s["seed"])]


def _selection(sets, how):
    if how == "plain":
        return sets["clip"]
    if how == "subset":
        return Source(sets["clip"], subset=0.5)
    return [Source(sets["clip"]), Source(sets["cls"], fields=())]


def test_the_option_groups_combine(sets):
    """Every combination of decode x order x selection x storage x fields x sample_transform
    reads samples, or refuses at construction by naming an option."""
    worked = 0
    for decode, order, how, storage, fields, st in itertools.product(
        DECODES, ORDERS, SELECTIONS, STORAGES, FIELDS, SAMPLE_TRANSFORMS
    ):
        kw = dict(decode=decode, order=order, storage=storage, fields=fields)
        try:
            ds = ShardDataset(_selection(sets, how), sample_transform=st, seed=1, **kw)
        except InputError as exc:
            assert any(f"{name}=" in str(exc) for name in (*kw, "sample_transform")), exc
            continue
        got = list(itertools.islice(iter(ds), 3))
        assert len(got) == 3, kw
        if st is not None:
            assert all(isinstance(s[2], int) for s in got)
        worked += 1
    assert worked == len(DECODES) * len(ORDERS) * 3 * 2 * 2 * 2


# --- one Decode through every reader ----------------------------------------------------------


def test_folder_view_and_stream_take_the_same_decode(sets):
    from shardkit import FolderDataset, ShardView

    decode = Decode(crop=CenterCrop(8, resize_short=10))
    stream = {k: img for img, _, k in ShardDataset(sets["clip"], decode=decode, with_keys=True)}
    view = ShardView(sets["clip"], decode=decode, with_keys=True)
    folder = FolderDataset(sets["clip"] + "-src", decode=decode, with_keys=True)
    assert view.decode == folder.decode == decode
    for i in (0, 5):
        image, _, key = view[i]
        assert image.shape == (3, 8, 8) and torch.equal(image, stream[key])
    for i in (0, 5):
        image, _, rel = folder[i]
        assert torch.equal(image, stream[rel.rsplit(".", 1)[0]])
    with pytest.warns(FutureWarning, match=r"FolderDataset\(size=8\)"):
        old = FolderDataset(sets["clip"] + "-src", decode="tensor", size=8)
    assert old.decode == Decode(crop=CenterCrop(8, 8))
    with pytest.raises(InputError, match="unknown keyword shuffle="):
        FolderDataset(sets["clip"] + "-src", shuffle=False)


def test_the_decode_travels_whole_into_every_decoder(sets):
    """Below the constructors a ``Decode`` stays one value: the folder, the view, the records'
    decoder and the fields' decoding read its mode, ``max_pixels`` and ``dct`` from it, so a
    fast IDCT without a crop reaches each of them (``decode_records`` once dropped it)."""
    import inspect

    from shardkit import FolderDataset, ShardView
    from shardkit.images.decode import decode_image
    from shardkit.records import Record
    from shardkit.stream.stages import decode_records, decoded_fields

    params = list(inspect.signature(decoded_fields).parameters)
    assert params == ["rec", "names", "decoders", "image"]  # the image's Decode, not its limit
    fast = Decode("tensor", dct="fast")
    folder = FolderDataset(sets["clip"] + "-src", decode=fast, with_keys=True)
    image, _, rel = folder[3]
    with open(f"{folder.root}/{rel}", "rb") as f:
        data = f.read()
    want = decode_image(data, "tensor", fast_dct=True)
    assert not torch.equal(want, decode_image(data, "tensor"))  # these JPEGs tell them apart
    assert torch.equal(fast.image(data), want) and torch.equal(image, want)
    [(got, _)] = decode_records([Record(rel, "jpg", data, 0, "s.tar")], fast)
    assert torch.equal(got, want)
    view = ShardView(sets["clip"], decode=fast, with_keys=True)
    key = rel.rsplit(".", 1)[0]
    assert torch.equal(view.get(key)[0], want)


def test_a_folder_takes_a_source_and_its_split_selects_the_packed_split(sets):
    from shardkit import FolderDataset
    from shardkit.remote import RemoteStorage

    root = sets["clip"] + "-src"
    plain = FolderDataset(Source(root), decode="raw", with_keys=True)
    assert [plain.relpath(i) for i in range(len(plain))] == [
        FolderDataset(root).relpath(i) for i in range(len(plain))
    ]
    for split in ("val", "train"):
        folder = FolderDataset(Source(root, split=split, val_fraction=0.3), with_keys=True)
        packed = ShardDataset(Source(sets["clip"], split=split, val_fraction=0.3), with_keys=True)
        keys = sorted(folder.relpath(i).rsplit(".", 1)[0] for i in range(len(folder)))
        assert 0 < len(keys) < N_CLIP and keys == sorted(k for *_, k in packed)
    refused = {"subset": 0.5, "weight": 2.0, "fields": (), "storage_options": {}}
    for option, value in refused.items():
        with pytest.raises(InputError, match=f"{option}=...\\)\\): .* cannot take effect: "):
            FolderDataset(Source(root, **{option: value}))
    with pytest.raises(InputError, match="a folder is local: leave storage out"):
        FolderDataset(root, storage=RemoteStorage())


def test_the_loader_reads_the_dataset_through_its_seam_only(sets):
    """ShardLoader (its consumer and its in-process workers) reads the dataset's options and
    epoch calls through ``seam()``: no private attribute and none of the loose ones."""
    import sys

    seen: set[str] = set()

    class Watched(ShardDataset):
        def __getattribute__(self, name):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("shardkit.loader") and not name.startswith("__"):
                seen.add(name)
            return super().__getattribute__(name)

    ds = Watched(sets["clip"], decode=Decode(crop=CenterCrop(8, 8)), fields=("txt",))
    loader = ShardLoader(ds, 4, num_workers=0)
    batch = next(iter(loader))
    assert batch["image"].shape == (4, 3, 8, 8)
    loader.close()
    assert "seam" in seen
    assert not {n for n in seen if n.startswith("_")}, seen
    loose = {"geometry", "max_pixels", "dct", "shuffle", "buffer_size", "equalize", "fields"}
    assert not seen & loose, seen & loose
