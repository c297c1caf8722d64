"""``ShardWriter``: samples in, shards rolled at a size limit, manifest.json committed last.

The one writer every producer shares: ``pack`` (a folder, a list of samples, a torch Dataset),
remote uploads (``out`` a URL) and any user code::

    with ShardWriter("out/", format="tar", shard_size="64MB") as w:
        for key, jpeg, label in samples:
            w.write(key, jpeg, label, json={"source": "camera-3"})

Local ``out``: shards are written into ``out/.partial-<pid>-<hex>/`` and published by
``fsutil.publish`` (all or nothing, manifest last); the output is locked for the writer's
lifetime, so a second writer into it is refused at once. URL ``out`` (``s3://``, ``gs://``,
``az://``): each shard is uploaded as soon as it is complete, the manifest after all of them.
On an exception (or a kill) nothing appears under a final name locally; see FORMAT.md for what a
killed upload leaves behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, OutputError
from ..formats import get_format
from ..formats.sample_index import ensure_indexes, index_path
from ..formats.tar import LABEL_EXTS
from ..fsutil import (
    JOURNAL_NAME,
    STAGING_PREFIX,
    DirLock,
    interrupted_commit,
    open_regular,
    publish,
    recover,
    remove_stale_staging,
    staging_name,
    write_error,
)
from ..images.checks import IMAGE_EXTENSIONS, image_ext
from ..manifest import MANIFEST_NAME, Manifest, ShardEntry, SkippedFile, write_manifest
from ..sizes import parse_size
from ..urls import is_remote, join_url
from .keyfile import KEYS_NAME, columns_of, new_columns, write_key_file
from .keys import shard_hashes

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "ShardSizeWarning",
    "ShardWriter",
    "WriterReport",
    "next_shard_number",
    "open_local_output",
    "shard_name",
    "shard_number",
]


class ShardSizeWarning(UserWarning):
    """shard_size is so small that shards hold one sample each."""


DEFAULT_SHARD_SIZE = "256MB"
_SHARD_NAME = re.compile(r"^shard-\d+\.(tar|lmdb)$")
_RUN_NAME = re.compile(r"^manifest\.keys\.\d+$")  # a key file's growth run
_FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_RESERVED = frozenset(IMAGE_EXTENSIONS) | frozenset(LABEL_EXTS)


def shard_name(index: int, suffix: str) -> str:
    return f"shard-{index:06d}{suffix}"


def shard_number(name: str) -> int:
    """``shard-000041.tar`` (or a path to it) -> 41; -1 for a name shardkit did not give (an
    indexed dataset)."""
    name = os.path.basename(name)
    digits = name.removeprefix("shard-").split(".", 1)[0]
    return int(digits) if name.startswith("shard-") and digits.isdigit() else -1


def next_shard_number(out: str, listed: Sequence[str]) -> int:
    """The number of the first shard a dataset in ``out`` grows by: after those its manifest
    lists (``listed``) and after any file in ``out`` named like a shard, which an append or
    merge must never replace (shardkit did not write it, or a manifest no longer lists it)."""
    try:
        present = [n for n in os.listdir(out) if n.startswith("shard-")]
    except OSError:
        present = []
    names = [os.path.basename(p) for p in listed] + present
    return max((shard_number(n) for n in names), default=-1) + 1


def _field_bytes(name: str, value: Any, key: str) -> bytes:
    """Extra fields as stored: bytes as is, text UTF-8, numbers decimal, lists/dicts JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return str(value.item() if isinstance(value, np.generic) else value).encode()
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8")
    raise InputError(
        f"sample {key!r}: field {name}= is a {type(value).__name__}; pass bytes, str, a number, "
        "or a JSON-serialisable list/dict"
    )


@dataclass
class WriterReport:
    """What a closed ``ShardWriter`` committed."""

    out: str
    manifest_path: str
    format: str
    shards: int
    samples: int
    bytes: int
    classes: int


