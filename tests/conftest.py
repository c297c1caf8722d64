"""Fixtures and settings shared by the test files."""

from __future__ import annotations

# --- shared fixtures (H9b) ---
# The loopback servers (moto S3, HTTP with Range, the fault proxy) and their session fixtures
# live in remote_servers.py, loaded as a plugin so the remote test files just ask for
# ``s3``/``http``. Image trees, packed datasets and the CLI runner are built here once.
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from PIL import Image

pytest_plugins = ["remote_servers"]


def image_tree(root: Path, n: int, classes: int = 3, size: tuple[int, int] = (8, 6)) -> Path:
    """``root/class{i % classes}/img{i:03d}.jpg`` for i < n: tiny solid JPEGs, distinct colours."""
    for i in range(n):
        d = root / f"class{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (i * 11 % 256, 40, (255 - i) % 256)).save(d / f"img{i:03d}.jpg")
    return root


@pytest.fixture(scope="session")
def packed_tree(tmp_path_factory) -> Callable[..., dict[str, str]]:
    """Factory: an ``image_tree`` of ``n`` images packed once per format.

    ``packed_tree(22, 3, {"tar": 12000, "lmdb": 12000})`` -> ``{"src": ..., "tar": ...,
    "lmdb": ...}`` (paths as str); each format maps to its shard size in bytes, or give a list
    of formats and one ``shard_size``. Every call makes a fresh directory.
    """
    from shardkit.packer import pack

    def make(
        n: int,
        classes: int = 3,
        formats: Sequence[str] | dict[str, int] = ("tar", "lmdb"),
        shard_size: int = 12000,
        size: tuple[int, int] = (8, 6),
    ) -> dict[str, str]:
        base = tmp_path_factory.mktemp("packed")
        src = image_tree(base / "src", n, classes, size)
        sizes = formats if isinstance(formats, dict) else dict.fromkeys(formats, shard_size)
        out = {"src": str(src)}
        for fmt, limit in sizes.items():
            out[fmt] = str(base / fmt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pack(str(src), out[fmt], format=fmt, shard_size=limit, progress=False)
        return out

    return make


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    """``shardkit ARGS`` in a child process: the real exit code, stderr and signal handling.

    The one subprocess runner (``from conftest import run_cli``); in-process tests that only
    check output use click's ``CliRunner``, which needs no fresh interpreter per call.
    """
    return subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=kw.pop("timeout", 120),
        **kw,
    )
