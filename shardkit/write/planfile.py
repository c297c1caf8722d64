"""Plan files: a pack's tasks on disk for batch schedulers (``--plan-only``, ``pack-task``).

A plan file holds every sample of the pack, so at 10^8 rows its form is what its cost is: each task
is a section of little-endian arrays (per string column a byte blob and its offsets, the labels),
zlib-compressed as one stream, written one task at a time as the plan hands them out, so writing
holds one task's arrays beside the plan, never every row as Python objects (the JSON form of the
first version built each task's rows as lists: ~1 KB a row). A JSON footer names each task's
shards, arrays, sizes and the sha256 of its stored section; its own sha256 and length close the
file::

    b"SKPLAN2\\n"  section 0 | section 1 | ...  footer (JSON)  sha256(footer) (32 bytes)
    len(footer) (8 bytes, little-endian)  b"SKPLAN2\\n"

``pack-task`` reads the footer and its own task's section, checking both hashes: a task costs
its own samples, not the whole file. Nothing is pickled; arrays are read with ``frombuffer`` from
an allow-list of dtypes and checked (offsets in order, one length for every column) before use.
A plan file of the first version (JSON, ``"version": 1``) is still read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import struct
import zlib
from collections.abc import Sequence
from contextlib import suppress

import numpy as np

from ..errors import InputError
from ..fsutil import fsync_dir, open_regular, temp_name, write_error
from ..scan import StrTable
from .plan import JOB_PREFIX, ShardTask

__all__ = ["PLAN_FORMAT", "load_task", "save_tasks"]

PLAN_FORMAT = "shardkit-pack-plan"
#: The first and last 8 bytes of a plan file (version 2, the array form).
MAGIC = b"SKPLAN2\n"
_TAIL = struct.Struct("<32sQ8s")  # sha256 of the footer, its length, MAGIC again
#: The string columns of a task, in section order (then ``labels``).
_COLUMNS = ("files", "keys", "exts", "sidecars", "inline")
#: The dtypes a section may hold (anything else is refused, not interpreted).
_DTYPES = {"|u1": np.uint8, "<u4": np.uint32, "<i4": np.int32, "<i8": np.int64}
#: zlib's level for a task's section: paths and keys shrink ~4x at ~100 MB/s.
ZLIB_LEVEL = 1
#: The largest footer read (a plan of ~10^6 tasks); a longer one is no plan shardkit wrote.
_MAX_FOOTER = 1 << 30


def _arrays(task: ShardTask) -> list[tuple[str, np.ndarray]]:
    """A task's samples in plan order as ``(name, array)``: per string column its blob and
    offsets (uint32 where they fit), then the labels (int32 where they fit)."""
    order = np.asarray(task.order, dtype=np.int64)
    out: list[tuple[str, np.ndarray]] = []
    for name in _COLUMNS:
        table = getattr(task, name)
        if not len(table):
            continue
        if not isinstance(table, StrTable):
            table = StrTable(table)
        if len(order) != len(table) or not np.array_equal(order, np.arange(len(order))):
            table = table.take(order)
        offsets = table.offsets
        small = offsets[-1] < 1 << 32
        out.append((f"{name}.blob", np.ascontiguousarray(table.blob, dtype=np.uint8)))
        out.append((f"{name}.offsets", offsets.astype("<u4" if small else "<i8")))
    labels = np.asarray(task.labels, dtype=np.int64)[order]
    fits = not len(labels) or (labels.min() >= -(1 << 31) and labels.max() < 1 << 31)
    out.append(("labels", labels.astype("<i4" if fits else "<i8")))
    return out


def save_tasks(tasks: Sequence[ShardTask], path: str, command: str) -> None:
    """Write ``tasks`` as a plan file (atomically), one task's arrays at a time; ``command``
    commits once they are done."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            pos, listing, common = len(MAGIC), bytearray(), None
            for task in tasks:
                shared = [task.job, task.root, task.format, task.validate]
                shared += [task.resize_short, task.on_error]
                common = common or shared
                if shared != common:  # one plan's tasks share these; never otherwise
                    raise ValueError("tasks of different plans")
                digest, arrays, start = hashlib.sha256(), [], pos
                pack, raw_size = zlib.compressobj(ZLIB_LEVEL), 0
                for name, a in _arrays(task):
                    raw = memoryview(np.ascontiguousarray(a)).cast("B")
                    raw_size += len(raw)
                    arrays.append([name, a.dtype.str, len(a)])
                    for part in (pack.compress(raw), pack.flush() if name == "labels" else b""):
                        digest.update(part)
                        f.write(part)
                        pos += len(part)
                entry = {
                    "first": task.first,
                    "starts": list(task.starts),
                    "offset": start,
                    "size": pos - start,
                    "raw_size": raw_size,
                    "sha256": digest.hexdigest(),
                    "arrays": arrays,
                }
                listing += json.dumps(entry).encode() + b","  # one bytes per task, not dicts
            keys = ("job", "root", "shard_format", "validate", "resize_short", "on_error")
            doc = {
                "format": PLAN_FORMAT,
                "version": 2,
                "commit": command,
                **dict(zip(keys, common or [None] * len(keys), strict=True)),
            }
            footer = json.dumps(doc).encode()[:-1] + b', "tasks": [' + listing[:-1] + b"]}"
            f.write(footer)
            f.write(_TAIL.pack(hashlib.sha256(footer).digest(), len(footer), MAGIC))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with suppress(OSError):
            os.unlink(tmp)
        raise write_error(os.path.dirname(path) or ".", exc, os.path.basename(path)) from None
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def load_task(path: str, index: int) -> tuple[ShardTask, int]:
    """Task ``index`` of the plan file at ``path``, and how many tasks it holds."""
    try:
        with open_regular(path) as f:
            head = f.read(len(MAGIC))
            if head == MAGIC:
                task, total = _read_task(f, path, index)
            elif head[:1] == b"{":  # the first version: JSON
                f.seek(0)
                task, total = _read_json_task(json.load(f), path, index)
            else:
                raise ValueError("not a shardkit plan file")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise InputError(
            f"{path}: not a readable shardkit plan ({exc}); make one with `shardkit pack SRC OUT "
            "--plan-only PLAN`"
        ) from None
    why = _outside(task)
    if why is not None:
        raise InputError(
            f"{path}: task {index} {why}, which a plan shardkit wrote never does (the file was "
            "edited); nothing was read or written: make the plan again with `shardkit pack SRC "
            "OUT --plan-only PLAN`"
        )
    return task, total


