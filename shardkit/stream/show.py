"""What ``shardkit ls`` and ``shardkit show`` print and write, over a ``ShardView``.

Keys and text members come from shards that may be foreign or hostile: everything printed goes
through ``escape`` (control and other unprintable characters as ``\\x1b``-style escapes, so a key
cannot move the cursor or rewrite the terminal), and ``write_members`` derives file names that
cannot leave the folder it is given (no separators, no leading dots), writing each file under a
temporary name first.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator

from ..errors import OutputError
from .view import ShardView

__all__ = ["escape", "list_lines", "show_lines", "safe_name", "write_members"]

#: Members shown as text by ``show`` (the rest: their size).
_TEXT = {"cls", "label", "txt", "json", "text", "caption", "cls2", "index", "id"}
_SHOWN = 300  # characters of a text member printed, then "..."


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


def list_lines(view: ShardView, head: int | None = None) -> Iterator[str]:
    """One line per sample in packed order: index, key, label (class), members with sizes."""
    n = len(view) if head is None else min(head, len(view))
    for i in range(n):
        rec = view.record(i)
        members = ", ".join(f"{escape(ext)} {len(data)} B" for ext, data in view.members(i))
        yield f"{i}  {escape(rec.key)}  label {_label(view, rec.label)}  {members}"


def show_lines(view: ShardView, key: str) -> Iterator[str]:
    """The sample's key, position, shard, label and each member (text ones printed, escaped)."""
    i = view.index(key)
    rec = view.record(i)
    yield f"key:    {escape(rec.key)}"
    yield f"index:  {i}"
    yield f"shard:  {escape(rec.shard)}"
    yield f"label:  {_label(view, rec.label)}"
    for ext, data in view.members(i):
        if ext.lower() in _TEXT:
            text = data.decode("utf-8", "surrogateescape")
            more = "..." if len(text) > _SHOWN else ""
            yield f"{escape(ext)}: {escape(text[:_SHOWN])}{more}"
        else:
            yield f"{escape(ext)}: {len(data)} bytes"


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


def write_members(view: ShardView, key: str, folder: str) -> list[str]:
    """Write each member of the sample ``key`` into ``folder`` (made if missing); returns the
    paths. An existing file is not replaced (OutputError naming it), nor is anything left
    half-written: a folder that cannot be made or written is an ``OutputError`` naming it."""
    i = view.index(key)
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
