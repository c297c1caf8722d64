"""The folder walk, and ``scan_source``, the one entry: what ``pack`` packs and what
``FolderDataset`` reads, by construction.

A class-per-folder tree (``SRC/<class>/.../<image>``) becomes sorted classes, sorted files,
labels and keys. Both users share every policy: hidden names ignored, directory symlinks followed
once (a directory met again is listed, never re-walked, so loops end), links that lead outside
SRC followed but counted (``pack`` warns once with the count), and only regular files
named like images are images: FIFOs, sockets, devices and broken links are listed as errors
(opening a FIFO would block forever), and so are empty files (a zero-byte ``x.jpg`` is no sample
on either side: ``FolderDataset`` would fail to decode it where ``pack`` skips it).

A sample is what shares a WebDataset key: in one folder, the files whose names agree up to the
first dot (``x.jpg``, ``x.txt``, ``x.json``, ``x.seg.png``). The member whose extension is a plain
image type (``jpg``, not ``seg.png``) is the image; every other member is a field named by its
extension, lowercased (``txt``, ``json``, ``seg.png``). A file that shares no key with a plain
image keeps the older rule (``a.b.jpg`` alone is an image, key ``a%2Eb``; a stray ``notes.txt`` in
a folder of bare images is listed as ignored); but in a folder where images carry fields, a
non-image without its image is an error naming file and key (a caption that lost its picture).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from itertools import islice
from operator import attrgetter
from stat import S_ISREG

import numpy as np

from ..errors import InputError
from ..formats import encode_key
from ..formats.tar import LABEL_EXTS
from ..images.checks import IMAGE_EXTENSIONS
from ..manifest import SkippedFile, portable_text
from .keys import _assign_keys
from .source import (
    EMPTY_FILE,
    FIELD_SEP,
    STRAY_IMAGE,
    SourceScan,
    _image_ext,
)
from .strings import StrTable
from .table import TABLE_SUFFIXES, img2dataset_tables, is_table, scan_table, scan_tables

_FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_NAME = attrgetter("name")


def scan_source(
    src: str, progress: bool = False, root: str | None = None, engine=None, work=None
) -> SourceScan:
    """List the images of a class-per-folder tree (or of a table: see ``scan_table``).

    Classes are the sorted names of SRC's sub-directories; images anywhere below a class folder
    belong to it. Hidden names (leading dot: ``.DS_Store``, ``._x.jpg``, ``.ipynb_checkpoints``)
    are ignored. Directory symlinks are followed once: a directory met again (a loop, or two links
    to one folder) is listed as ignored, so the walk always ends. ``progress``: per class folder
    (listing 1.28M files takes a while on a network disk). ``engine``: a runner whose
    ``map_chunks`` scans a table's rows in spans on its workers (``scan_tables``), into
    pieces under the folder ``work`` (OUT) where given.
    """
    from ..progress import Progress

    check_source_dir(src)
    if is_table(src):
        return scan_table(src, root, engine=engine, work=work)
    tables = img2dataset_tables(src) if root is None else []
    if tables:  # img2dataset's output: its tables, their images in the tars (or folders) beside
        return scan_tables(tables, src, src, engine=engine, work=work)
    if root is not None:
        raise InputError(f"root={root!r} is for a table source; {src!r} is a folder")
    root = os.path.abspath(src)
    try:
        with os.scandir(root) as it:
            top = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as exc:
        raise InputError(f"cannot list source {src!r}: {exc.strerror}") from None
    scan = SourceScan(root=src, classes=[])
    folders: list[str] = []  # the class folders' own names; scan.classes are their text names
    for entry in top:
        if _is_dir(entry):
            folders.append(entry.name)
            scan.classes.append(portable_text(entry.name))
        else:
            stray = _image_ext(entry.name) is not None
            scan.add_non_image(entry.name, STRAY_IMAGE if stray else "not in a class folder")
    real_root = os.path.realpath(root)
    scan.outside_links = sum(_leaves(e, real_root) for e in top if e.name in folders)
    seen = {_ident(root)}
    # One class at a time into numpy tables, concatenated at the end: the Python lists live for
    # one class only (at 1.28M files, lists of every path, key and label peaked at ~300 B/file).
    files: list[StrTable] = []
    exts: list[StrTable] = []
    keys: list[StrTable] = []
    sidecars: list[StrTable] = []
    labels: list[np.ndarray] = []
    idents: list[np.ndarray] = []  # per file: device, inode, 1 if reached through a symlink
    stat_parts: list[np.ndarray] = []  # per file: size, mtime_ns
    bar = Progress(len(folders), f"scan {src}", "class", enabled=progress)
    for label, cls in enumerate(folders):
        rels: list[str] = []
        cls_exts: list[str] = []
        ids: list[tuple[int, ...]] = []
        sides: list[str] = []
        _walk_class(root, cls, seen, scan, rels, cls_exts, real_root, ids, sides)
        bar.update(1)
        if not rels:
            scan.empty_classes.append(scan.classes[label])
            continue
        rels, cls_exts, sides, ids = _sorted_by_path(rels, cls_exts, sides, ids)
        sidecars.append(_blanks(len(sides)) if not any(sides) else StrTable(sides))
        both = np.array(ids, dtype=np.int64).reshape(-1, 5)  # one class's, then apart:
        idents.append(both[:, :3].copy())
        stat_parts.append(both[:, 3:].copy())
        del both
        files.append(StrTable(rels))
        exts.append(StrTable(cls_exts))
        keys.append(StrTable(_assign_keys(rels, cls_exts)))
        labels.append(np.full(len(rels), label, dtype=np.int64))
        del rels, cls_exts
    bar.close()
    scan.files, scan.exts, scan.keys, scan.sidecars = (
        StrTable.concat(t) for t in (files, exts, keys, sidecars)
    )
    scan.labels = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
    if idents:
        scan.stats = np.concatenate(stat_parts)
        _drop_linked_twins(scan, np.concatenate(idents))
    if scan.sidecars.blob.size:  # some sample has field files
        _count_fields(scan, (s.lower().split(FIELD_SEP) if s else () for s in scan.sidecars))
    _refuse_empty(src, scan)
    return scan


def _refuse_empty(src: str, scan: SourceScan) -> None:
    """A source with no class folder, or no image in them, is an error that says what it holds."""
    if not scan.classes:
        tars = (
            ""
            if not scan.non_image_exts.get(".tar")
            else (
                f"; its .tar files are shards: `shardkit index {src}` lists them as they are "
                "(with img2dataset's .parquet tables beside them, `shardkit pack` reads both)"
            )
        )
        raise InputError(
            f"source {src!r} has no class folders; expected one sub-folder of images per class "
            f"(SRC/<class>/<image>.jpg){tars}"
        )
    if not len(scan.files) and not scan.errors:
        raise InputError(
            f"source {src!r} has no images (.{', .'.join(sorted(IMAGE_EXTENSIONS))}) in its "
            f"{len(scan.classes)} class folder(s)"
        )


def _sorted_by_path(rels: list[str], *parallel: list) -> tuple[list, ...]:
    """``rels`` and its parallel lists in path order (as listed already in a flat folder)."""
    if all(a < b for a, b in zip(rels, islice(rels, 1, None), strict=False)):
        return (rels, *parallel)
    order = sorted(range(len(rels)), key=rels.__getitem__)
    return tuple([x[i] for i in order] for x in (rels, *parallel))


def _blanks(n: int) -> StrTable:
    """A table of ``n`` empty strings (a class folder without field files), made from arrays."""
    out = StrTable()
    out.offsets = np.zeros(n + 1, dtype=np.int64)
    return out


def _count_fields(scan: SourceScan, per_sample: Iterable[Iterable[str]]) -> None:
    for names in per_sample:
        for name in names:
            scan.field_counts[name] = scan.field_counts.get(name, 0) + 1
    scan.field_counts = dict(sorted(scan.field_counts.items()))


def _drop_linked_twins(scan: SourceScan, idents: np.ndarray) -> None:
    """A symbolic link to a file that is already a sample is no second sample: listed as ignored.

    ``idents``: (device, inode, via-link) per file. Of files sharing a device and inode, those
    reached without a link stay (hard links are separate files to every tool); links go, unless
    only links lead there (a farm of links to files outside SRC): then the first stays.
    """
    order = np.lexsort((idents[:, 2], idents[:, 1], idents[:, 0]))
    dup = np.zeros(len(idents), dtype=bool)
    same = np.ones(len(order) - 1, dtype=bool)
    for col in (0, 1):  # a column at a time: 8 bytes a file of temporaries, not 32
        ordered = idents[order, col]
        same &= ordered[1:] == ordered[:-1]
        del ordered
    if not (same & (idents[order[1:], 2] != 0)).any():  # no link to a file met before it
        return
    keep_of: dict[tuple[int, int], int] = {}
    for pos, i in enumerate(order.tolist()):
        ident = (int(idents[i, 0]), int(idents[i, 1]))
        if pos > 0 and same[pos - 1] and idents[i, 2]:
            dup[i] = True
            first = scan.files[keep_of[ident]]
            scan.ignored.append(SkippedFile(scan.files[i], f"symbolic link to {first}, a sample"))
        else:
            keep_of.setdefault(ident, i)
    if dup.any():
        keep = ~dup
        scan.files, scan.keys, scan.exts, scan.sidecars = (
            StrTable(t[i] for i in np.flatnonzero(keep).tolist())
            for t in (scan.files, scan.keys, scan.exts, scan.sidecars)
        )
        scan.labels = scan.labels[keep]
        if scan.stats is not None:
            scan.stats = scan.stats[keep]


def check_source_dir(src: str) -> None:
    if not os.path.exists(src):
        raise InputError(
            f"source {src!r} does not exist; pass a folder with one sub-folder per class"
        )
    if str(src).lower().endswith((".tar", ".tar.gz", ".tgz")) and os.path.isfile(src):
        raise InputError(
            f"source {src!r} is a tar shard, which pack does not repack; `shardkit index` "
            "gives tars a manifest as they are (img2dataset's: `shardkit pack` its folder or "
            "the .parquet table beside the tar, which read the images from it)"
        )
    if not os.path.isdir(src) and not (is_table(src) and os.path.isfile(src)):
        raise InputError(
            f"source {src!r} is not a directory; pass a folder with one sub-folder per class, "
            f"or a table ({', '.join(TABLE_SUFFIXES)})"
        )


def _ident(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symlinks; a link to itself raises ELOOP
    except OSError:
        return False


def _leaves(entry: os.DirEntry, real_root: str) -> bool:
    """Whether ``entry`` is a symbolic link whose target lies outside ``real_root``."""
    try:
        if not entry.is_symlink():
            return False
    except OSError:
        return False
    target = os.path.realpath(entry.path)
    return target != real_root and not target.startswith(real_root.rstrip(os.sep) + os.sep)


def _walk_class(
    root: str,
    cls: str,
    seen: set,
    scan: SourceScan,
    rels: list[str],
    exts: list[str],
    real_root: str,
    ids: list[tuple[int, ...]],
    sides: list[str],
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
        subdirs, files = [], []
        for entry in entries:
            try:
                link = entry.is_symlink()
            except OSError:
                link = False
            if link:  # (inline: this runs per file)
                scan.outside_links += _leaves(entry, real_root)
            (subdirs if _is_dir(entry) else files).append(entry)
        _group_folder(rel_dir, sorted(files, key=_NAME), scan, rels, exts, ids, sides)
        stack.extend(sorted((f"{rel_dir}/{e.name}" for e in subdirs), reverse=True))


def _split_key(name: str) -> tuple[str, str]:
    """``(key stem, suffix)``: the name up to its first dot and what follows (WebDataset's)."""
    dot = name.find(".")
    return (name, "") if dot <= 0 else (name[:dot], name[dot + 1 :])


def _group_folder(
    rel_dir: str,
    files: list[os.DirEntry],
    scan: SourceScan,
    rels: list[str],
    exts: list[str],
    ids: list[tuple[int, ...]],
    sides: list[str],
) -> None:
    """The samples of one folder's files: images first, then each sidecar joins its image."""
    split = [_split_key(entry.name) for entry in files]  # once per file: this runs per file
    plain: dict[str, list[str]] = {}  # key stem -> names of its plain-image members
    for entry, (stem, suffix) in zip(files, split, strict=True):
        if suffix.lower() in IMAGE_EXTENSIONS:
            plain.setdefault(stem, []).append(entry.name)
    position: dict[str, int] = {}  # key stem -> index in rels of its one plain image
    others: list[os.DirEntry] = []
    for entry, (stem, suffix) in zip(files, split, strict=True):
        low = suffix.lower()
        is_plain = low in IMAGE_EXTENSIONS
        ext = low if is_plain else _image_ext(entry.name)  # a plain suffix holds no dot
        if not is_plain and (stem in plain or ext is None):
            others.append(entry)  # a field of a sample, or not an image at all
            continue
        if _add_image(f"{rel_dir}/{entry.name}", entry, ext, scan, rels, exts, ids):
            sides.append("")
            if is_plain and len(plain[stem]) == 1:
                position[stem] = len(rels) - 1
    _attach_fields(rel_dir, others, plain, position, scan, sides)


def _attach_fields(rel_dir, others, plain, position, scan: SourceScan, sides: list[str]) -> None:
    """Each non-image file of a folder joins its key's image as a field, or is listed."""
    fields: dict[int, dict[str, str]] = {}
    captioned = any(_split_key(e.name)[0] in position for e in others)
    for entry in others:
        rel = f"{rel_dir}/{entry.name}"
        stem, suffix = _split_key(entry.name)
        key = encode_key(f"{rel_dir}/{stem}")
        if stem in plain and stem not in position:
            images = plain[stem]
            if len(images) > 1:
                scan.errors.append(
                    SkippedFile(
                        rel,
                        f"field of key {key!r}, which has {len(images)} images "
                        f"({', '.join(sorted(images))}): keep one image per key",
                    )
                )
            # else: its one image was unusable (listed already); the field goes with it
            continue
        if stem not in position:
            if captioned:
                scan.errors.append(
                    SkippedFile(
                        rel,
                        f"no image with key {key!r} beside this file (a sidecar without its "
                        "image): add the image or remove the file",
                    )
                )
            else:
                scan.add_non_image(rel, "not an image")
            continue
        reason = _field_problem(suffix, entry)
        have = fields.setdefault(position[stem], {})
        if reason is None and suffix.lower() in have:
            reason = f"a second {suffix.lower()!r} field (beside {have[suffix.lower()]})"
        if reason is not None:
            scan.errors.append(SkippedFile(rel, f"field of key {key!r}: {reason}"))
            continue
        have[suffix.lower()] = suffix
    for i, named in fields.items():
        sides[i] = FIELD_SEP.join(named[n] for n in sorted(named))


def _field_problem(suffix: str, entry: os.DirEntry) -> str | None:
    """Why a sidecar file cannot be a field (its name, or what kind of file it is), or None."""
    name = suffix.lower()
    if not _FIELD_NAME.match(suffix) or name in LABEL_EXTS:
        return (
            f"{suffix!r} cannot be a field name (letters, digits, _ - . only; not "
            f"{'/'.join(sorted(LABEL_EXTS))}): rename the file"
        )
    try:
        if entry.is_file():
            return None
    except OSError:
        pass
    if entry.is_symlink() and not os.path.exists(entry.path):
        return "unreadable: broken symbolic link"
    return "unreadable: not a regular file (FIFO, socket or device)"


def _add_image(
    rel: str,
    entry: os.DirEntry,
    ext: str | None,
    scan: SourceScan,
    rels: list[str],
    exts: list[str],
    ids: list[tuple[int, ...]],
) -> bool:
    """List one image-named file as a sample (True) or as an error (False)."""
    try:
        st = entry.stat()  # links followed, as is_file() would; one call per file
    except OSError:
        st = None
    if st is not None and not S_ISREG(st.st_mode):
        st = None
    if st is not None and st.st_size == 0:  # pack's header check would say the same
        scan.errors.append(SkippedFile(rel, EMPTY_FILE))
    elif st is not None:
        rels.append(rel)
        exts.append(ext)
        ids.append((st.st_dev, st.st_ino, int(entry.is_symlink()), st.st_size, st.st_mtime_ns))
        return True
    elif entry.is_symlink() and not os.path.exists(entry.path):
        scan.errors.append(SkippedFile(rel, "unreadable: broken symbolic link"))
    else:
        scan.errors.append(
            SkippedFile(rel, "unreadable: not a regular file (FIFO, socket or device)")
        )
    return False
