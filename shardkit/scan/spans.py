"""A table cut into spans of rows that any process reads alone, and a span's rows read back:
CSV, TSV and JSONL by byte ranges that start and end on a row boundary, Parquet by row groups.

An engine scans a table a span at a time (``scan.table``): the driver reads the table once to
find where every ``rows``-th row starts (no row is kept), and each span is read again where it
runs. Text is split into lines from its bytes (``\\n``, ``\\r`` and ``\\r\\n``, as Python's
universal newlines) and each line decoded on its own, so a byte that is not UTF-8 is an error
of its own line, whichever span meets it.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import InputError
from ..extras import require

__all__ = ["TableSpan", "cut_table", "span_rows"]

#: Rows of a Parquet table converted to Python at a time (read a row group's batch at a time).
PARQUET_BATCH = 4096
#: The longest cell a CSV/TSV table may hold (a long caption); Python's csv module alone stops
#: at 128 KiB. A longer cell is an error naming the table and line.
MAX_TABLE_CELL = 64 << 20
#: Bytes of a text table read at a time (lines are cut from them).
READ_BLOCK = 1 << 20


@dataclass(frozen=True)
class TableSpan:
    """Consecutive rows of one table: of a text table the bytes ``start..end`` (``end`` None:
    to the end of the file), which begin after line ``line``; of a Parquet table the row groups
    ``start..end``, which begin after row ``line``. ``header``: a CSV/TSV table's header row."""

    path: str
    start: int
    end: int | None
    line: int
    header: tuple[str, ...] | None = None

    def __repr__(self) -> str:
        unit = "row groups" if _kind(self.path) == "parquet" else "bytes"
        return f"rows of {self.path} after line {self.line} ({unit} {self.start}..{self.end})"


def _kind(path: str) -> str:
    low = path.lower()
    return next((k for k in ("parquet", "jsonl", "tsv") if low.endswith("." + k)), "csv")


class _Lines:
    """The lines of a text table from byte ``start`` to ``end``, each decoded alone; ``pos`` is
    the byte offset after the last line handed out, ``n`` the lines handed out."""

    def __init__(self, path: str, start: int, end: int | None, line: int):
        self.path, self.pos, self.end, self.line, self.n = path, start, end, line, 0
        try:
            self.f = open(path, "rb")
        except OSError as exc:
            raise InputError(f"cannot read table {path!r}: {exc.strerror}") from None
        self.f.seek(start)
        self.lines: list[bytes] = []
        self.tail = b""
        self.bom = start == 0

    def close(self) -> None:
        self.f.close()

    def __iter__(self) -> Iterator[str]:
        return self

    def raw(self) -> bytes | None:
        """The next line's bytes, not decoded (None: no more)."""
        if self.end is not None and self.pos >= self.end:
            return None
        if not self.lines and not self._fill():
            return None
        raw = self.lines.pop()
        self.pos += len(raw)
        self.n += 1
        return raw

    def __next__(self) -> str:
        raw = self.raw()
        if raw is None:
            raise StopIteration
        if self.bom:
            self.bom = False
            if raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]  # Excel's "CSV UTF-8"
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{self.path}:{self.line + self.n}: not UTF-8 text ({exc.reason}); save it as UTF-8"
            ) from None

    def _fill(self) -> bool:
        """Cut the next lines from the file (reversed, for ``pop``); False at its end."""
        while True:
            block = self.f.read(READ_BLOCK)
            data = self.tail + block
            if not data:
                return False
            lines = data.splitlines(keepends=True)
            # the last line goes on unless the file ended (a final \r may begin a \r\n)
            if block and not lines[-1].endswith(b"\n"):
                self.tail = lines.pop()
            else:
                self.tail = b""
            if lines:
                lines.reverse()
                self.lines = lines
                return True
            if not block:
                return False


def span_rows(span: TableSpan) -> Iterator[tuple[int, dict]]:
    """``(line number, row)`` of the span's rows (of a Parquet table ``(row number from 1,
    row)``); a row that cannot be read is an ``InputError`` naming the table and line."""
    kind = _kind(span.path)
    if kind == "parquet":
        yield from _parquet_rows(span)
        return
    lines = _Lines(span.path, span.start, span.end, span.line)
    try:
        if kind == "jsonl":
            yield from _jsonl_rows(lines)
        else:
            yield from _csv_rows(lines, "\t" if kind == "tsv" else ",", span.header)
    finally:
        lines.close()


def _jsonl_rows(lines: _Lines) -> Iterator[tuple[int, dict]]:
    for line in lines:
        if not line.strip():
            continue
        n = lines.line + lines.n
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            why = exc if isinstance(exc, ValueError) else "nested too deeply"
            raise InputError(f"{lines.path}:{n}: not a JSON object ({why})") from None
        if not isinstance(row, dict):
            raise InputError(f"{lines.path}:{n}: a JSON {type(row).__name__}, not an object")
        yield n, row


