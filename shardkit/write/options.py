"""``PackOptions``: how ``pack`` packs, as one frozen value handed whole from ``pack()`` to the
planner (``write.plan``), the fingerprint (``write.read``) and the writers.

Its own module so the planner can take the object without importing ``write.packer``, which
imports the planner.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InputError, check_choice
from .writer import DEFAULT_SHARD_SIZE

if TYPE_CHECKING:
    from .plan import ShardReceipt, ShardTask

__all__ = ["PackOptions", "Runner"]

_VALIDATE = ("header", "decode", "none")
#: ``"fail"`` is the former name of ``"raise"``, kept as an alias.
_ON_ERROR = ("skip", "raise", "fail")

#: Runs a plan's tasks somewhere (a process pool, a cluster) and returns their receipts.
Runner = Callable[[list["ShardTask"]], Iterable["ShardReceipt"]]


def _check_options(validate, on_error, workers, resize_short, seed) -> str:
    check_choice("validate", validate, _VALIDATE)
    check_choice("on_error", on_error, _ON_ERROR)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"invalid workers={workers!r}; use 1 or more reader threads")
    if resize_short is not None and (not isinstance(resize_short, int) or resize_short < 1):
        raise InputError(f"invalid resize_short={resize_short!r}; use a positive number of pixels")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"invalid seed {seed!r}; use an integer >= 0")
    return "raise" if on_error == "fail" else on_error


@dataclass(frozen=True)
class PackOptions:
    """How ``pack`` packs: every option but the source and the output, as one value that can be
    kept, compared and handed on whole (``pack(src, out, options)``; keywords of ``pack`` set
    the same fields). The fields are ``pack``'s documented keywords, with their defaults."""

    shard_size: str | int = DEFAULT_SHARD_SIZE
    format: str = "tar"
    shuffle: bool = True
    seed: int = 0
    workers: int = 1
    on_error: str = "skip"
    overwrite: bool = False
    resize_short: int | None = None
    validate: str = "header"
    progress: bool = True
    on_shard: Callable[[str], None] | None = None
    classes: Sequence[str] | None = None
    storage_options: Mapping[str, Any] | None = None
    work_dir: str | None = None
    upload_concurrency: int = 4
    runner: Runner | None = None
    shards_per_task: int = 1
    append: bool = False
    plan_only: str | None = None
    root: str | os.PathLike | None = None
    allow_duplicates: bool = False

    def __post_init__(self) -> None:
        _check_options(self.validate, self.on_error, self.workers, self.resize_short, self.seed)

    @property
    def on_error_mode(self) -> str:
        """``on_error`` under its current name (``"fail"`` reads as ``"raise"``)."""
        return "raise" if self.on_error == "fail" else self.on_error

    @classmethod
    def of(cls, options: PackOptions | None, keywords: Mapping[str, Any]) -> PackOptions:
        """``options`` (default: the defaults) with ``keywords`` set; an unknown one is named."""
        if options is not None and not isinstance(options, PackOptions):
            raise InputError(f"options={options!r}: give a shardkit.write.PackOptions")
        unknown = sorted(set(keywords) - set(cls.__dataclass_fields__))
        if unknown:
            raise InputError(f"pack() got an unknown keyword {unknown[0]}=; see help(pack)")
        return replace(options or cls(), **keywords)
