"""Crash-safe file writes: the temporary-name-then-rename rule every output follows."""

from __future__ import annotations

import os
import secrets

__all__ = ["atomic_write_bytes", "fsync_dir", "temp_name"]


def temp_name(path: str) -> str:
    """A sibling name no other process picks, hidden and marked as incomplete."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Readers see either the old file or the complete new one, never a partial write."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(path))