def _no_task(path: str, index: int, total: int) -> InputError:
    return InputError(f"{path}: no task {index}; it holds tasks 0..{total - 1}")


def _read_task(f, path: str, index: int) -> tuple[ShardTask, int]:
    """Task ``index`` of a version-2 file open at ``f``: its footer and its section, each
    checked against its sha256 before a byte of it is used."""
    doc, end = _footer(f)
    tasks = doc["tasks"]
    if not 0 <= index < len(tasks):
        raise _no_task(path, index, len(tasks))
    entry = tasks[index]
    arrays = _section(f, entry, index, end)
    labels = arrays["labels"].astype(np.int64)
    n = len(labels)
    tables: dict[str, StrTable | tuple] = {}
    for name in _COLUMNS:
        if f"{name}.offsets" in arrays:
            tables[name] = _table(arrays[f"{name}.blob"], arrays[f"{name}.offsets"], n, name)
        elif name in ("files", "keys", "exts"):
            raise ValueError(f"task {index} has no {name}")
        else:
            tables[name] = ()
    task = ShardTask(
        job=str(doc["job"]),
        root=str(doc["root"]),
        format=str(doc["shard_format"]),
        validate=str(doc["validate"]),
        resize_short=None if doc["resize_short"] is None else int(doc["resize_short"]),
        on_error=str(doc["on_error"]),
        first=int(entry["first"]),
        starts=tuple(int(x) for x in entry["starts"]),
        order=np.arange(n),
        labels=labels,
        **tables,
    )
    return task, len(tasks)


