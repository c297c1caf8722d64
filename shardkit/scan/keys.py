"""A sample's key from its path, and repeated keys or rows found from hashes: the one key rule
of a folder (per class, lists) and of a table (whole-table arrays, strings compared only where
hashes meet), which must agree exactly.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

import numpy as np

from ..formats import encode_key
from .strings import StrTable


def _assign_keys(rels: list[str], exts: list[str]) -> list[str]:
    """Key = relative path without extension; with it where two files share a stem (x.jpg, x.png).

    ``encode_key`` makes keys dot-free, so the with-extension form stays a valid key.
    """
    stems = [rel[: -len(ext) - 1] for rel, ext in zip(rels, exts, strict=True)]
    if len(set(stems)) == len(stems):  # the usual case: encode_key keeps distinct stems distinct
        # encode_key works character by character and no path holds a NUL: one call per list
        return encode_key("\0".join(stems)).split("\0") if stems else []
    counts: dict[str, int] = {}
    for s, _ in set(zip(stems, rels, strict=True)):  # a file a table lists twice is one file
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


def _hash(s: str) -> int:
    """Python's hash of ``s``: equal strings, equal hashes (rows are compared where they meet)."""
    return hash(s)


def _hashes(strings: Iterable[str], n: int) -> np.ndarray:
    return np.fromiter((_hash(s) for s in strings), dtype=np.int64, count=n)


#: Buckets (by a hash's top four bits) ``_meeting`` sorts one at a time: its sort's arrays are
#: a sixteenth of the rows', beside the hashes themselves.
MEET_BUCKETS = 16


def _meeting(hashes: np.ndarray) -> np.ndarray:
    """The rows whose hash some other row shares, in row order: the only rows that may hold
    a string another row holds (the few others a collision brings are compared exactly).
    Equal hashes share their top bits, so each bucket of them is sorted alone."""
    return _by_bucket(hashes, _meeting_in)


def _by_bucket(hashes: np.ndarray, find) -> np.ndarray:
    """``find(hashes of rows, rows)`` (rows found among them, sorted) over ``MEET_BUCKETS``
    buckets of the hashes' top bits, joined in row order: rows of equal hashes share a bucket
    (every row falls in one, whatever the count: a count of 2 once dropped the rows of the
    fourteen buckets past it)."""
    hashes = np.ascontiguousarray(hashes, dtype=np.int64)
    if len(hashes) < MEET_BUCKETS << 12:
        return find(hashes, np.arange(len(hashes)))
    top = hashes.view(np.uint8)[7::8] if _LITTLE else hashes.view(np.uint8)[::8]
    bucket = (top.astype(np.uint16) * MEET_BUCKETS) >> 8  # the top bits: MEET_BUCKETS of them
    found = []
    for b in range(MEET_BUCKETS):
        rows = np.flatnonzero(bucket == b)
        found.append(find(hashes[rows], rows))
    return np.sort(np.concatenate(found))


_LITTLE = np.little_endian


