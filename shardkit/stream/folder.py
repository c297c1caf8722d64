"""``FolderDataset``: the per-file baseline shards are measured against, decoding exactly as
``ShardDataset`` does."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from torch.utils.data import Dataset

from ..errors import InputError, SampleError
from ..images.checks import IMAGE_EXTENSIONS
from ..images.geometry import TensorDecoder
from ..images.options import Decode
from ..scan import StrTable, scan_source
from .indexes import val_mask
from .mix import Source, key_hashes
from .storage import LocalStorage, Storage

__all__ = ["FolderDataset"]


class FolderDataset(Dataset):
    """Map-style dataset over a class-per-folder tree: the per-file baseline shards are measured
    against, decoding exactly as ``ShardDataset`` does.

    Listed by ``shardkit.scan``, the scanner ``pack`` uses: the same classes, labels and skipped
    entries (FIFOs, broken links: warned about, never opened). Labels are the indices of the
    sorted class folder names (``.classes``). Relative paths live in
    one numpy byte blob with int64 offsets, not a Python list: forked DataLoader workers touching
    a list of str objects write their refcounts and so copy every page; numpy arrays stay shared.
    Files are read through ``storage`` (a ``LocalStorage(latency_ms=...)`` charges per image).

    ``decode``: a mode string or the ``shardkit.Decode`` ShardDataset takes; with a crop
    (``Decode(crop=RandomResizedCrop(224))``) images come out fixed-size through the same
    ``TensorDecoder``: the same pixels from a folder and from its shards, so images of mixed
    sizes batch. ``skip``: relative paths to leave out, e.g. the
    ``skipped`` of a manifest packed from this folder, so both read the same samples.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        decode: str | Decode = "pil",
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        storage: Storage | None = None,
        extensions: Sequence[str] = tuple(sorted(IMAGE_EXTENSIONS)),
        with_keys: bool = False,
        seed: int = 0,
        skip: Iterable[str] = (),
        **retired,
    ):
        if retired:  # size=, crop= (one release): the Decode they stand for
            from .retired import translate

            _, decode, _, _ = translate(
                retired, source=root, decode=decode, order=None, storage=None,
                owner="FolderDataset", groups=("decode",),
            )  # fmt: skip
        root, split = _folder_of(root)
        if getattr(storage, "urls_only", False):
            raise InputError(
                f"FolderDataset({os.fspath(root)!r}, storage={type(storage).__name__}(...)): a "
                "remote storage configures URLs, a folder is local: leave storage out or give "
                "LocalStorage(...)"
            )
        #: what a stored image becomes: the same ``Decode`` ShardDataset and ShardLoader take
        self.decode: Decode = Decode.of(decode)
        self.geometry = self.decode.geometry
        self.seed, self.epoch = int(seed), 0
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise InputError(f"{self.root}: not a directory; pass a class-per-folder image tree")
        self.transform = transform
        self.target_transform = target_transform
        self.storage: Storage = storage or LocalStorage()
        self.with_keys = bool(with_keys)
        exts = {e.lower().lstrip(".") for e in extensions}
        scan = scan_source(self.root)  # pack's scanner: same classes, labels, skips
        if scan.from_table:
            raise InputError(
                f"{self.root}: img2dataset's output (tables beside their tars or folders), not "
                "a class-per-folder tree; `shardkit pack` it, or `shardkit index` its tars, "
                "and read it with ShardDataset"
            )
        self.classes: list[str] = list(scan.classes)
        keep = np.fromiter((e in exts for e in scan.exts), dtype=bool, count=len(scan.exts))
        if split is not None:  # pack's keys: the relative path without its extension
            keys = [f.rsplit(".", 1)[0] for f in scan.files]
            val = val_mask(key_hashes(keys), split.val_fraction)
            keep &= val if split.split == "val" else ~val
        left_out = set(skip)
        if left_out:
            keep &= np.fromiter((f not in left_out for f in scan.files), bool, len(scan.files))
        if not keep.any():
            raise InputError(
                f"{self.root}: no images (.{', .'.join(sorted(exts))}) in class folders; "
                "expected root/<class>/<image>"
            )
        if scan.errors:
            first = scan.errors[0]
            warnings.warn(
                f"{self.root}: skipped {len(scan.errors)} unreadable image entries (first: "
                f"{first.path}: {first.reason})",
                stacklevel=2,
            )
        files = scan.files
        if not keep.all():
            files = StrTable(f for f, k in zip(scan.files, keep, strict=True) if k)
        self.path_bytes, self.offsets = files.blob, files.offsets
        self.targets = scan.labels[keep]

    def __len__(self) -> int:
        return len(self.targets)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of a random crop's draws (a pure function of seed, epoch and path)."""
        self.epoch = int(epoch)

    def relpath(self, index: int) -> str:
        """Path of sample ``index`` relative to the root (also its key)."""
        blob = self.path_bytes[self.offsets[index] : self.offsets[index + 1]]
        return blob.tobytes().decode("utf-8", "surrogateescape")

    def __getitem__(self, index: int):
        if index < 0:
            index += len(self.targets)
        rel = self.relpath(index)
        path = os.path.join(self.root, rel)
        with self.storage.open(path) as f:
            data = f.read()
        try:
            if self.geometry is None:
                img = self.decode.image(data)
            else:
                img = TensorDecoder.of(self.decode, self.seed, self.epoch)(data, rel)
        except Exception as exc:
            raise SampleError(
                f"{path}: cannot be decoded ({exc}); remove or replace the file",
                shard=self.root,
                key=rel,
            ) from exc
        label = int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return (img, label, rel) if self.with_keys else (img, label)

    def __repr__(self) -> str:
        return f"FolderDataset({self.root!r}, {len(self)} images, {len(self.classes)} classes)"


#: What a ``Source`` selects by, and what to do instead on a folder.
_NOT_HERE = {
    "subset": "give skip= the files to leave out",
    "weight": "mix folders as packed datasets: ShardDataset([Source(...), ...])",
    "fields": "a folder's samples are its images: leave fields out",
    "storage_options": "a folder is local: leave storage_options out",
}


def _folder_of(root) -> tuple[str | os.PathLike, Source | None]:
    """The folder a ``root`` names, and the ``Source`` whose split selects its files (None:
    every file); what else a ``Source`` would select by is refused, naming the option and what
    to do instead."""
    if not isinstance(root, Source):
        return root, None
    for name, fix in _NOT_HERE.items():
        if getattr(root, name) is not None:
            raise InputError(
                f"FolderDataset(Source({root.name!r}, {name}=...)): a folder's files are read "
                f"whole, {name}= cannot take effect: {fix}"
            )
    if not isinstance(root.path, (str, os.PathLike)):
        raise InputError(
            f"FolderDataset(Source({root.name!r})): give one class-per-folder directory"
        )
    return root.path, root if root.split is not None else None
