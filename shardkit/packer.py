"""``shardkit pack``: a class-per-folder image tree into sequential shards plus manifest.json.

The pipeline, one stage each below:

    scan SRC (sorted classes, sorted files, labels, keys)
    -> shuffle once (numpy permutation of the sorted list: same input + seed = same bytes)
    -> read + validate (+ resize) in reader threads, consumed in the shuffled order
    -> write shards into OUT/.partial-<random>/ in the main thread, each within --shard-size
    -> rename the finished shards into OUT, then write manifest.json last.

The manifest is the commit point: a pack stopped at any moment leaves no manifest and no shard
under a final name, and the next run removes what the stopped one left behind.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from .errors import InputError, OutputError
from .formats import encode_key, get_format
from .fsutil import fsync_dir
from .images import (
    IMAGE_EXTENSIONS,
    RESIZE_QUALITY,
    check_image_bytes,
    decode_error,
    resize_short_side,
)
from .manifest import MANIFEST_NAME, Manifest, ShardEntry, SkippedFile, write_manifest

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "PackReport",
    "PackWarning",
    "SourceScan",
    "pack",
    "parse_size",
    "scan_source",
]

DEFAULT_SHARD_SIZE = "256MB"
#: Files each reader-thread task reads: amortises the thread hand-off over several files.
READ_BATCH = 32
#: Bytes from the start of each upcoming file that the kernel is asked to read ahead
#: (``POSIX_FADV_WILLNEED``); bounded so one huge file cannot flood the page cache.
PREFETCH_BYTES = 2 << 20
#: Tasks in flight per reader thread: enough to keep every thread busy, bounded for memory.
READ_AHEAD = 4

#: Non-image files listed one by one in the manifest's ``skipped``; past this they are only
#: counted (by extension), so a tree with a sidecar .json per image keeps a small manifest.
LIST_NON_IMAGES = 1000

STAGING_PREFIX = ".partial-"
_COMMIT_JOURNAL = "commit.json"
_SHARD_NAME = re.compile(r"^shard-\d+\.(tar|lmdb)(-lock)?$")
_VALIDATE = ("header", "decode", "none")
_ON_ERROR = ("skip", "raise")  # ShardDataset's on_error vocabulary; "fail" is the old "raise"


class PackWarning(UserWarning):
    """Something to look at that did not stop the pack (skipped files, empty classes)."""


# --- options ---------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?(b)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: str | int) -> int:
    """Bytes from ``256MB``, ``64MiB``, ``1G``, ``1.5GiB`` or a plain byte count.

    Decimal units (kB, MB, GB, with or without the B) are powers of 1000, binary ones (KiB, MiB,
    GiB) powers of 1024, as disk and cloud tools count them.
    """
    example = "use e.g. 256MB, 64MiB, 1G or a plain number of bytes"
    if isinstance(value, bool):
        raise InputError(f"invalid --shard-size {value!r}; {example}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise InputError(f"invalid --shard-size {value!r}; {example}")
        digits, unit, binary, _b = m.groups()
        mult = (1024 if binary else 1000) ** _POWERS[unit.lower()] if unit else 1
        size = int(float(digits) * mult) if "." in digits else int(digits) * mult
    if size < 1:
        raise InputError(f"invalid --shard-size {value!r}: must be at least 1 byte; {example}")
    return size


# --- scan ------------------------------------------------------------------------------------


@dataclass
class SourceScan:
    """What is in SRC, in the sorted order that shuffling permutes.

    ``files``/``keys``/``labels``/``exts`` are parallel lists; ``errors`` are image-named entries
    that cannot be read (subject to ``on_error``); ``ignored`` are non-images (the first
    ``LIST_NON_IMAGES``) and directories met twice: never errors, but listed in the manifest so
    nothing disappears silently. ``non_image_exts`` counts every non-image by extension.
    """

    root: str
    classes: list[str]
    files: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    exts: list[str] = field(default_factory=list)
    errors: list[SkippedFile] = field(default_factory=list)
    ignored: list[SkippedFile] = field(default_factory=list)
    not_images: int = 0
    non_image_exts: dict[str, int] = field(default_factory=dict)
    empty_classes: list[str] = field(default_factory=list)

    def add_non_image(self, rel: str, reason: str) -> None:
        name = rel.rsplit("/", 1)[-1]
        ext = name[name.rfind(".") :].lower() if name.rfind(".") > 0 else "(none)"
        self.non_image_exts[ext] = self.non_image_exts.get(ext, 0) + 1
        self.not_images += 1
        if self.not_images <= LIST_NON_IMAGES:
            self.ignored.append(SkippedFile(rel, reason))


def _image_ext(name: str) -> str | None:
    dot = name.rfind(".")
    if dot <= 0:
        return None
    ext = name[dot + 1 :].lower()
    return ext if ext in IMAGE_EXTENSIONS else None


def _assign_keys(rels: list[str], exts: list[str]) -> list[str]:
    """Key = relative path without extension; with it where two files share a stem (x.jpg, x.png).

    ``encode_key`` makes keys dot-free, so the with-extension form stays a valid key.
    """
    stems = [rel[: -len(ext) - 1] for rel, ext in zip(rels, exts, strict=True)]
    counts: dict[str, int] = {}
    for s in stems:
        counts[s] = counts.get(s, 0) + 1
    keys, used = [], set()
    for rel, stem in zip(rels, stems, strict=True):
        key = encode_key(stem if counts[stem] == 1 else rel)
        base, n = key, 1
        while key in used:  # only for contrived names like x.jpg.png beside x.jpg + x.png
            n += 1
            key = f"{base}~{n}"
        used.add(key)
        keys.append(key)
    return keys


def scan_source(src: str) -> SourceScan:
    """List the images of a class-per-folder tree.

    Classes are the sorted names of SRC's sub-directories; images anywhere below a class folder
    belong to it. Hidden names (leading dot: ``.DS_Store``, ``._x.jpg``, ``.ipynb_checkpoints``)
    are ignored. Directory symlinks are followed once: a directory met again (a loop, or two links
    to one folder) is listed as ignored, so the walk always ends.
    """
    _check_source_dir(src)
    root = os.path.abspath(src)
    try:
        with os.scandir(root) as it:
            top = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as exc:
        raise InputError(f"cannot list source {src!r}: {exc.strerror}") from None
    scan = SourceScan(root=src, classes=[])
    for entry in top:
        if _is_dir(entry):
            scan.classes.append(entry.name)
        else:
            scan.add_non_image(entry.name, "not in a class folder")
    seen = {_ident(root)}
    for label, cls in enumerate(scan.classes):
        rels: list[str] = []
        exts: list[str] = []
        _walk_class(root, cls, seen, scan, rels, exts)
        if not rels:
            scan.empty_classes.append(cls)
            continue
        order = sorted(range(len(rels)), key=rels.__getitem__)
        rels = [rels[i] for i in order]
        exts = [exts[i] for i in order]
        scan.files += rels
        scan.exts += exts
        scan.keys += _assign_keys(rels, exts)
        scan.labels += [label] * len(rels)
    if not scan.classes:
        raise InputError(
            f"source {src!r} has no class folders; expected one sub-folder of images per class "
            "(SRC/<class>/<image>.jpg)"
        )
    if not scan.files and not scan.errors:
        raise InputError(
            f"source {src!r} has no images (.{', .'.join(sorted(IMAGE_EXTENSIONS))}) in its "
            f"{len(scan.classes)} class folder(s)"
        )
    return scan


def _check_source_dir(src: str) -> None:
    if not os.path.exists(src):
        raise InputError(
            f"source {src!r} does not exist; pass a folder with one sub-folder per class"
        )
    if not os.path.isdir(src):
        raise InputError(
            f"source {src!r} is not a directory; pass a folder with one sub-folder per class"
        )


def _ident(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symlinks; a link to itself raises ELOOP
    except OSError:
        return False


def _walk_class(
    root: str, cls: str, seen: set, scan: SourceScan, rels: list[str], exts: list[str]
) -> None:
    stack = [cls]
    while stack:
        rel_dir = stack.pop()
        path = os.path.join(root, rel_dir)
        try:
            ident = _ident(path)
        except OSError as exc:
            scan.errors.append(SkippedFile(rel_dir + "/", f"unreadable directory: {exc.strerror}"))
            continue
        if ident in seen:
            scan.ignored.append(
                SkippedFile(rel_dir + "/", "directory already visited (symlink loop or 2nd link)")
            )
            continue
        seen.add(ident)
        try:
            with os.scandir(path) as it:
                entries = [e for e in it if not e.name.startswith(".")]
        except OSError as exc:
            scan.errors.append(SkippedFile(rel_dir + "/", f"unreadable directory: {exc.strerror}"))
            continue
        subdirs = []
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}"
            if _is_dir(entry):
                subdirs.append(rel)
                continue
            ext = _image_ext(entry.name)
            if ext is None:
                scan.add_non_image(rel, "not an image")
                continue
            try:
                regular = entry.is_file()
            except OSError:
                regular = False
            if regular:
                rels.append(rel)
                exts.append(ext)
            elif entry.is_symlink() and not os.path.exists(entry.path):
                scan.errors.append(SkippedFile(rel, "unreadable: broken symbolic link"))
            else:
                scan.errors.append(
                    SkippedFile(rel, "unreadable: not a regular file (FIFO, socket or device)")
                )
        stack.extend(sorted(subdirs, reverse=True))


# --- read + validate -------------------------------------------------------------------------

def _read_file(path: str) -> bytes:
    """Whole file in one read; O_NONBLOCK so a FIFO swapped in after the scan cannot hang us."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file (FIFO, socket or device)")
        data = os.read(fd, st.st_size) if st.st_size else b""
        if len(data) < st.st_size:  # short read: keep going until EOF
            parts = [data]
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def _advise_willneed(paths: Iterable[str]) -> None:
    """Start the kernel reading these files now, asynchronously, without waiting for the data.

    Reading small files one after another waits on the disk once per file (queue depth 1, as tar
    does); hinting the next batch keeps dozens of reads in flight from a single reader thread,
    which is what makes a cold-cache pack faster than tar. Advice only: errors are ignored.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    for path in paths:
        try:
            fd = os.open(path, flags)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, PREFETCH_BYTES, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _make_loader(
    root: str, files: list[str], exts: list[str], validate: str, resize_short: int | None
) -> Callable[[tuple], list[tuple[int, bytes | None, str, str | None]]]:
    """The reader-thread task: read, check and maybe resize a batch of files by index.

    A task is ``(batch, ahead, hint_own)``: it first hints ``ahead`` (the batch this thread will
    most likely read next) to the kernel, so those reads overlap this batch's.
    """
    advise = _advise_willneed if hasattr(os, "posix_fadvise") else lambda paths: None

    def load(task: tuple) -> list[tuple[int, bytes | None, str, str | None]]:
        batch, ahead, hint_own = task
        if hint_own:
            advise([os.path.join(root, files[i]) for i in batch])
        advise([os.path.join(root, files[i]) for i in ahead])
        out = []
        for i in batch:
            ext = exts[i]
            try:
                data = _read_file(os.path.join(root, files[i]))
            except OSError as exc:
                out.append((i, None, ext, f"unreadable: {exc.strerror or exc}"))
                continue
            reason = None
            if validate == "header":
                reason = check_image_bytes(data)
                if reason is not None and decode_error(data) is None:
                    reason = None  # odd but whole (e.g. trailer after EOI): the decoder decides
            elif validate == "decode":
                reason = check_image_bytes(data) if not data else decode_error(data)
            if reason is None and resize_short is not None:
                try:
                    small = resize_short_side(data, resize_short)
                except Exception as exc:
                    reason = f"cannot decode: {exc}"
                else:
                    if small is not None:
                        data, ext = small, "jpg"
            out.append((i, None, ext, reason) if reason else (i, data, ext, None))
        return out

    return load


def _ordered_map(fn: Callable, items: Iterable, workers: int, window: int) -> Iterator:
    """``map(fn, items)`` on ``workers`` threads, at most ``window`` tasks ahead, in input order.

    File reads and PIL release the GIL, so threads overlap I/O (and decoding) with the writing
    done by the consumer. On early exit (error, Ctrl-C) queued tasks are cancelled.
    """
    it = iter(items)
    with ThreadPoolExecutor(workers, thread_name_prefix="shardkit-read") as pool:
        pending = deque(pool.submit(fn, x) for x in islice(it, window))
        try:
            while pending:
                result = pending.popleft().result()
                for x in islice(it, 1):
                    pending.append(pool.submit(fn, x))
                yield result
        finally:
            for f in pending:
                f.cancel()


# --- output directory ------------------------------------------------------------------------


def _within(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def _discard_staging(out: str, staging: str) -> None:
    """Remove a staging dir, and the shards its commit had moved into OUT if that was cut short.

    A staging dir holding a commit journal was stopped while renaming shards into OUT; without a
    manifest those shards are incomplete output, so the names the journal lists are removed.
    """
    journal = os.path.join(staging, _COMMIT_JOURNAL)
    if os.path.exists(journal) and not os.path.exists(os.path.join(out, MANIFEST_NAME)):
        try:
            with open(journal, encoding="utf-8") as f:
                names = json.load(f)["shards"]
        except (OSError, ValueError, KeyError, TypeError):
            names = []
        for shard in names:
            if isinstance(shard, str) and _SHARD_NAME.match(shard):
                _unlink(os.path.join(out, shard))
    shutil.rmtree(staging, ignore_errors=True)


def _clean_stale_staging(out: str) -> None:
    """Remove what interrupted packs left in OUT (a SIGKILL gives no chance to clean up)."""
    for name in os.listdir(out):
        if name.startswith(STAGING_PREFIX):
            _discard_staging(out, os.path.join(out, name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _prepare_out(out: str, src: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputError(f"output {out!r} exists and is not a directory; choose a directory path")
    if _within(out, src):
        raise OutputError(
            f"output {out!r} is inside the source {src!r}; choose a folder outside the source tree"
        )
    if not os.path.isdir(out):
        return
    try:
        _clean_stale_staging(out)
        leftovers = [n for n in os.listdir(out) if not n.startswith(STAGING_PREFIX)]
    except OSError as exc:
        raise OutputError(f"cannot use output {out!r}: {exc.strerror}") from None
    if leftovers and not overwrite:
        raise OutputError(
            f"output directory {out!r} is not empty; pass --overwrite to replace the shards and "
            "manifest in it, or choose an empty directory"
        )


def _old_outputs(out: str) -> list[str]:
    """Shards and manifest of a previous pack in OUT: the files --overwrite replaces."""
    names = {n for n in os.listdir(out) if _SHARD_NAME.match(n)}
    try:
        with open(os.path.join(out, MANIFEST_NAME), encoding="utf-8") as f:
            listed = json.load(f).get("shards", [])
        names |= {
            s["path"]
            for s in listed
            if isinstance(s, dict)
            and isinstance(s.get("path"), str)
            and "/" not in s["path"]
            and not s["path"].startswith(".")
        }
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        pass
    return sorted(n for n in names if os.path.isfile(os.path.join(out, n)))


def _commit(out: str, staging: str, shard_names: list[str], manifest: Manifest) -> str:
    """Move complete shards into OUT and write the manifest last.

    Order matters for a kill at any point: old manifest out first (so no manifest ever describes
    a mix of old and new shards), then a journal naming the shards about to appear (so a rerun
    can remove a half-finished move), then the renames, then the manifest.
    """
    old = _old_outputs(out)
    _unlink(os.path.join(out, MANIFEST_NAME))
    fsync_dir(out)
    with open(os.path.join(staging, _COMMIT_JOURNAL), "w", encoding="utf-8") as f:
        json.dump({"shards": shard_names}, f)
        f.flush()
        os.fsync(f.fileno())
    new = set(shard_names)
    for name in old:
        if name not in new and name != MANIFEST_NAME:
            _unlink(os.path.join(out, name))
    for name in shard_names:
        os.replace(os.path.join(staging, name), os.path.join(out, name))
    fsync_dir(out)
    path = write_manifest(manifest, out)
    shutil.rmtree(staging, ignore_errors=True)
    return path


# --- pack ------------------------------------------------------------------------------------


@dataclass
class PackReport:
    """What ``pack`` did; ``summary()`` is the paragraph the CLI prints."""

    out: str
    manifest_path: str
    format: str
    shards: int
    samples: int
    classes: int
    bytes: int
    seconds: float
    skipped: list[SkippedFile]
    errors: int
    not_images: int
    empty_classes: list[str]

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        s = "s" if self.shards != 1 else ""
        text = (
            f"Packed {self.samples} samples of {self.classes} classes into {self.shards} "
            f"{self.format} shard{s} ({self.bytes / 1e6:.1f} MB) in {self.out} "
            f"in {self.seconds:.1f} s ({self.mb_per_s:.1f} MB/s, "
            f"{self.samples / max(self.seconds, 1e-9):.0f} samples/s). "
            f"Skipped {self.errors} bad or unreadable image(s) and {self.not_images} non-image "
            f"file(s)"
        )
        if self.empty_classes:
            text += f"; {len(self.empty_classes)} empty class folder(s)"
        return text + f". Manifest: {self.manifest_path}"


def _pack_version() -> str:
    try:
        from importlib.metadata import version

        return version("shardkit")
    except Exception:
        return "unknown"


def pack(
    src: str,
    out: str,
    *,
    shard_size: str | int = DEFAULT_SHARD_SIZE,
    format: str = "tar",
    shuffle: bool = True,
    seed: int = 0,
    workers: int = 1,
    on_error: str = "skip",
    overwrite: bool = False,
    resize_short: int | None = None,
    validate: str = "header",
    progress: bool = True,
    on_shard: Callable[[str], None] | None = None,
) -> PackReport:
    """Pack the class-per-folder tree ``src`` into shards in ``out``; see the module docstring.

    ``on_error="skip"`` is the default because real datasets carry a few bad files and a long
    pack should not die on file 900,000 of a million: each one is listed with its reason in the
    manifest's ``skipped`` and a ``PackWarning`` gives the count. ``on_error="raise"`` stops at
    the first one, naming it. ``workers`` is the number of reader threads (the calling thread
    writes). ``on_shard(path)`` is called as each shard is complete (still under its staging
    name, renamed later): uploads to object storage start while later shards are packed. Raises
    InputError / OutputError for unusable arguments.
    """
    started = time.perf_counter()
    fmt = get_format(format)
    limit = parse_size(shard_size)
    if validate not in _VALIDATE:
        raise InputError(f"invalid validate {validate!r}; choose one of: {', '.join(_VALIDATE)}")
    on_error = "raise" if on_error == "fail" else on_error
    if on_error not in _ON_ERROR:
        raise InputError(f"invalid on_error {on_error!r}; choose one of: {', '.join(_ON_ERROR)}")
    if not isinstance(workers, int) or workers < 1:
        raise InputError(f"invalid workers {workers!r}; use 1 or more reader threads")
    if resize_short is not None and (not isinstance(resize_short, int) or resize_short < 1):
        raise InputError(f"invalid resize_short {resize_short!r}; use a positive number of pixels")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"invalid seed {seed!r}; use an integer >= 0")
    src, out = os.fspath(src), os.fspath(out)
    _check_source_dir(src)
    _prepare_out(out, src, overwrite)

    scan = scan_source(src)
    if scan.errors and on_error == "raise":
        bad = scan.errors[0]
        raise InputError(
            f"{os.path.join(src, bad.path)}: {bad.reason}; remove or fix it, or pass "
            "--on-error skip"
        )
    for cls in scan.empty_classes:
        warnings.warn(
            f"class folder {os.path.join(src, cls)!r} has no images; it keeps its label so labels "
            "match the sorted folder list",
            PackWarning,
            stacklevel=2,
        )
    n = len(scan.files)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)

    staging = os.path.join(out, STAGING_PREFIX + secrets.token_hex(6))
    try:
        os.makedirs(out, exist_ok=True)
        os.mkdir(staging)
    except OSError as exc:
        raise OutputError(
            f"cannot create {exc.filename or out!r}: {exc.strerror}; choose a writable output"
        ) from None
    try:
        errors, shard_names, entries, total_bytes = _write_shards(
            scan,
            order,
            fmt,
            limit,
            staging,
            workers,
            validate,
            resize_short,
            on_error,
            progress,
            on_shard,
        )
        skipped = sorted(scan.errors + errors + scan.ignored, key=lambda s: s.path)
        manifest = Manifest(
            shard_format=fmt.name,
            classes=list(scan.classes),
            shards=entries,
            skipped=skipped,
            pack={
                "source": src,
                "shard_size": limit,
                "shuffle": bool(shuffle),
                "seed": int(seed),
                "validate": validate,
                "resize_short": resize_short,
                "resize_quality": RESIZE_QUALITY if resize_short else None,
                "format": fmt.name,
                "on_error": on_error,
                "shardkit_version": _pack_version(),
                "non_image_files": dict(sorted(scan.non_image_exts.items())),
            },
        )
        if not entries:
            first = (scan.errors + errors)[0]
            raise InputError(
                f"source {src!r}: none of its {n + len(scan.errors)} images could be packed "
                f"(first: {first.path}: {first.reason}); see --validate and --on-error"
            )
        manifest_path = _commit(out, staging, shard_names, manifest)
    except BaseException:
        _discard_staging(out, staging)
        raise
    bad = len(scan.errors) + len(errors)
    if bad:
        warnings.warn(
            f"skipped {bad} bad or unreadable image(s) of {n + len(scan.errors)}; their paths and "
            f"reasons are in {manifest_path} under 'skipped'",
            PackWarning,
            stacklevel=2,
        )
    return PackReport(
        out=out,
        manifest_path=manifest_path,
        format=fmt.name,
        shards=len(entries),
        samples=manifest.num_samples,
        classes=len(scan.classes),
        bytes=total_bytes,
        seconds=time.perf_counter() - started,
        skipped=skipped,
        errors=bad,
        not_images=scan.not_images,
        empty_classes=list(scan.empty_classes),
    )


def _write_shards(
    scan: SourceScan,
    order: np.ndarray,
    fmt,
    limit: int,
    staging: str,
    workers: int,
    validate: str,
    resize_short: int | None,
    on_error: str,
    progress: bool,
    on_shard: Callable[[str], None] | None = None,
) -> tuple[list[SkippedFile], list[str], list[ShardEntry], int]:
    """The main-thread loop: consume reads in shuffled order, roll shards at the size limit."""
    from tqdm import tqdm

    root = os.path.abspath(scan.root)
    load = _make_loader(root, scan.files, scan.exts, validate, resize_short)
    idx = order.tolist()
    # Task k reads batch k and hints batch k + workers: with `workers` tasks running at once,
    # that is the batch its thread picks up next.
    nb = (len(idx) + READ_BATCH - 1) // READ_BATCH
    tasks = (
        (
            idx[k * READ_BATCH : (k + 1) * READ_BATCH],
            idx[(k + workers) * READ_BATCH : (k + workers + 1) * READ_BATCH],
            k < workers,
        )
        for k in range(nb)
    )
    keys, labels = scan.keys, scan.labels
    errors: list[SkippedFile] = []
    names: list[str] = []
    entries: list[ShardEntry] = []
    total = 0
    writer = None
    bar = tqdm(
        total=len(idx),
        unit="img",
        file=sys.stderr,
        disable=None if progress else True,
        desc="pack",
        smoothing=0.1,
    )
    t0 = time.perf_counter()
    done_bytes = 0

    def finish() -> None:
        nonlocal writer, total
        stats = writer.close()
        writer = None
        entries.append(
            ShardEntry(
                os.path.basename(stats.path), stats.samples, stats.bytes, stats.sha256,
                stats.index,
            )
        )
        total += stats.bytes
        if on_shard is not None:
            on_shard(stats.path)

    try:
        for results in _ordered_map(load, tasks, workers, READ_AHEAD * workers):
            for i, data, ext, reason in results:
                if data is None:
                    if on_error == "raise":
                        raise InputError(
                            f"{os.path.join(scan.root, scan.files[i])}: {reason}; remove or fix "
                            "it, or pass --on-error skip"
                        )
                    errors.append(SkippedFile(scan.files[i], reason))
                    continue
                key = keys[i]
                if writer is not None and writer.projected_size(key, ext, len(data)) > limit:
                    finish()
                if writer is None:
                    names.append(f"shard-{len(names):06d}{fmt.suffix}")
                    writer = fmt.open_writer(os.path.join(staging, names[-1]))
                writer.add(key, ext, data, labels[i])
                done_bytes += len(data)
            bar.update(len(results))
            if not bar.disable:
                secs = time.perf_counter() - t0
                bar.set_postfix_str(f"{done_bytes / 1e6 / max(secs, 1e-9):.1f} MB/s", refresh=False)
        if writer is not None:
            finish()
    except OSError as exc:
        if writer is not None:
            writer.abort()
        raise OutputError(
            f"cannot write shards under {os.path.dirname(staging)!r}: {exc.strerror or exc}"
        ) from None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
    return errors, names, entries, total
