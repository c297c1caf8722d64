"""Every option value is defined: it takes effect, or it is a one-line ``InputError`` at
construction naming the option and what to give instead. Nothing is accepted and ignored,
nothing is truncated (``2.9`` is not 2), and no NaN, infinity, bool or negative number gets
through to fail later with a traceback, or to make a working server look broken.

Beside them, the retired keywords: they warn with ``FutureWarning`` (which Python shows in
imported modules, unlike ``DeprecationWarning``), and an unknown keyword is a ``TypeError`` as
Python's own functions raise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from shardkit import (
    Decode,
    FolderDataset,
    InputError,
    Order,
    RandomResizedCrop,
    ShardDataset,
    ShardLoader,
    ShardView,
    Source,
)
from shardkit.remote.storage import RemoteStorage
from shardkit.write.packer import pack

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """Six small JPEGs in two classes, packed into tar shards."""
    base = tmp_path_factory.mktemp("values")
    for i in range(6):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(d / f"{i}.jpg")
    pack(str(base / "src"), str(base / "out"), progress=False)
    return str(base / "out")


def _refused(make, *words: str) -> None:
    with pytest.raises(InputError) as err:
        make()
    text = str(err.value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, (w, text)


# --- each combination either takes effect or is refused ------------------------------------


def test_decode_left_without_a_mode_is_the_readers_default(shards):
    """``Decode(max_pixels=None)`` lifts the pixel limit and nothing else: the images stay the
    PIL images ``ShardDataset``'s own default gives."""
    assert Decode().mode == Decode(max_pixels=None).mode == "pil"
    assert Decode(crop=RandomResizedCrop(8)).mode == "tensor"  # only a tensor can be cropped
    assert Decode(dct="fast").mode == "tensor"  # only the tensor decoder has it
    plain = next(iter(ShardDataset(shards)))[0]
    unlimited = next(iter(ShardDataset(shards, decode=Decode(max_pixels=None))))[0]
    assert type(unlimited) is type(plain) and isinstance(plain, Image.Image)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Decode("pil", dct="fast"), ('dct="fast"', 'Decode("tensor", dct="fast")')),
        (lambda: Decode("raw", dct="fast"), ('dct="fast"', 'Decode("tensor", dct="fast")')),
        (lambda: Order(shuffle=False, buffer_size=8), ("buffer_size=8", "leave buffer_size out")),
        (lambda: Order(shuffle=False, buffer_size=0), ("buffer_size=0",)),
        (lambda: Source("x/", val_fraction=0.2), ("val_fraction=0.2", "split=")),
        (lambda: Source("x/", subset=0.5, val_fraction=0.2), ("val_fraction=0.2", "split=")),
    ],
    ids=["pil-fast-dct", "raw-fast-dct", "unshuffled-buffer", "unshuffled-buffer-0",
         "val-fraction-without-split", "val-fraction-with-subset"],
)  # fmt: skip
def test_an_option_that_would_do_nothing_is_refused(make, words):
    _refused(make, *words)


def test_the_default_given_again_is_no_conflict():
    """Only a value that would be kept unused is refused: the default given again is what
    leaving it out records, so ``dataclasses.replace`` on these values still works."""
    from dataclasses import replace

    assert replace(Order(), shuffle=False) == Order(shuffle=False)
    assert Order(shuffle=False).buffer_size == Order().buffer_size  # the checkpoint's facts
    assert replace(Source("x/"), weight=2.0).weight == 2.0


def test_a_mixtures_fsspec_options_in_two_places_are_refused(shards):
    sources = [Source(shards, storage_options={"anon": True}), Source(shards)]
    storage = RemoteStorage(storage_options={"anon": False})
    _refused(lambda: ShardDataset(sources, storage=storage), "storage_options=", "one place")
    # in one place each, both are taken
    assert len(ShardDataset(sources, storage=RemoteStorage(cache_dir=None))) == 12


def test_the_datasets_batch_size_differing_from_the_loaders_is_refused(shards):
    ds = ShardDataset(shards, decode="tensor", batch_size=4)
    _refused(lambda: ShardLoader(ds, 2, num_workers=0), "batch_size=4", "batch_size=2")
    assert ShardLoader(ds, 4, num_workers=0).batch_size == 4  # the same: one value, taken


