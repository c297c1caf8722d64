"""shardkit: pack folders of small images into sequential shards and stream them into PyTorch.

The errors and the manifest's types are imported here; every other name (``pack``,
``ShardWriter``, ``ShardDataset`` ...) on first use. ``pack`` and ``ShardView`` import without
torch; ``ShardDataset`` and ``FolderDataset`` load it, so ``shardkit ls``, ``show``, ``info`` and
``verify`` start fast.

The packages follow the flow of the data (docs/design.md maps every module): ``scan`` (what a
source holds), ``write`` (sources into shards), ``formats`` (the bytes of a shard), ``stream``
(shards back into samples), ``loader`` (samples into batches), ``images`` (decoding, on either
side), ``remote`` (shards behind URLs), ``bench`` (``shardkit bench``), ``synth`` (the embedded
datasets) and ``integrations`` (Ray). Beside them: ``cli`` (the command), ``errors``,
``manifest``, ``records`` (the typed records between stages), ``fsutil`` (crash-safe output),
``paths`` (what kind of path was given), ``progress``, ``sizes``, ``urls``, ``redact``, ``retry``
and ``extras`` (optional dependencies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    InputError,
    ManifestError,
    OutputError,
    SampleError,
    ShardFormatError,
    ShardkitError,
    StorageError,
)
from .manifest import Manifest, ShardEntry, read_manifest
from .records import Record

if TYPE_CHECKING:
    from .images.crops import CenterCrop, RandomCrop, RandomResizedCrop
    from .images.options import Decode
    from .loader import ShardLoader
    from .stream.dataset import FolderDataset, ShardDataset, Source
    from .stream.fields import Boxes
    from .stream.lookup import ViewCache
    from .stream.shuffle import Order
    from .stream.view import ShardView
    from .write.packer import PackOptions, PackReport, pack
    from .write.writer import ShardWriter

__all__ = [
    "Boxes",
    "CenterCrop",
    "Decode",
    "FolderDataset",
    "InputError",
    "Manifest",
    "ManifestError",
    "Order",
    "OutputError",
    "PackOptions",
    "PackReport",
    "RandomCrop",
    "RandomResizedCrop",
    "Record",
    "SampleError",
    "ShardDataset",
    "ShardEntry",
    "ShardFormatError",
    "ShardLoader",
    "ShardView",
    "ShardWriter",
    "ShardkitError",
    "Source",
    "StorageError",
    "ViewCache",
    "pack",
    "read_manifest",
]

_LAZY = {
    "ShardDataset": "stream.dataset",
    "FolderDataset": "stream.dataset",
    "Source": "stream.dataset",
    "Boxes": "stream.fields",
    "Decode": "images.options",
    "Order": "stream.shuffle",
    "CenterCrop": "images.crops",
    "RandomCrop": "images.crops",
    "RandomResizedCrop": "images.crops",
    "ShardView": "stream.view",
    "ViewCache": "stream.lookup",
    "ShardLoader": "loader",
    "pack": "write.packer",
    "PackOptions": "write.packer",
    "PackReport": "write.packer",
    "ShardWriter": "write.writer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