def _meeting_in(hashes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``_meeting`` of ``hashes``, the hashes of ``rows``: those of ``rows`` that meet."""
    order = np.argsort(hashes, kind="stable")
    same = hashes[order[1:]] == hashes[order[:-1]]
    mark = np.zeros(len(hashes), dtype=bool)
    mark[1:] |= same
    mark[:-1] |= same
    return np.sort(rows[order[mark]])


def repeats(table: StrTable) -> np.ndarray:
    """Per row of ``table``: whether an earlier row holds the same string (a bool array)."""
    again = np.zeros(len(table), dtype=bool)
    seen: set[str] = set()
    for i in _meeting(_hashes(table, len(table))).tolist():
        s = table[i]
        again[i] = s in seen
        seen.add(s)
    return again


def _mixed(hashes: np.ndarray, spelling: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Those of ``rows`` whose stem hash (``hashes``) rows of other spellings share."""
    if not len(rows):
        return rows
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    starts = np.ones(len(rows), dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    runs = np.flatnonzero(starts)
    by_run = spelling[order]
    mixed = np.minimum.reduceat(by_run, runs) != np.maximum.reduceat(by_run, runs)
    return np.sort(rows[order[mixed[np.cumsum(starts) - 1]]])


def _table_keys(files: StrTable, exts: StrTable, make=StrTable) -> StrTable:
    """``_assign_keys`` of a table's rows, from hashes: the same keys without a Python str per
    row held (only the rows whose stem or key another row shares are compared as strings).
    ``make``: what builds a ``StrTable`` from the keys (``scan.pieces.on_disk``: on disk)."""
    # Files sharing a stem: two spellings of one stem differ only in their extension, so a
    # stem is shared where rows of one stem hash spell their extensions differently.
    spelled: dict[str, int] = {}
    stem_hashes, spelling = array("q"), array("i")  # 8 and 4 bytes a row, no int objects
    for r, e in _pairs(files, exts):
        stem_hashes.append(_hash(r[: -len(e) - 1]))
        spelling.append(spelled.setdefault(r[-len(e) :], len(spelled)))
    stem_hashes = np.frombuffer(stem_hashes, dtype=np.int64)
    spelling = np.frombuffer(spelling, dtype=np.int32)
    shared = np.zeros(0, dtype=np.int64)
    if len(spelled) > 1:
        sp = spelling
        shared = _by_bucket(stem_hashes, lambda h, rows: _mixed(h, sp[rows], rows))
        del sp
    del stem_hashes, spelling
    by_stem: dict[str, set[str]] = {}
    for i in shared.tolist():
        rel, ext = files[i], exts[i]
        by_stem.setdefault(rel[: -len(ext) - 1], set()).add(rel)
    long = {s for s, rels in by_stem.items() if len(rels) > 1}  # keyed with their extension

    def natural() -> Iterator[str]:
        for rel, ext in _pairs(files, exts):
            stem = rel[: -len(ext) - 1]
            yield encode_key(rel if stem in long else stem)

    hashed = array("q")

    def record(keys: Iterator[str]) -> Iterator[str]:
        for key in keys:
            hashed.append(_hash(key))
            yield key

    keys = make(record(natural()))
    key_hashes = np.frombuffer(hashed, dtype=np.int64)
    meet = _meeting(key_hashes)
    if not len(meet):
        return keys
    return _suffixed(files, exts, long, keys, key_hashes, meet, make)


def _suffixed(files, exts, long: set, keys: StrTable, key_hashes, meet, make) -> StrTable:
    """``keys`` with a ~N suffix on each key met again, in row order (``meet``: the rows whose
    key hash another row shares); if a suffixed key could be another row's own key (names
    that end in ~N), the exact sequential rule of ``_assign_keys`` decides."""
    fixed, used = {}, set()
    for i in meet.tolist():
        rel, ext = files[i], exts[i]
        stem = rel[: -len(ext) - 1]
        key = base = encode_key(rel if stem in long else stem)
        k = 1
        while key in used:
            k += 1
            key = f"{base}~{k}"
        used.add(key)
        if key != base:
            fixed[i] = key
    known = np.sort(key_hashes)
    made = np.array([_hash(k) for k in fixed.values()], dtype=np.int64)
    pos = np.minimum(np.searchsorted(known, made), len(known) - 1)
    if (known[pos] == made).any():
        return make(_assign_keys(list(files), list(exts)))
    return make(fixed.get(i, k) for i, k in enumerate(keys))


def _pairs(files: StrTable, exts: StrTable) -> Iterator[tuple[str, str]]:
    return zip(files, exts, strict=True)


def _column_keys(raw: StrTable, make=StrTable) -> tuple[StrTable, np.ndarray | None]:
    """Keys from a key column, and which rows repeat an earlier row's key (None: none do).

    A repeated key (one table listing a row twice, or two img2dataset runs in one folder) gets
    ``~2``, ``~3``... in row order, the suffix a table's repeated image gets: the pack keeps
    the first row unless ``allow_duplicates``, and then every key is still distinct.
    ``make``: as ``_table_keys``'s. Only the rows whose key hash another row's meets are
    held as str (their keys, and the ~N they get)."""
    hashes = _hashes(raw, len(raw))
    meet = _meeting(hashes)
    again = np.zeros(len(raw), dtype=bool)
    fixed: dict[int, str] = {}
    used: set[str] = set()
    seen: set[str] = set()  # the keys as the table spells them (``repeats``)
    for i in meet.tolist():
        key = base = raw[i]
        again[i] = key in seen
        seen.add(key)
        n = 1
        while key in used:
            n += 1
            key = f"{base}~{n}"
        used.add(key)
        if n > 1:
            fixed[i] = key
    if not again.any():
        return raw, None
    known = np.sort(hashes)
    made = np.array([_hash(k) for k in fixed.values()], dtype=np.int64)
    pos = np.minimum(np.searchsorted(known, made), len(known) - 1)
    if (known[pos] == made).any():  # a ~N that may be another row's own key: row by row
        return make(_sequential(raw)), again
    return make(fixed.get(i, k) for i, k in enumerate(raw)), again


def _sequential(raw: StrTable) -> Iterator[str]:
    """Each key of ``raw``, a repeat of an earlier one given the first free ~N (the rule)."""
    used: set[str] = set()
    for key in raw:
        base, n = key, 1
        while key in used:
            n += 1
            key = f"{base}~{n}"
        used.add(key)
        yield key