# --- numbers: NaN, infinity, bools, negatives and floats for ints --------------------------


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"prefetch": NAN}, "prefetch=nan"),
        ({"prefetch": 2.9}, "prefetch=2.9"),
        ({"prefetch": True}, "prefetch=True"),
        ({"retries": NAN}, "retries=nan"),
        ({"retries": INF}, "retries=inf"),
        ({"retries": 1.5}, "retries=1.5"),
        ({"ranged_gets": INF}, "ranged_gets=inf"),
        ({"ranged_gap": -1}, "ranged_gap=-1"),
        ({"ranged_gap": "near"}, "ranged_gap='near'"),
        ({"chunk": 0}, "chunk=0"),
        ({"chunk": 1.5}, "chunk=1.5"),
        ({"timeout": NAN}, "timeout=nan"),
        ({"timeout": 0}, "timeout=0"),
        ({"timeout": INF}, "timeout=inf"),
        ({"backoff": -1}, "backoff=-1"),
        ({"max_backoff": NAN}, "max_backoff=nan"),
        ({"storage_options": 5}, "storage_options=5"),
        ({"verify": "yes"}, "verify='yes'"),
        ({"cache_dir": 5}, "cache_dir=5"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_remote_storage_checks_every_value(kw, words):
    _refused(lambda: RemoteStorage(**kw), words)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"seed": NAN}, "seed=nan"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 1.7}, "seed=1.7"),
        ({"seed": True}, "seed=True"),
        ({"batch_size": NAN}, "batch_size=nan"),
        ({"batch_size": 2.5}, "batch_size=2.5"),
        ({"rank": 0.5, "world_size": 2}, "rank=0.5"),
        ({"rank": 0, "world_size": 2.0}, "world_size=2.0"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_the_dataset_checks_its_numbers(shards, kw, words):
    _refused(lambda: ShardDataset(shards, **kw), words)


def test_no_source_is_refused_by_name():
    _refused(lambda: ShardDataset(None), "source=None")


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Order(buffer_size=2**63), "buffer_size=9223372036854775808"),
        (lambda: Source(None), "Source(None)"),
        (lambda: Source(5), "Source(5)"),
        (lambda: Source("x/", storage_options=5), "storage_options=5"),
    ],
    ids=["buffer-2**63", "source-none", "source-int", "source-options"],
)  # fmt: skip
def test_order_and_source_check_their_values(make, words):
    _refused(make, words)


@pytest.mark.parametrize(
    "normalize",
    [((NAN, 0.5, 0.5), (0.2, 0.2, 0.2)), ((0.5, 0.5, 0.5), (0.2, INF, 0.2))],
    ids=["nan-mean", "inf-std"],
)
def test_normalize_with_a_nan_or_inf_is_refused(shards, normalize):
    ds = ShardDataset(shards, decode="tensor")
    _refused(lambda: ShardLoader(ds, 2, num_workers=0, normalize=normalize), "normalize")


@pytest.mark.parametrize(
    ("kw", "words"),
    [({"num_workers": 1.5}, "num_workers=1.5"), ({"prefetch_factor": 2.0}, "prefetch_factor=2.0")],
    ids=["workers-float", "prefetch-float"],
)
def test_the_loader_checks_its_numbers(shards, kw, words):
    ds = ShardDataset(shards, decode="tensor")
    _refused(lambda: ShardLoader(ds, 2, **kw), words)


# --- keywords: unknown ones, retired ones ------------------------------------------------


@pytest.mark.parametrize("make", [ShardDataset, FolderDataset], ids=["dataset", "folder"])
def test_an_unknown_keyword_is_a_type_error_and_an_input_error(shards, tmp_path, make):
    where = shards if make is ShardDataset else str(tmp_path)
    with pytest.raises(TypeError, match="unknown keyword sise=") as err:
        make(where, sise=8)
    assert isinstance(err.value, InputError)


def test_a_retired_keyword_warns_as_a_future_warning_naming_the_new_spelling(shards):
    with pytest.warns(FutureWarning, match=r"write ShardDataset\(order=Order\(shuffle=False\)\)"):
        ShardDataset(shards, shuffle=False)


def test_the_views_retired_no_pixel_limit_works_again(shards):
    with pytest.warns(FutureWarning, match=r"max_pixels=None"):
        view = ShardView(shards, max_pixels=None)
    assert view.decode.max_pixels is None and view.decode.mode == "pil"
    assert ShardView(shards).decode.max_pixels == Decode().max_pixels  # left out: the default


def test_old_keywords_that_did_nothing_are_dropped_by_the_translation(shards):
    """``shuffle=False, buffer_size=4`` and ``subset=, val_fraction=`` (no split) still load,
    as the objects the new spelling gives (the warning prints it without the unused value)."""
    with pytest.warns(FutureWarning) as caught:
        ds = ShardDataset(shards, shuffle=False, buffer_size=4)
    assert ds.order == Order(shuffle=False)
    assert "write ShardDataset(order=Order(shuffle=False))" in str(caught[0].message)
    with pytest.warns(FutureWarning, match=r"write ShardDataset\(Source\(path, subset=0.5\)\)"):
        sub = ShardDataset(shards, subset=0.5, val_fraction=0.3)
    assert sub.sources[0].source == Source(shards, subset=0.5)
    assert math.isclose(sub.sources[0].source.val_fraction, 0.1)