class ShardWriter:
    """Write samples into size-limited shards plus a manifest; a context manager.

    ``shard_size`` is the largest shard (``"256MB"``, ``"64MiB"``, bytes); a sample bigger than
    that gets a shard of its own. ``classes`` names the labels (default: ``"0"``, ``"1"``, ...
    up to the largest label written). ``overwrite=True`` replaces the dataset already in ``out``
    when (and only when) the new one commits; only files shardkit wrote are removed. Leaving the
    ``with`` block by an exception aborts: nothing is left under a final name.
    ``on_shard(path)`` is called as each shard is complete (under its staging name).
    ``storage_options`` and ``work_dir`` (where shards wait for their upload) apply to URLs.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        format: str = "tar",
        shard_size: str | int = DEFAULT_SHARD_SIZE,
        *,
        classes: Sequence[str] | None = None,
        overwrite: bool = False,
        on_shard: Callable[[str], None] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        work_dir: str | None = None,
        upload_concurrency: int = 4,
        _forbid_inside: str | None = None,
    ):
        self.format = get_format(format)
        self.limit = parse_size(shard_size)
        self.out = os.fspath(out)
        self.classes = list(classes) if classes is not None else None
        #: Listed in the manifest's ``skipped`` (pack puts its unreadable files here).
        self.skipped: list[SkippedFile] = []
        #: The manifest's ``pack`` section: how the dataset was made.
        self.pack_info: dict[str, Any] = {}
        self.report: WriterReport | None = None
        self._on_shard = on_shard
        self._entries: list[ShardEntry] = []
        self._shard = None
        self._max_label = -1
        self._field_counts: dict[str, int] = {}
        self._single = 0  # shards in a row closed at one sample because the next did not fit
        self._lock: DirLock | None = None
        self._uploader = None
        self._remote = is_remote(self.out)
        #: a URL output's shards' key hashes, by name, taken before each upload (the local
        #: copy is deleted once uploaded): its key file's columns
        self._hashes: dict[str, np.ndarray] = {}
        self._replaced: list[str] = []
        self._closed = False
        if self.out.startswith("file://"):
            self.out = self.out[len("file://") :]
        if self._remote:
            self._open_remote(overwrite, storage_options, work_dir, upload_concurrency)
        else:
            self._open_local(overwrite, _forbid_inside)

    # --- opening -------------------------------------------------------------------------------

    def _open_local(self, overwrite: bool, forbid_inside: str | None) -> None:
        self._lock, self._replaced = open_local_output(self.out, overwrite, forbid_inside)
        try:
            self._staging = os.path.join(self.out, staging_name())
            os.mkdir(self._staging)
        except OSError as exc:
            self._lock.release()
            raise OutputError(f"cannot use output {self.out!r}: {exc.strerror}") from None

    def _open_remote(self, overwrite, storage_options, work_dir, concurrency) -> None:
        from ..remote.fetch import check_bucket, storage_error
        from ..remote.fs import filesystem, protocol_of, strip
        from ..remote.upload import Uploader, check_writable

        url = self.out
        check_writable(url)
        check_bucket(url, storage_options)
        fs = filesystem(protocol_of(url), storage_options)
        manifest_url = join_url(url, MANIFEST_NAME)
        try:
            exists = fs.exists(strip(fs, manifest_url))
        except Exception as exc:
            raise storage_error(url, "cannot list the destination", exc, storage_options) from None
        if exists and not overwrite:
            raise OutputError(
                f"{url} already holds a packed dataset ({MANIFEST_NAME}); pass overwrite=True "
                "to replace it, or choose another prefix"
            )
        if exists:  # no manifest may ever describe a mix of old and new shards
            self._replaced = _old_remote_outputs(url, storage_options)
            fs.rm_file(strip(fs, manifest_url))
        self._fs, self._strip = fs, strip
        self._storage_options = storage_options
        self._tmp = tempfile.mkdtemp(prefix="shardkit-pack-", dir=work_dir)
        self._staging = os.path.join(self._tmp, "out")
        os.mkdir(self._staging)
        self._uploader = Uploader(url, storage_options, concurrency=concurrency, delete_after=True)

    # --- writing -------------------------------------------------------------------------------

    @property
    def samples(self) -> int:
        return sum(e.samples for e in self._entries) + (self._shard.samples if self._shard else 0)

    def write(self, key: str, image_bytes: bytes, label: int, **extra_fields: Any) -> None:
        """Add one sample: encoded image bytes (JPEG, PNG, WebP ...), its integer label (-1:
        none, e.g. an image-text pair), and extra fields stored beside it (``<key>.<name>`` tar
        members; see FORMAT.md)."""
        ext = image_ext(image_bytes)
        if ext is None:
            raise InputError(
                f"sample {key!r}: image_bytes is not an encoded image (JPEG, PNG, WebP, GIF, BMP, "
                "TIFF, PNM); encode it first, or let pack() encode arrays and PIL images"
            )
        self.add(key, ext, image_bytes, label, extra_fields)

    def add(
        self, key: str, ext: str, data: bytes, label: int, extra: Mapping[str, Any] | None = None
    ) -> None:
        """``write`` with the image's member extension given (pack keeps the file's own);
        ``label=-1``: the sample has none (a tar gets no ``.cls`` member)."""
        if self._closed:
            raise OutputError(f"ShardWriter for {self.out!r} is closed; open a new one")
        _check_key(key)
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or label < -1:
            raise InputError(
                f"sample {key!r}: label={label!r}; labels are integers >= 0 (-1: no label)"
            )
        label = int(label)
        if self.classes is not None and label >= len(self.classes):
            raise InputError(
                f"sample {key!r}: label={label} is outside classes= ({len(self.classes)} names)"
            )
        fields = (
            [
                (_check_field(name, key), _field_bytes(name, value, key))
                for name, value in extra.items()
            ]
            if extra
            else ()
        )
        data = bytes(data) if not isinstance(data, bytes) else data
        try:
            if self._shard is not None and (
                self._shard.projected_size(key, ext, len(data), fields) > self.limit
            ):
                self._note_single(self._shard.samples, len(data))
                self._finish_shard()
            if self._shard is None:
                name = shard_name(len(self._entries), self.format.suffix)
                self._shard = self.format.open_writer(os.path.join(self._staging, name))
            self._shard.add(key, ext, data, label, fields)
        except OSError as exc:
            raise write_error(self.out, exc, "shards") from None
        self._max_label = max(self._max_label, label)
        for name, _ in fields:
            self._field_counts[name] = self._field_counts.get(name, 0) + 1

    def add_shards(
        self, entries: Sequence[ShardEntry], fields: Mapping[str, int] | None = None
    ) -> None:
        """Shards written elsewhere (a planned pack's task) in this writer's staging folder
        join its output, in order, after any it rolled itself; into a URL each must already be
        submitted for upload (``upload``). ``fields``: their samples carrying each field."""
        if self._shard is not None:
            self._finish_shard()
        self._entries += list(entries)
        for name, count in (fields or {}).items():
            self._field_counts[name] = self._field_counts.get(name, 0) + count

    def upload(self, path: str, entry: ShardEntry | None = None) -> None:
        """Upload the complete shard at ``path`` now (URL outputs; a no-op locally).
        ``entry``: its manifest entry, whose key hashes (its index's, checked by its keys:
        ``keys.shard_hashes``) are taken first for the key file; a shard uploaded without one
        leaves the dataset without a key file (its readers then read every shard's index)."""
        if self._uploader is not None:
            if entry is not None:
                self._hashes[entry.path] = shard_hashes(
                    os.path.dirname(path), self.format.name, entry
                )
            if os.path.isfile(index_path(path)):  # its sample index first: readers check it
                self._uploader.submit(index_path(path))
            self._uploader.submit(path)

    @property
    def staging(self) -> str:
        """The local folder this writer stages shards in (a temporary one for a URL)."""
        return self._staging

    def _note_single(self, samples: int, next_bytes: int) -> None:
        """Warn once when shard_size gives one-sample shards: an open per sample again, which
        is what shards exist to avoid (e.g. ``--shard-size 10KB`` for 13 KB JPEGs)."""
        self._single = self._single + 1 if samples == 1 else 0
        if self._single == 2:
            warnings.warn(
                f"shard_size={self.limit} bytes holds one sample per shard (the last one closed "
                f"at one sample when the next, {next_bytes} bytes, did not fit): every sample "
                "becomes its own shard; use a shard size of at least ~100 samples, e.g. 64MB",
                ShardSizeWarning,
                stacklevel=4,
            )

    def _finish_shard(self) -> None:
        shard, self._shard = self._shard, None
        stats = shard.close()
        self._entries.append(
            ShardEntry(
                os.path.basename(stats.path),
                stats.samples,
                stats.bytes,
                stats.sha256,
                stats.index,
                stats.index_sha256,
                stats.columns_sha256,
            )
        )
        if self._on_shard is not None:
            self._on_shard(stats.path)
        self.upload(stats.path, self._entries[-1])

    # --- commit / abort ------------------------------------------------------------------------

    def close(self) -> WriterReport:
        """Finish the last shard and commit: every shard in place, then the manifest."""
        if self.report is not None:
            return self.report
        what = "shards"  # what a failed write was writing, for the error message
        try:
            if self._shard is not None:
                self._finish_shard()
            if not self._entries:
                raise OutputError(f"no samples were written to {self.out!r}; nothing to commit")
            if not self._remote:  # checked (or built) here: the manifest lists their sha256
                self._entries = ensure_indexes(self._staging, self._entries)
            keys = self._key_file()  # for a split's counts and the growth that may follow
            classes = self.classes
            if classes is None:
                classes = [str(i) for i in range(self._max_label + 1)]
            manifest = Manifest(
                shard_format=self.format.name,
                classes=list(classes),
                shards=list(self._entries),
                skipped=sorted(self.skipped, key=lambda s: s.path),
                pack=dict(self.pack_info),
                fields=dict(self._field_counts),
                keys=keys,
            )
            what = MANIFEST_NAME
            local_manifest = write_manifest(manifest, self._staging)
            if self._remote:
                what = "the upload"
                path = self._commit_remote(local_manifest)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise write_error(self.out, exc, what) from None
            raise
        if not self._remote:
            try:
                path = publish(
                    self.out,
                    self._staging,
                    [*(e.path for e in self._entries), KEYS_NAME],
                    MANIFEST_NAME,
                    remove=[*self._replaced, KEYS_NAME],
                )
            except BaseException as exc:
                error = self._publish_failed(exc)
                if error is exc:
                    raise
                raise error from None
        self._release()
        self.report = WriterReport(
            self.out,
            path,
            self.format.name,
            len(manifest.shards),
            manifest.num_samples,
            manifest.total_bytes,
            len(manifest.classes),
        )
        return self.report

    def _key_file(self) -> dict:
        """The key file of the shards written (their indexes: checked, or built, just now),
        in the staging folder; what the manifest lists of it.

        A URL output's: the same bytes a local pack writes (block table too), from the hashes
        taken as each shard went up (none, {}, where a shard went up without them), submitted
        for upload before the manifest, which ``Uploader.finish`` sends only once every upload
        is done and its size checked: no manifest ever lists a key file that is not there."""
        if not self._remote:
            new = new_columns(self._staging, self.format.name, self._entries, 0)
            return write_key_file(self._staging, [new], self._entries)
        if not all(e.path in self._hashes for e in self._entries):
            return {}
        parts = [self._hashes[e.path] for e in self._entries]
        keys = write_key_file(self._staging, [columns_of(parts, 0)], self._entries)
        self._uploader.submit(os.path.join(self._staging, KEYS_NAME))
        return keys

    def _publish_failed(self, exc: BaseException) -> BaseException:
        """Clean up after a failed local publish; the error to raise (``exc`` unless an OSError)."""
        committed = interrupted_commit(self.out) is not None
        if not committed:  # before the commit point: drop it all, the old dataset stays
            shutil.rmtree(self._staging, ignore_errors=True)
        self._release()
        if not isinstance(exc, OSError):
            return exc
        if committed:  # past the commit point: the next writer finishes it
            return OutputError(
                f"cannot finish the commit in {self.out!r}: {exc.strerror or exc}; "
                "packing into it again completes it"
            )
        return write_error(self.out, exc, f"the commit journal {JOURNAL_NAME}")

    def _commit_remote(self, local_manifest: str) -> str:
        url = self._uploader.finish(local_manifest)
        new = {e.path for e in self._entries}
        for name in self._replaced:  # old shards the new manifest does not list
            for gone in (name, index_path(name)) if name not in new else ():
                try:  # the shard and its sample index
                    self._fs.rm_file(self._strip(self._fs, join_url(self.out, gone)))
                except FileNotFoundError:
                    pass
        return url

    def abort(self) -> None:
        """Drop everything written so far; nothing appears under a final name."""
        if self._shard is not None:
            self._shard.abort()
            self._shard = None
        if self._uploader is not None:
            self._uploader.close()
        shutil.rmtree(getattr(self, "_tmp", None) or self._staging, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        self._closed = True
        if self._uploader is not None:
            self._uploader.close()
            shutil.rmtree(self._tmp, ignore_errors=True)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._closed:
            self.close()
        elif not self._closed:
            self.abort()

    def __repr__(self) -> str:
        return (
            f"ShardWriter({self.out!r}, format={self.format.name!r}, shard_size={self.limit}, "
            f"{len(self._entries)} shards done)"
        )


# --- opening a local output --------------------------------------------------------------------


def open_local_output(
    out: str, overwrite: bool, forbid_inside: str | None = None, replacing: bool = True
) -> tuple[DirLock, list[str]]:
    """Lock the local output ``out`` for one writer and make it ready: ``(lock, replaced)``.
    ``replacing`` False (a growth, which keeps every old file): ``replaced`` is empty and the
    old manifest is not read for it (O(shards) at scale; the growth reads it once itself).

    A commit killed after its commit point is finished first and dead staging removed; a
    non-empty ``out`` needs ``overwrite``; ``replaced`` are the old dataset's shards, which the
    new commit deletes. The caller releases the lock (or keeps it until its commit).
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputError(f"output {out!r} exists and is not a directory; choose a directory")
    if forbid_inside is not None and _within(out, forbid_inside):
        raise OutputError(
            f"output {out!r} is inside the source {forbid_inside!r}; choose a folder outside "
            "the source tree"
        )
    try:
        os.makedirs(out, exist_ok=True)
        lock = DirLock(out)
    except OSError as exc:
        raise OutputError(
            f"cannot create {exc.filename or out!r}: {exc.strerror}; choose a writable output"
        ) from None
    try:
        recover(out)  # a commit killed after its commit point is finished first
        remove_stale_staging(out)
        remove_stale_staging(out, f".{JOURNAL_NAME}.tmp-")  # a journal killed mid-write
        leftovers = [n for n in os.listdir(out) if not n.startswith(STAGING_PREFIX)]
        if leftovers and not overwrite:
            raise OutputError(
                f"output directory {out!r} is not empty; pass overwrite=True to replace the "
                "shards and manifest in it, or choose an empty directory"
            )
        return lock, _old_outputs(out) if replacing else []
    except OSError as exc:
        lock.release()
        raise OutputError(f"cannot use output {out!r}: {exc.strerror}") from None
    except BaseException:
        lock.release()
        raise


# --- checks ------------------------------------------------------------------------------------


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise InputError(f"key={key!r}: keys are non-empty strings")
    last = key.rsplit("/", 1)[-1]
    if "." in last or not last or key.startswith("/") or "\x00" in key or ".." in key.split("/"):
        raise InputError(
            f"key={key!r}: a key is a relative path whose last part holds no dot (WebDataset "
            "splits member names at the first dot); shardkit.formats.encode_key() makes one"
        )
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:  # a name os.fsdecode() made from bytes that are not UTF-8
            raise InputError(
                f"key={key!r} is not valid Unicode text (a file name that is not UTF-8?); "
                "shardkit.formats.encode_key() escapes its bytes as %XX"
            ) from None


def _check_field(name: str, key: str) -> str:
    if not _FIELD_NAME.match(name) or name.lower() in _RESERVED:
        raise InputError(
            f"sample {key!r}: field name {name!r} cannot be used; extra fields are named like "
            "file extensions (json, txt, meta.json) other than image types and cls/label/index"
        )
    return name


def _within(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def _old_outputs(out: str) -> list[str]:
    """Files of the dataset in ``out`` that an overwrite replaces: its manifest's shards and
    its key file's growth runs (``manifest.keys.<k>``).

    Only shard and run names shardkit writes, directly inside ``out``: a manifest listing
    anything else (a path outside ``out``, a user's file) never gets it deleted.
    """
    try:
        with open_regular(os.path.join(out, MANIFEST_NAME)) as f:
            doc = json.load(f)
        listed = doc.get("shards", [])
        runs = doc.get("keys", {}).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return []
    names = {
        s["path"]
        for s in (listed if isinstance(listed, list) else [])
        if isinstance(s, dict) and isinstance(s.get("path"), str) and _SHARD_NAME.match(s["path"])
    } | {
        r["path"]
        for r in (runs if isinstance(runs, list) else [])
        if isinstance(r, dict) and isinstance(r.get("path"), str) and _RUN_NAME.match(r["path"])
    }
    return sorted(n for n in names if os.path.isfile(os.path.join(out, n)))


def _old_remote_outputs(url: str, storage_options) -> list[str]:
    from ..remote.inspect import read_manifest_url

    try:
        manifest, _ = read_manifest_url(url, storage_options)
    except Exception:
        return []
    return [s.path for s in manifest.shards if _SHARD_NAME.match(s.path)]