def _csv_rows(lines: _Lines, sep: str, header) -> Iterator[tuple[int, dict]]:
    """The rows of a CSV/TSV as dicts under its header (None: the span's first row is it); a
    row with more or fewer cells than the header is refused (its cells would land under the
    wrong columns)."""
    old = csv.field_size_limit(MAX_TABLE_CELL)
    reader = csv.reader(lines, delimiter=sep)
    try:
        if header is None:
            header = next(reader, None)
        for cells in reader:
            if not cells:  # a blank line
                continue
            n = lines.line + lines.n
            if len(cells) != len(header):
                k = len(cells)
                raise InputError(
                    f"{lines.path}:{n}: {k} cell{'s' if k != 1 else ''} under a header "
                    f"of {len(header)} ({', '.join(map(repr, header))}); give every row one cell "
                    f"per column, in double quotes where it holds the separator {sep!r}"
                )
            yield n, dict(zip(header, cells, strict=True))
    except csv.Error as exc:
        raise InputError(
            f"{lines.path}:{lines.line + lines.n}: not a readable table row ({exc}; a cell may "
            f"hold at most {MAX_TABLE_CELL >> 20} MiB); fix the row"
        ) from None
    finally:
        csv.field_size_limit(old)


def _parquet_file(path: str):
    require("parquet", f"reading the Parquet table {path!r}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path), pa.ArrowException
    except (OSError, pa.ArrowException) as exc:
        raise InputError(
            f"{path}: not a readable Parquet table ({exc}); fix or rewrite it"
        ) from None


def _parquet_rows(span: TableSpan) -> Iterator[tuple[int, dict]]:
    """The rows of the span's row groups as dicts, ``PARQUET_BATCH`` rows converted at a time
    (one row group's columns in memory, not the file)."""
    table, arrow_error = _parquet_file(span.path)
    end = table.metadata.num_row_groups if span.end is None else span.end
    groups = list(range(span.start, end))
    if not groups:
        return
    n = span.line
    try:
        for batch in table.iter_batches(batch_size=PARQUET_BATCH, row_groups=groups):
            for row in batch.to_pylist():
                n += 1
                yield n, row
    except (OSError, arrow_error) as exc:
        raise InputError(
            f"{span.path}: not a readable Parquet table ({exc}); fix or rewrite it"
        ) from None


def whole_table(path: str) -> TableSpan:
    """The whole table as one span (a CSV/TSV's header read as its first row)."""
    return TableSpan(os.fspath(path), 0, None, 0)


def cut_table(path: str, rows: int) -> tuple[list[TableSpan], dict | None, bool]:
    """``(spans of about ``rows`` rows each, in order; the table's first row (None: it has
    none or it is unreadable); whether a row that cannot be read stopped the cut)``. Every row
    is read once here and none is kept. A row that cannot be read stops the cut: the last span
    then runs to the end of the file, so the scan of that span meets the same error (or an
    earlier one of its rows) and raises it in its place."""
    kind = _kind(path)
    if kind == "parquet":
        return _cut_parquet(path, rows)
    if kind == "jsonl":
        return _cut_jsonl(path, rows)
    head, start, line = None, 0, 0
    if kind != "jsonl":  # the header row, handed to every span
        lines = _Lines(path, 0, None, 0)
        old = csv.field_size_limit(MAX_TABLE_CELL)
        try:
            header = next(csv.reader(lines, delimiter=_sep(kind)), None)
        except (InputError, csv.Error):  # the whole table's scan meets it
            return [whole_table(path)], None, True
        finally:
            csv.field_size_limit(old)
            lines.close()
        if header is None:  # an empty file
            return [whole_table(path)], None, False
        head, start, line = tuple(header), lines.pos, lines.n
    spans: list[TableSpan] = []
    first: dict | None = None
    lines = _Lines(path, start, None, line)
    count, stopped = 0, False
    try:
        for _, row in _jsonl_rows(lines) if kind == "jsonl" else _csv_rows(lines, _sep(kind), head):
            if first is None:
                first = row
            count += 1
            if count == rows:
                spans.append(TableSpan(path, start, lines.pos, line, head))
                start, line, count = lines.pos, lines.line + lines.n, 0
    except InputError:
        stopped = True
    finally:
        lines.close()
    if stopped or count or not spans:
        spans.append(TableSpan(path, start, None if stopped else lines.pos, line, head))
    return spans, first, stopped


def _sep(kind: str) -> str:
    return "\t" if kind == "tsv" else ","


def _cut_parquet(path: str, rows: int):
    meta = _parquet_file(path)[0].metadata
    spans: list[TableSpan] = []
    start, line, count = 0, 0, 0
    for g in range(meta.num_row_groups):
        count += meta.row_group(g).num_rows
        if count >= rows:
            spans.append(TableSpan(path, start, g + 1, line))
            start, line, count = g + 1, line + count, 0
    if count or not spans:
        spans.append(TableSpan(path, start, meta.num_row_groups, line))
    try:
        first = next(span_rows(whole_table(path)), (0, None))[1]
    except InputError:  # the whole table's scan meets it
        return [whole_table(path)], None, True
    return spans, first, False


def _cut_jsonl(path: str, rows: int):
    """A JSON-lines table cut at every ``rows``-th line that is not blank, its lines neither
    decoded nor parsed here (their spans' scans do both, and meet any bad one in order)."""
    lines = _Lines(path, 0, None, 0)
    try:
        first = next(_jsonl_rows(lines), (0, None))[1]
    except InputError:  # the whole table's scan meets it
        return [whole_table(path)], None, True
    finally:
        lines.close()
    spans: list[TableSpan] = []
    lines = _Lines(path, 0, None, 0)
    start, line, count = 0, 0, 0
    try:
        while (raw := lines.raw()) is not None:
            if raw.strip():
                count += 1
                if count == rows:
                    spans.append(TableSpan(path, start, lines.pos, line))
                    start, line, count = lines.pos, lines.n, 0
    finally:
        lines.close()
    if count or not spans:
        spans.append(TableSpan(path, start, lines.pos, line))
    return spans, first, False
