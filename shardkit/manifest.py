"""manifest.json: what a packed dataset holds, written last so its presence means "complete".

Readers use it for exact per-shard sample counts (exact ``len()`` and within-shard splitting
without opening a shard), the class list, and checksums. Plain JSON; FORMAT.md specifies it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ManifestError
from .fsutil import atomic_write_bytes, interrupted_commit, interrupted_message

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "INDEX_EVERY",
    "ShardEntry",
    "SkippedFile",
    "read_manifest",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"shardkit {version('shardkit')}"
    except Exception:
        return "shardkit"


#: Samples between two entries of a shard's sparse byte-offset index.
INDEX_EVERY = 64


@dataclass(frozen=True)
class ShardEntry:
    """One shard: ``path`` is relative to the manifest's directory (or URL prefix).

    ``index`` (tar only) holds the byte offset of samples 0, ``INDEX_EVERY``, 2 x ``INDEX_EVERY``
    ...: a worker whose slice starts mid-shard seeks there and hops over at most 63 samples,
    instead of reading every byte before its first one.
    """

    path: str
    samples: int
    bytes: int
    sha256: str
    index: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "path": self.path, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256
        }
        if self.index:
            doc["index_every"] = INDEX_EVERY
            doc["index"] = list(self.index)
        return doc

    @classmethod
    def from_dict(cls, s: dict[str, Any]) -> ShardEntry:
        index: tuple[int, ...] = ()
        if "index" in s:
            if int(s.get("index_every", 0)) != INDEX_EVERY:
                raise ValueError("index_every")  # another spacing: ignore nothing, refuse
            index = tuple(int(x) for x in s["index"])
        return cls(str(s["path"]), int(s["samples"]), int(s["bytes"]), str(s["sha256"]), index)


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass
class Manifest:
    shard_format: str
    classes: list[str]
    shards: list[ShardEntry]
    skipped: list[SkippedFile] = field(default_factory=list)
    pack: dict[str, Any] = field(default_factory=dict)
    version: int = MANIFEST_VERSION
    created_by: str = field(default_factory=_version)

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> str:
        doc = {
            "version": self.version,
            "created_by": self.created_by,
            "shard_format": self.shard_format,
            "num_samples": self.num_samples,
            "total_bytes": self.total_bytes,
            "classes": self.classes,
            "shards": [s.to_dict() for s in self.shards],
            "skipped": [asdict(s) for s in self.skipped],
            "pack": self.pack,
        }
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest.json") -> Manifest:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ManifestError(
                f"{source}: not valid JSON ({exc}); re-pack or restore it"
            ) from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: expected a JSON object at the top level")
        version = doc.get("version")
        if version != MANIFEST_VERSION:
            raise ManifestError(
                f"{source}: manifest version {version!r} is not supported (this shardkit reads "
                f"version {MANIFEST_VERSION}); upgrade shardkit or re-pack"
            )
        try:
            shards = [ShardEntry.from_dict(s) for s in doc["shards"]]
            skipped = [
                SkippedFile(str(s["path"]), str(s["reason"])) for s in doc.get("skipped", [])
            ]
            manifest = cls(
                shard_format=str(doc["shard_format"]),
                classes=[str(c) for c in doc["classes"]],
                shards=shards,
                skipped=skipped,
                pack=dict(doc.get("pack", {})),
                version=version,
                created_by=str(doc.get("created_by", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{source}: missing or malformed field {exc}; re-pack") from None
        if "num_samples" in doc and doc["num_samples"] != manifest.num_samples:
            raise ManifestError(
                f"{source}: num_samples {doc['num_samples']} disagrees with the shard counts "
                f"({manifest.num_samples}); the manifest was edited or damaged, re-pack"
            )
        for s in shards:
            if s.index and (
                len(s.index) != (s.samples + INDEX_EVERY - 1) // INDEX_EVERY
                or any(b <= a for a, b in zip(s.index, s.index[1:], strict=False))
                or s.index[-1] >= s.bytes
            ):
                raise ManifestError(
                    f"{source}: the offset index of shard {s.path!r} does not fit its "
                    f"{s.samples} samples and {s.bytes} bytes; re-pack"
                )
            if os.path.isabs(s.path) or ".." in s.path.split("/"):
                raise ManifestError(
                    f"{source}: shard path {s.path!r} points outside the manifest's directory"
                )
        return manifest


def write_manifest(manifest: Manifest, out_dir: str) -> str:
    """Write ``out_dir/manifest.json`` atomically; callers write it after every shard is final."""
    path = os.path.join(out_dir, MANIFEST_NAME)
    atomic_write_bytes(path, manifest.to_json().encode())
    return path


def read_manifest(path_or_dir: str) -> Manifest:
    path = os.fspath(path_or_dir)
    if os.path.isdir(path):
        path = os.path.join(path, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        if interrupted_commit(os.path.dirname(path)):
            raise ManifestError(interrupted_message(os.path.dirname(path))) from None
        raise ManifestError(f"{path}: no manifest; pack the folder with `shardkit pack`") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror})") from None
    return Manifest.from_json(text, source=path)
