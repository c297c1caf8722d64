"""The one scanner of a source: what ``pack`` packs and what ``FolderDataset`` reads, by
construction (a class-per-folder tree, a table, or img2dataset's output folder).

The modules, in the order a scan runs: ``folder.py`` (``scan_source``, the one entry, and the
folder walk: which files are samples, their fields), ``table.py`` (tables as a source: CSV, TSV,
JSONL, Parquet, and img2dataset's layout, scanned in spans on an engine), ``spans.py`` (a
table cut into spans of rows that any process reads alone), ``pieces.py`` (the spans' arrays
written where they were scanned and joined on disk, an engine's driver mapping the columns),
``members.py`` (images inside a
tar, read in place), ``keys.py`` (a sample's key from its path; repeats found from hashes),
``source.py`` (the ``SourceScan`` record both users read) and ``strings.py`` (``StrTable``:
per-sample strings as numpy arrays, fork-friendly).
"""

from .folder import check_source_dir, scan_source
from .keys import repeats
from .members import is_image_file, member_of, member_path, member_stat, read_member
from .source import (
    EMPTY_FILE,
    FIELD_SEP,
    LIST_NON_IMAGES,
    STRAY_IMAGE,
    SourceScan,
    field_files,
    inline_fields,
)
from .strings import StrTable
from .table import img2dataset_tables, is_table, scan_table, scan_tables

__all__ = [
    "EMPTY_FILE",
    "FIELD_SEP",
    "STRAY_IMAGE",
    "LIST_NON_IMAGES",
    "SourceScan",
    "StrTable",
    "check_source_dir",
    "field_files",
    "inline_fields",
    "img2dataset_tables",
    "is_image_file",
    "is_table",
    "member_of",
    "member_path",
    "member_stat",
    "read_member",
    "repeats",
    "scan_source",
    "scan_table",
    "scan_tables",
]
