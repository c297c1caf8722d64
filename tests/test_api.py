"""The public names: what `from shardkit import ...` gives, whatever was imported before."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow  # a fresh interpreter
def test_pack_is_the_function_even_after_its_module_is_imported():
    code = (
        "import shardkit.stream.dataset, shardkit.write.packer, shardkit.write.verify\n"
        "from shardkit import pack, ShardDataset, FolderDataset, PackReport\n"
        "assert callable(pack) and pack.__name__ == 'pack', pack\n"
        "assert ShardDataset.__name__ == 'ShardDataset'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow  # a fresh interpreter
def test_import_shardkit_does_not_load_torch():
    code = "import sys, shardkit\nassert 'torch' not in sys.modules\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_name_in_all_resolves():
    import shardkit

    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None, name
