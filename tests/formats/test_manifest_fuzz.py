"""Fuzzed manifest.json: any input loads, streams, or raises a ShardkitError.

Structure-aware: a valid manifest of a real packed dataset has one to three of its values
replaced by something hostile (wrong types, huge, negative or float numbers, 1e400, NaN, deep
nesting, NUL / ``..`` / absolute paths, missing keys). The fuzz runs in a child process under
``RLIMIT_AS`` and ``RLIMIT_CPU``, so a parser that allocates what a value claims or loops on it
fails the test by running out of its budget, without any wall-clock threshold.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit import Order
from shardkit.errors import ShardkitError
from shardkit.manifest import Manifest

#: Raw JSON text for values ``json.dumps`` cannot write (placed by sentinel strings).
_RAW = {
    "__HUGE_FLOAT__": "1e400",
    "__NEG_HUGE__": "-1e400",
    "__NAN__": "NaN",
    "__INF__": "Infinity",
    "__DEEP_LIST__": "[" * 50_000 + "]" * 50_000,
    "__DEEP_DICT__": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "__BIG_INT__": "9" * 5000,
}

_HOSTILE = st.one_of(
    st.sampled_from(sorted(_RAW)),
    st.sampled_from([None, True, False, "", "abc", [], {}, [1, 2], {"a": 1}]),
    st.sampled_from([0, -1, -(2**63), 2**63, 2**64 + 1, 10**30, 0.5, -0.0, 1e308]),
    st.sampled_from(
        ["a\x00b", "..", "../x", "/etc/passwd", "a/../../b", "shard-000000.tar\x00", "\\x", "."]
    ),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.lists(st.integers(-(2**70), 2**70), max_size=5),
)


def _paths(doc, prefix=()):
    """Every location in the document: dict keys and list positions, depth first."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@st.composite
def hostile_manifests(draw, base: dict) -> str:
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        locations = [p for p in _paths(doc) if p]
        if not locations:
            break
        where = draw(st.sampled_from(locations))
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.integers(0, 4)) == 0:
            del parent[where[-1]]  # a missing key
        else:
            parent[where[-1]] = draw(_HOSTILE)
    if draw(st.integers(0, 9)) == 0:
        doc = draw(_HOSTILE)  # the whole document
    return json.dumps(doc)  # sentinels still in: hypothesis reports short examples


def _raw(text: str) -> str:
    for sentinel, raw in _RAW.items():
        text = text.replace(json.dumps(sentinel), raw)
    return text


def _check_loaded(m: Manifest) -> None:
    """What a manifest that loads promises its readers."""
    assert isinstance(m.classes, list) and all(isinstance(c, str) for c in m.classes)
    total = 0
    for s in m.shards:
        assert isinstance(s.path, str) and s.path and "\x00" not in s.path
        assert not os.path.isabs(s.path) and ".." not in s.path.split("/")
        assert isinstance(s.samples, int) and s.samples >= 0
        assert isinstance(s.bytes, int) and s.bytes >= 0
        total += s.samples
    assert m.num_samples == total


def fuzz(root: str, examples: int) -> None:
    """The fuzz itself; runs in the child process started below."""
    from shardkit import ShardDataset

    with open(os.path.join(root, "manifest.json"), encoding="utf-8") as f:
        base = json.load(f)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(text=hostile_manifests(base))
    def run(text):
        text = _raw(text)
        try:
            manifest = Manifest.from_json(text, source="fuzzed.json")
        except ShardkitError:
            return
        _check_loaded(manifest)
        with open(os.path.join(root, "manifest.json"), "w", encoding="utf-8") as f:
            f.write(text)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                n = sum(1 for _ in ShardDataset(root, order=Order(shuffle=False), decode="raw"))
        except ShardkitError:
            return
        assert n == manifest.num_samples  # streamed: exactly what it promised

    run()


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # ~6x what the child needs
    resource.setrlimit(resource.RLIMIT_CPU, (120, 120))


@pytest.mark.slow  # a child interpreter under limits
def test_hostile_manifests_load_stream_or_raise_our_error(packed_tree, tmp_path):
    import shutil

    src = packed_tree(12, 3, ["tar"], shard_size=4000)["tar"]
    root = tmp_path / "ds"
    shutil.copytree(src, root)
    child = subprocess.run(
        [sys.executable, "-c", f"import test_manifest_fuzz as t; t.fuzz({str(root)!r}, 250)"],
        cwd=os.path.dirname(__file__),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        preexec_fn=_limits,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
