"""``SourceScan``: what a scan found in SRC (a folder or tables), the record ``pack`` and
``FolderDataset`` both read; the field spellings it stores and how they read back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..images.checks import IMAGE_EXTENSIONS
from ..manifest import SkippedFile
from .strings import StrTable

#: Non-image files listed one by one in the manifest's ``skipped``; past this they are only
#: counted (by extension), so a tree with a sidecar .json per image keeps a small manifest.
LIST_NON_IMAGES = 1000
#: The reason an image-named file of zero bytes is listed as an error (``check_image_bytes``'s).
EMPTY_FILE = "empty file"
#: The reason for an image file directly in SRC: it has no class, so it is no sample.
STRAY_IMAGE = "stray image, not in a class folder (SRC/<class>/<image>)"


#: Separates a sample's field suffixes in ``SourceScan.sidecars`` (no file name holds a ``/``).
FIELD_SEP = "/"


@dataclass
class SourceScan:
    """What is in SRC, in the sorted order that shuffling permutes.

    ``files``/``keys``/``exts``/``sidecars`` (``StrTable``) and ``labels`` (int64 array) are
    parallel; ``sidecars[i]`` holds sample i's field files as their suffixes after the key's dot,
    as spelled on disk, joined by ``FIELD_SEP`` (``"txt/seg.png"``; ``""``: none; see
    ``fields_of``), and ``field_counts`` counts the samples carrying each field;
    ``errors`` are image-named entries that cannot be read (subject to ``on_error``);
    ``ignored`` are non-images (the first ``LIST_NON_IMAGES``) and directories met twice: never
    errors, but listed in the manifest so nothing disappears silently. ``non_image_exts``
    counts every non-image by extension.
    """

    root: str
    classes: list[str]
    files: StrTable = field(default_factory=StrTable)
    keys: StrTable = field(default_factory=StrTable)
    exts: StrTable = field(default_factory=StrTable)
    sidecars: StrTable = field(default_factory=StrTable)
    #: A table's fields held in the table itself, per sample a JSON object (``""``: none).
    inline: StrTable = field(default_factory=StrTable)
    field_counts: dict[str, int] = field(default_factory=dict)
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    errors: list[SkippedFile] = field(default_factory=list)
    ignored: list[SkippedFile] = field(default_factory=list)
    not_images: int = 0
    non_image_exts: dict[str, int] = field(default_factory=dict)
    empty_classes: list[str] = field(default_factory=list)
    #: Symbolic links (to files or folders) that lead outside SRC: followed, and counted so
    #: ``pack`` can say so once (a symlink farm is a normal dataset layout, a stray link is not).
    outside_links: int = 0
    #: img2dataset rows whose ``status`` is not ``success``: no image was ever downloaded. Listed
    #: in ``ignored`` with the non-images (the first ``LIST_NON_IMAGES`` together), counted apart.
    failed_downloads: int = 0
    #: Keys taken from a ``key`` column (img2dataset's own) rather than made from paths; then
    #: ``again`` marks each row whose key an earlier row holds (the table rule: first row wins).
    keyed: bool = False
    again: np.ndarray | None = None
    #: Rows of tables (their errors name ``TABLE:LINE``), not files of a folder.
    from_table: bool = False
    #: ``(size, mtime_ns)`` of each file (an (n, 2) int64 array) from the walk's own ``stat`` of
    #: it (a table's: of each accepted row's image), so a plan (and the "up to date" check)
    #: need not ``stat`` every file again; None: not taken.
    stats: np.ndarray | None = None

    def fields_of(self, i: int) -> list[tuple[str, str]]:
        """``(field name, path relative to SRC)`` of sample ``i``'s sidecar files, in name order."""
        return field_files(self.files[i], self.sidecars[i] if len(self.sidecars) else "")

    def inline_fields(self, i: int) -> dict[str, bytes]:
        """Sample ``i``'s fields from a table row, as stored: ``txt`` UTF-8, ``json`` JSON."""
        return inline_fields(self.inline[i] if len(self.inline) else "")

    def add_non_image(self, rel: str, reason: str) -> None:
        name = rel.rsplit("/", 1)[-1]
        ext = name[name.rfind(".") :].lower() if name.rfind(".") > 0 else "(none)"
        self.non_image_exts[ext] = self.non_image_exts.get(ext, 0) + 1
        self.not_images += 1
        if self.not_images <= LIST_NON_IMAGES:
            self.ignored.append(SkippedFile(rel, reason))

    def add_failed_download(self, rel: str, reason: str) -> None:
        """A row img2dataset could not download: no sample, and no file that is not an image."""
        self.failed_downloads += 1
        if len(self.ignored) < LIST_NON_IMAGES:
            self.ignored.append(SkippedFile(rel, reason))


def field_files(rel: str, suffixes: str) -> list[tuple[str, str]]:
    """``(field name, path)`` of the field files of the image at ``rel`` (``SourceScan.sidecars``
    form: suffixes joined by ``FIELD_SEP``)."""
    if not suffixes:
        return []
    cut = rel.rfind("/") + 1
    stem = rel[: cut + rel[cut:].find(".")]
    return [(s.lower(), f"{stem}.{s}") for s in suffixes.split(FIELD_SEP)]


def inline_fields(text: str) -> dict[str, bytes]:
    """A table row's fields (``SourceScan.inline`` form) as stored: ``txt`` UTF-8, else JSON."""
    if not text:
        return {}
    return {
        k: v.encode() if isinstance(v, str) else json.dumps(v, ensure_ascii=False).encode()
        for k, v in json.loads(text).items()
    }


def _image_ext(name: str) -> str | None:
    dot = name.rfind(".")
    if dot <= 0:
        return None
    ext = name[dot + 1 :].lower()
    return ext if ext in IMAGE_EXTENSIONS else None
