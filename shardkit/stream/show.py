"""What ``shardkit ls`` and ``shardkit show`` print and write, over a ``ShardView``.

Keys and text members come from shards that may be foreign or hostile: everything printed goes
through ``escape`` (control and other unprintable characters as ``\\x1b``-style escapes, so a key
cannot move the cursor or rewrite the terminal), and ``write_members`` derives file names that
cannot leave the folder it is given (no separators, no leading dots), writing each file under a
temporary name first.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator

from ..errors import InputError, OutputError
from .view import ShardView

__all__ = [
    "escape",
    "list_lines",
    "resolve_sample",
    "show_lines",
    "safe_name",
    "write_members",
]

#: Members shown as text by ``show`` (the rest: their size).
_TEXT = {"cls", "label", "txt", "json", "text", "caption", "cls2", "index", "id"}
_SHOWN = 300  # characters of a text line printed, then "..."
_SHOWN_LINES = 200  # lines of a text or JSON member printed


def escape(text: str) -> str:
    """``text`` with every unprintable character (controls, bidi overrides, lone surrogates from
    undecodable bytes) written as a Python escape: safe to print to a terminal."""
    return text if text.isprintable() else "".join(map(_escape_char, text))


def _escape_char(c: str) -> str:
    if c.isprintable():
        return c
    if 0xDC80 <= ord(c) <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")


def _label(view: ShardView, label: int) -> str:
    if view.classes and 0 <= label < len(view.classes):
        return f"{label} ({escape(view.classes[label])})"
    return str(label)


def list_lines(
    view: ShardView,
    limit: int | None = None,
    *,
    offset: int = 0,
    prefix: str | None = None,
    as_json: bool = False,
) -> Iterator[str]:
    """One line per sample in packed order (index, key, label (class), members with sizes),
    from ``offset``, at most ``limit``, only keys starting with ``prefix``; each line made as it
    is needed, from the shard's sample index where it lists the members, each member's header
    checked against it (``ShardView.summary``; else from the sample's bytes). ``as_json``: one
    JSON object per line (``index``, ``key``, ``label``, ``class``, ``members``:
    ``[[ext, bytes], ...]``)."""
    shown = 0
    for i in range(offset, len(view)):
        if limit is not None and shown >= limit:
            return
        if prefix is not None and not view.key(i).startswith(prefix):
            continue
        s = view.summary(i)
        shown += 1
        if as_json:
            label = s.label
            cls = view.classes[label] if view.classes and 0 <= label < len(view.classes) else None
            doc = {"index": i, "key": s.key, "label": label, "class": cls}
            doc["members"] = [[ext, size] for ext, size in s.members]
            yield json.dumps(doc, ensure_ascii=True)  # \u escapes: nothing drives a terminal
            continue
        sizes = ", ".join(f"{escape(ext)} {size} B" for ext, size in s.members)
        yield f"{i}  {escape(s.key)}  label {_label(view, s.label)}  {sizes}"


def resolve_sample(
    view: ShardView, key: str | None, position: int | None, literal: str | None = None
) -> int:
    """The position ``show`` means: ``--index N``, ``#N`` (as ``ls`` prints it), or a key (one
    lookup). ``literal`` (``--key``) is a key whatever it looks like: a key that is itself
    ``#N`` is reached only that way, as ``#N`` always means the position."""
    if literal is not None:
        if key is not None or position is not None:
            raise InputError("give one of KEY, --key KEY or --index N")
        return view.index(literal)
    if position is not None:
        if key is not None:
            raise InputError("give a KEY or --index N, not both")
        return _in_range(view, position)
    if key is None:
        raise InputError("give the sample's KEY, #N or --index N (`shardkit ls` lists them)")
    if re.fullmatch(r"#\d+", key):
        return _in_range(view, int(key[1:]))
    return view.index(key)


def _in_range(view: ShardView, i: int) -> int:
    if not 0 <= i < len(view):
        raise InputError(
            f"no sample at position {i} in {view.where}: it holds {len(view)} (0..{len(view) - 1})"
        )
    return i


