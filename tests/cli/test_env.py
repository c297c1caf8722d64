"""SHARDKIT_<COMMAND>_<OPTION>: every documented variable reaches its option; unknown ones warn.

Each option's value is resolved by click from the environment alone (no flag given), so a name
that click would not read keeps the option at its default and fails here.
"""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from PIL import Image

from shardkit.cli import ENV_VARS, LIBRARY_ENV, main
from shardkit.manifest import read_manifest

#: A value per option that differs from its default, by flag (None: a flag, set to its opposite).
VALUES = {
    "--format": "lmdb",
    "--shard-size": "1MB",
    "--seed": "7",
    "--threads": "3",
    "--on-error": "raise",
    "--resize-short": "64",
    "--validate": "decode",
    "--scale": "0.5",
    "--size": "32",
    "--classes": "3",
    "--images-per-class": "4",
    "--workers": "0,2",
    "--data": "some/folder",
    "--shards": "some/shards-{format}",
    "--formats": "tar,lmdb",
    "--batch-size": "16",
    "--batches": "3",
    "--min-samples": "10",
    "--min-seconds": "0.5",
    "--max-seconds": "9",
    "--repeats": "2",
    "--latency-ms": "2",
    "--mode": "raw",
    "--step-ms": "5",
    "--json": "b.json",
    "--plot": "b.png",
    "--timeline": "t.png",
    "--timeline-config": "tar:2",
    "--head": "3",
    "--offset": "2",
    "--limit": "3",
    "--prefix": "a/",
    "--index": "1",
    "--key": "a/k1",
    "--to": "some/folder",
    "--root": "some/root",
    "--engine": "local",
    "--processes": "3",
    "--ray-address": "auto",
    "--shards-per-task": "2",
    "--plan-only": "plan.json",
    "--task": "1",
}


def _commands(group: click.Group, path=()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


CASES = [
    (path, param)
    for path, cmd in _commands(main)
    for param in cmd.params
    if isinstance(param, click.Option) and param.envvar
]


def test_every_option_has_a_variable_named_after_its_command_and_flag():
    assert ENV_VARS["SHARDKIT_PACK_FORMAT"] == "pack --format"
    assert ENV_VARS["SHARDKIT_BENCH_JSON"] == "bench --json"
    assert ENV_VARS["SHARDKIT_SYNTH_LFW_SCALE"] == "lfw --scale"
    assert len(CASES) == len(ENV_VARS) > 40
    for path, param in CASES:
        flag = max(param.opts, key=len)
        expected = "_".join(("SHARDKIT", *path, flag.lstrip("-"))).upper().replace("-", "_")
        assert param.envvar == expected


@pytest.mark.parametrize("path, param", CASES, ids=[p.envvar for _, p in CASES])
def test_each_variable_sets_its_option(path, param, monkeypatch):
    group = main
    for name in path[:-1]:
        group = group.commands[name]
    cmd = group.commands[path[-1]]
    args = {
        "pack": ["SRC", "OUT"],
        "index": ["."],
        "bench": [],
        "show": ["OUT", "KEY"],
        "merge": ["A", "B", "OUT"],
    }.get(path[-1], ["OUT"])

    if path[-1] == "pack-task" and not param.required:
        args = [*args, "--task", "0"]  # the required option, given on the command line

    def resolve():
        return cmd.make_context(path[-1], list(args), parent=click.Context(main))

    default = None if param.required else resolve().params[param.name]
    raw = ("0" if default else "1") if param.is_flag else VALUES[max(param.opts, key=len)]
    monkeypatch.setenv(param.envvar, raw)
    sub = resolve()
    value = sub.params[param.name]
    assert value != default
    assert value == (raw == "1" if param.is_flag else param.type_cast_value(sub, raw))


def _tree(root):
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (16, 16), (c * 90, i * 40, 0)).save(root / f"c{c}" / f"{i}.jpg")


def test_pack_format_from_the_environment_packs_lmdb(tmp_path):
    _tree(tmp_path / "src")
    res = CliRunner().invoke(
        main,
        ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "-q"],
        env={"SHARDKIT_PACK_FORMAT": "lmdb"},
    )
    assert res.exit_code == 0, res.output
    assert read_manifest(str(tmp_path / "out")).shard_format == "lmdb"
    assert "warning" not in res.output


def test_an_unknown_shardkit_variable_is_warned_about_with_the_likely_name(tmp_path):
    _tree(tmp_path / "src")
    res = CliRunner().invoke(
        main,
        ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "-q"],
        env={"SHARDKIT_PACK_FMT": "lmdb", **dict.fromkeys(LIBRARY_ENV, "1")},
    )
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: SHARDKIT_PACK_FMT is not a shardkit variable, ignored; did you mean "
        "SHARDKIT_PACK_FORMAT?"
    ]
    assert read_manifest(str(tmp_path / "out")).shard_format == "tar"


def test_a_bad_value_names_the_variable_only_when_it_came_from_it():
    runner = CliRunner()
    from_env = runner.invoke(main, ["bench"], env={"SHARDKIT_BENCH_FORMATS": "zip"})
    assert from_env.exit_code == 2
    assert "Invalid value for '--formats' (from SHARDKIT_BENCH_FORMATS)" in from_env.output
    from_flag = runner.invoke(main, ["bench", "--formats", "zip"])
    assert "Invalid value for '--formats': unknown format" in from_flag.output


def test_the_library_variables_listed_are_the_ones_the_library_reads():
    from shardkit.progress import INTERVAL_ENV
    from shardkit.synth.build import SCALE_ENV

    assert set(LIBRARY_ENV) == {INTERVAL_ENV, SCALE_ENV}
