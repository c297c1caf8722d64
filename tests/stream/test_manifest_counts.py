"""A shard is never skipped on its manifest's word alone: an entry that says 0 samples for a
shard that holds some is the one-line error a count too high gives, in every kind of epoch,
where the epoch used to be short by that shard without a word."""

from __future__ import annotations

import json
import os

import pytest
from conftest import quiet, random_tree

from shardkit import Order, ShardDataset, Source
from shardkit.errors import ShardFormatError
from shardkit.formats import get_format
from shardkit.manifest import Manifest, read_manifest, write_manifest
from shardkit.write.packer import pack

EPOCHS = {
    "plain": {},
    "split": {"split": "val", "val_fraction": 0.5},
    "subset": {"subset": 0.5},
}


def _packed(tmp_path, fmt: str) -> str:
    """14 samples in shards of a few each."""
    out = str(tmp_path / fmt)
    quiet(pack, random_tree(tmp_path / "src", 14), out, format=fmt, shard_size="2kB",
          progress=False)  # fmt: skip
    assert len(read_manifest(out).shards) >= 3
    return out


def _say_zero(out: str, i: int) -> str:
    """Shard ``i``'s entry says 0 samples, the total agreeing (as a tool that recomputes the
    totals from the entries would leave it); the shard's path."""
    path = os.path.join(out, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    doc["num_samples"] -= doc["shards"][i]["samples"]
    doc["shards"][i]["samples"] = 0
    with open(path, "w") as f:
        json.dump(doc, f)
    return doc["shards"][i]["path"]


@pytest.mark.parametrize("epoch", list(EPOCHS))
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
@pytest.mark.parametrize("which", [0, -1], ids=["first", "last"])
def test_a_shard_whose_entry_says_zero_is_an_error_not_a_short_epoch(tmp_path, fmt, epoch, which):
    out = _packed(tmp_path, fmt)
    name = _say_zero(out, which)
    with pytest.raises(ShardFormatError) as err:
        list(ShardDataset(Source(out, **EPOCHS[epoch]), decode="raw"))
    message = str(err.value)
    assert name in message and "\n" not in message
    assert "holds more samples than the 0 its manifest" in message  # a count too high's words


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_shard_that_is_empty_indeed_is_read_as_empty(tmp_path, fmt):
    """The check reads the shard; one that holds nothing, as its entry says, is no error."""
    out = _packed(tmp_path, fmt)
    manifest = read_manifest(out)
    name = f"shard-empty.{fmt}"
    stats = get_format(fmt).open_writer(os.path.join(out, name)).close()
    entry = type(manifest.shards[0])(name, 0, stats.bytes, stats.sha256)
    write_manifest(
        Manifest(fmt, manifest.classes, [*manifest.shards, entry], pack=manifest.pack), out
    )
    whole = list(ShardDataset(out, decode="raw", order=Order(shuffle=False)))
    assert len(whole) == 14
    assert len(list(quiet(ShardDataset, Source(out, subset=0.5), decode="raw"))) == 7


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_view_refuses_an_entry_that_says_zero(tmp_path, fmt):
    from shardkit import ShardView

    out = _packed(tmp_path, fmt)
    name = _say_zero(out, 1)
    with pytest.raises(ShardFormatError, match="holds more samples than the 0") as err:
        ShardView(out, decode="raw")
    assert name in str(err.value)