def show_lines(view: ShardView, i: int | str) -> Iterator[str]:
    """The sample's key, position, shard, label and each member: JSON pretty-printed, text line
    by line (escaped), others by size."""
    i = view.index(i) if isinstance(i, str) else i
    rec = view.record(i)
    yield f"key:    {escape(rec.key)}"
    yield f"index:  {i}"
    yield f"shard:  {escape(rec.shard)}"
    yield f"label:  {_label(view, rec.label)}"
    for ext, data in view.members(i):
        if ext.lower() in _TEXT or ext.lower().endswith("json"):
            yield from _text_lines(ext, data)
        else:
            yield f"{escape(ext)}: {len(data)} bytes"


def _text_lines(ext: str, data: bytes) -> Iterator[str]:
    text = data.decode("utf-8", "surrogateescape")
    if ext.lower().endswith("json"):
        try:
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass  # shown as stored
    lines = text.splitlines() or [""]
    more = len(lines) > _SHOWN_LINES
    if len(lines) == 1 and len(lines[0]) <= _SHOWN:
        yield f"{escape(ext)}: {escape(lines[0])}"
        return
    yield f"{escape(ext)}:"
    for line in lines[:_SHOWN_LINES]:
        yield f"  {escape(line[:_SHOWN])}{'...' if len(line) > _SHOWN else ''}"
    if more:
        yield f"  ... ({len(lines) - _SHOWN_LINES} more lines; --to writes the whole member)"


#: The longest file name ``safe_name`` gives (bytes), leaving room under the usual 255-byte
#: limit for the temporary name it is first written under.
MAX_NAME = 200


def safe_name(key: str, ext: str) -> str:
    """A file name for member ``ext`` of sample ``key`` that is one plain name: every character
    but letters, digits, ``-``, ``_`` and ``.`` becomes ``_`` (separators too), no leading dot.
    A name longer than ``MAX_NAME`` keeps its start and gets ``~<hash of the key>`` before the
    extension, so two long keys still get two names and one sample's members share a stem."""
    stem = re.sub(r"[^\w.-]", "_", key, flags=re.ASCII).lstrip(".") or "sample"
    tail = re.sub(r"[^\w.-]", "_", ext, flags=re.ASCII).strip(".") or "bin"
    name = f"{stem}.{tail}"
    if len(name) <= MAX_NAME:
        return name
    cut = len(tail) > MAX_NAME // 2  # a huge extension is cut too: the hash then covers it
    text = f"{key}\0{ext}" if cut else key
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    tail = tail[: MAX_NAME // 2]
    return f"{stem[: MAX_NAME - len(tail) - 18]}~{digest[:16]}.{tail}"


def write_members(view: ShardView, key: str | int, folder: str) -> list[str]:
    """Write each member of the sample ``key`` (or at position ``key``) into ``folder`` (made
    if missing); returns the paths. An existing file is not replaced (OutputError naming it),
    nor is anything left half-written: a folder that cannot be made or written is an
    ``OutputError`` naming it."""
    i = view.index(key) if isinstance(key, str) else key
    key = view.key(i)
    members = view.members(i)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"cannot make the folder {folder!r} ({exc.strerror or exc}); pass --to a folder "
            "you can write"
        ) from None
    root = os.path.realpath(folder)
    written = []
    for ext, data in members:
        path = os.path.join(root, safe_name(key, ext))
        if os.path.dirname(os.path.realpath(path)) != root:  # cannot happen: one plain name
            raise OutputError(f"{escape(key)}: refusing to write outside {folder}")
        if os.path.lexists(path):
            raise OutputError(
                f"{path} exists; remove it or pass another --to folder (nothing was replaced)"
            )
        try:
            _write_new(root, path, data)
        except OSError as exc:
            raise OutputError(
                f"cannot write {path!r} ({exc.strerror or exc}); pass --to a folder you can write"
            ) from None
        written.append(os.path.join(folder, os.path.basename(path)))  # as the user named it
    return written


def _write_new(root: str, path: str, data: bytes) -> None:
    """``data`` at ``path`` through a temporary name (never a half-written file there)."""
    tmp = os.path.join(root, f".{os.path.basename(path)}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
