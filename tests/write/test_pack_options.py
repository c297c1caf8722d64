"""``pack``'s options as one value: ``PackOptions``, with ``pack``'s keywords as its fields."""

from __future__ import annotations

import inspect

import pytest
from conftest import image_tree

from shardkit import InputError, PackOptions, pack
from shardkit.manifest import read_manifest
from shardkit.write import packer
from shardkit.write.plan import plan_pack
from shardkit.write.read import pack_options


def _shards(out) -> list[tuple[str, int, str]]:
    return [(e.path, e.samples, e.sha256) for e in read_manifest(str(out)).shards]


@pytest.mark.filterwarnings("ignore::shardkit.write.writer.ShardSizeWarning")
def test_pack_options_and_keywords_pack_the_same(tmp_path):
    src = image_tree(tmp_path / "src", 30)
    options = PackOptions(shard_size=12000, format="lmdb", seed=4, progress=False)
    a = pack(str(src), str(tmp_path / "a"), options)
    b = pack(str(src), str(tmp_path / "b"), shard_size=12000, format="lmdb", seed=4, progress=False)
    assert a.shards == b.shards > 1 and _shards(tmp_path / "a") == _shards(tmp_path / "b")
    # keywords set fields of the options given
    c = pack(str(src), str(tmp_path / "c"), options, format="tar")
    assert c.format == "tar" and c.samples == a.samples


def test_pack_options_check_themselves_and_name_unknown_keywords(tmp_path):
    with pytest.raises(InputError, match="validate='bogus'"):
        PackOptions(validate="bogus")
    with pytest.raises(InputError, match="unknown keyword shardsize="):
        pack(str(tmp_path), str(tmp_path / "out"), shardsize="1MB")
    with pytest.raises(InputError, match="PackOptions"):
        pack(str(tmp_path), str(tmp_path / "out"), {"format": "tar"})


def test_the_planned_pack_takes_the_options_whole():
    """The pack hands ``PackOptions`` on whole to what writes it (a folder's plan and run,
    a folder into a URL, a Python source's run), not its fields one by one or a dict of them
    (``seen``: the output's manifest as the up-to-date check read it, not an option)."""
    for fn, params in (
        (packer._pack_planned, ["src", "out", "o", "started", "seen"]),
        (packer._pack_to_url, ["src", "writer", "o", "started"]),
        (packer._samples_run, ["source", "writer", "o"]),
        (packer._already_packed, ["src", "out", "o", "seen"]),
        (packer._already_packed_url, ["src", "out", "o"]),
        (packer._write, ["run", "writer", "o"]),
        (packer._samples.tasks, ["source", "o", "size"]),
        (plan_pack, ["src", "out", "o", "existing", "engine"]),
    ):
        assert list(inspect.signature(fn).parameters) == params, fn.__name__


def test_the_planner_plans_from_the_options_whole_what_pack_packs(tmp_path):
    """``plan_pack`` takes the ``PackOptions`` ``pack`` was given: its plan has the fingerprint
    and options the packed manifest records; its fields as loose keywords are refused."""
    src = str(image_tree(tmp_path / "src", 12))
    options = PackOptions(shard_size=12000, seed=4, resize_short=16, progress=False)
    plan = plan_pack(src, str(tmp_path / "o"), options)
    assert plan.options == pack_options(options)
    pack(src, str(tmp_path / "a"), options)
    packed = read_manifest(str(tmp_path / "a")).pack
    assert plan.fingerprint == packed["source_fingerprint"]
    assert {k: packed[k] for k in ("seed", "resize_short", "shard_size")} == {
        "seed": 4,
        "resize_short": 16,
        "shard_size": 12000,
    }
    with pytest.raises(TypeError):
        plan_pack(src, str(tmp_path / "o"), shard_size=12000, format="tar", shuffle=True)
    with pytest.raises(InputError, match="PackOptions"):
        plan_pack(src, str(tmp_path / "o"), {"format": "tar"})