def _footer(f) -> tuple[dict, int]:
    """The footer of a version-2 file, checked against its sha256, and where it begins."""
    size = os.fstat(f.fileno()).st_size
    if size < len(MAGIC) + _TAIL.size:
        raise ValueError("cut short")
    f.seek(size - _TAIL.size)
    digest, length, magic = _TAIL.unpack(f.read(_TAIL.size))
    if magic != MAGIC or length > min(_MAX_FOOTER, size - len(MAGIC) - _TAIL.size):
        raise ValueError("cut short or not a plan file: its last bytes are no plan's end")
    end = size - _TAIL.size - length
    f.seek(end)
    footer = f.read(length)
    if hashlib.sha256(footer).digest() != digest:
        raise ValueError("its footer does not match its sha256: the file was changed")
    doc = json.loads(footer)
    if doc.get("format") != PLAN_FORMAT or doc.get("version") != 2:
        raise ValueError("not a shardkit plan file")
    return doc, end


def _section(f, entry: dict, index: int, end: int) -> dict[str, np.ndarray]:
    """A task's arrays by name, read from its section once its sha256 matches."""
    offset, length = int(entry["offset"]), int(entry["size"])
    if not len(MAGIC) <= offset <= offset + length <= end:
        raise ValueError(f"task {index} lies outside the file's sections")
    f.seek(offset)
    stored = f.read(length)
    if len(stored) != length or hashlib.sha256(stored).hexdigest() != entry["sha256"]:
        raise ValueError(f"task {index}'s samples do not match their sha256: the file was changed")
    raw_size = int(entry["raw_size"])
    unpack = zlib.decompressobj()
    section = unpack.decompress(stored, raw_size + 1)  # never more than the footer says
    if len(section) != raw_size or not unpack.eof:
        raise ValueError(f"task {index}'s section is not the size its footer says")
    length = raw_size
    arrays, pos = {}, 0
    for name, dtype, count in entry["arrays"]:
        n = int(count) * np.dtype(_DTYPES[dtype]).itemsize  # another dtype: KeyError, refused
        if int(count) < 0 or pos + n > length:
            raise ValueError(f"task {index}'s arrays overrun its section")
        arrays[str(name)] = np.frombuffer(section, dtype=dtype, count=int(count), offset=pos)
        pos += n
    if pos != length:
        raise ValueError(f"task {index}'s arrays do not fill its section")
    return arrays


def _table(blob: np.ndarray, offsets: np.ndarray, n: int, name: str) -> StrTable:
    """A string column from its arrays, refused unless the offsets cut the blob in order."""
    offsets = offsets.astype(np.int64)
    if (
        len(offsets) != n + 1
        or offsets[0] != 0
        or offsets[-1] != len(blob)
        or (np.diff(offsets) < 0).any()
    ):
        raise ValueError(f"its {name} column is out of order")
    out = StrTable()
    out.blob, out.offsets = blob, offsets
    return out


def _read_json_task(doc: dict, path: str, index: int) -> tuple[ShardTask, int]:
    """Task ``index`` of a first-version (JSON) plan file."""
    if doc.get("format") != PLAN_FORMAT or doc.get("version") != 1:
        raise ValueError("not a shardkit plan file")
    tasks = doc["tasks"]
    if not 0 <= index < len(tasks):
        raise _no_task(path, index, len(tasks))
    return ShardTask.from_dict(tasks[index]), len(tasks)


def _outside(task: ShardTask) -> str | None:
    """What in ``task`` would read outside its source root or write outside its job folder."""
    name = os.path.basename(task.job)
    if (
        not os.path.isabs(task.job)
        or os.path.normpath(task.job) != task.job
        or not os.path.isdir(os.path.dirname(task.job))  # OUT, made by --plan-only
        or not os.path.isabs(task.root)
        or not re.fullmatch(re.escape(JOB_PREFIX) + "[0-9a-f]{16}", name)
        or "\x00" in task.job + task.root
    ):
        return f"writes into {task.job!r}, not a job folder OUT/{JOB_PREFIX}<hex>"
    if (
        task.first < 0
        or not task.starts
        or task.starts[0] != 0
        or list(task.starts) != sorted(task.starts)
        or task.starts[-1] > len(task.files)
    ):
        return "numbers its shards or samples out of order"
    for rel, side in itertools.zip_longest(task.files, task.sidecars, fillvalue=""):
        if _climbs(rel) or "\x00" in side:  # field files: suffixes of rel, in its folder
            return f"reads {rel!r}, outside its source root {task.root!r}"
    return None


def _climbs(rel: str) -> bool:
    return not rel or rel.startswith("/") or "\x00" in rel or ".." in rel.split("/")
