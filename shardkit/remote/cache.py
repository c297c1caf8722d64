"""A shared on-disk shard cache: fetched once per machine, never read half-written, LRU-bounded.

Layout of ``cache_dir`` (one flat directory, so every name is on one filesystem and renames are
atomic)::

    <digest>-<shard name>            complete entries, the only names readers open
    .tmp-<digest>-<name>.<pid>.<hex> downloads in progress (unique per writer)
    .pin-<digest>-<name>.<pid>.<hex> an entry handed out by path (``pin``), private to its pid
    .lock-<digest>-<name>            held with flock(2) by the process fetching that entry

Writers fetch into a unique temporary name, verify size and sha256 against the manifest, fsync and
``os.replace`` it into place, so a reader either finds the whole entry or nothing. The digest
covers the URL and the manifest's sha256, so a re-packed dataset at the same URL gets new entries.

Fetch de-duplication across processes (workers, ranks) is an exclusive ``flock`` on a per-entry
lock file inside ``cache_dir``: a per-directory name, not an OS-global one, released by the kernel
when its holder exits, however it exits. The holder deletes the lock file before releasing it; a
waiter that then wins the lock sees the file it locked is no longer the one at that name and starts
over, so two processes never both think they own an entry. Where ``flock`` is unavailable (some
network filesystems), we skip it: concurrent writers of one entry then download it twice, which is
harmless (last rename wins, same bytes).

Eviction is least-recently-used by mtime, which every hit refreshes with ``os.utime`` (atime is
unreliable under ``noatime``/``relatime``). Any process that adds an entry trims the directory to
``limit`` bytes, oldest first, never the entry it just added. There is no reference counting: an
entry handed out is already an open file descriptor, and on POSIX an unlinked file stays readable
through its open descriptors, so eviction by another process never breaks a reader. A reader that
needs a *path* (LMDB reads at random offsets) gets ``pin``: a hard link (or, failing that, a
copy) of the entry under a private name made while the descriptor is still open, which eviction
never touches. The space of a file evicted while open or pinned is freed when it is closed or
unpinned, so the disk can briefly hold ``limit`` plus the shards being read. A single shard larger
than ``limit`` is kept until the next insert evicts it.

Temporaries and pins carry their owner's pid and are removed (by whoever evicts next) only once
that process is gone, the one stale-temp policy of ``shardkit.fsutil``: never a live writer's
download, however slow. Pids are per machine, so ``cache_dir`` is one machine's cache; sharing it
over a network filesystem between hosts is not supported.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

try:  # POSIX only; elsewhere the cache works without cross-process de-duplication.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from ..errors import InputError
from ..fsutil import pid_alive
from ..urls import url_name

__all__ = ["ShardCache", "CacheStats"]

_TMP, _PIN, _LOCK = ".tmp-", ".pin-", ".lock-"
#: The names this cache writes (``entry_name``, and its temporaries). ``cache_dir`` may be a folder
#: the user also keeps other things in: eviction and temp cleanup touch only regular files whose
#: names match these, never anything else there (a user's file, a subdirectory, a symlink).
_ENTRY = re.compile(r"[0-9a-f]{20}-[\w.-]{1,80}")
_TEMP = re.compile(r"\.(?:tmp|pin)-[0-9a-f]{20}-[\w.-]{1,80}\.([0-9]+)\.[0-9a-f]{8}")


@dataclass
class CacheStats:
    """This process's view: hits served from disk, misses it fetched, entries it evicted."""

    hits: int = 0
    misses: int = 0
    evicted: int = 0


class ShardCache:
    """Entries under ``root``, trimmed to ``limit`` bytes (``None``: unbounded)."""

    def __init__(self, root: str | os.PathLike, limit: int | None = None):
        if limit is not None and limit < 0:
            raise InputError(f"cache_limit={limit} must be >= 0 bytes")
        self.root = os.path.abspath(os.fspath(root))
        self.limit = limit
        self.stats = CacheStats()
        os.makedirs(self.root, exist_ok=True)

    def entry_name(self, url: str, sha256: str | None = None) -> str:
        """``<digest>-<basename>``: unique per URL and content, still readable in ``ls``."""
        digest = hashlib.sha256(f"{url}\0{sha256 or ''}".encode()).hexdigest()[:20]
        base = url_name(url) or "object"
        base = "".join(c if (c.isalnum() or c in "._-") else "_" for c in base)[-80:]
        return f"{digest}-{base}"

    def path(self, url: str, sha256: str | None = None) -> str:
        return os.path.join(self.root, self.entry_name(url, sha256))

    def _open_hit(self, final: str, size: int | None) -> BinaryIO | None:
        try:
            f = open(final, "rb", buffering=0)
        except FileNotFoundError:
            return None
        if size is not None and os.fstat(f.fileno()).st_size != size:
            # Not ours to trust (edited by hand, or a foreign writer): drop it and re-fetch.
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)
            return None
        with contextlib.suppress(OSError):
            os.utime(final)  # most recently used
        return f

    def get(
        self,
        url: str,
        fill: Callable[[BinaryIO], object],
        *,
        sha256: str | None = None,
        size: int | None = None,
    ) -> tuple[BinaryIO, str]:
        """An open file on the entry for ``url`` and its path, fetched with ``fill`` on a miss.

        ``fill(f)`` writes the whole verified object into ``f`` or raises; on a raise nothing
        is left behind. The returned descriptor stays valid even if the entry is evicted.
        """
        final = self.path(url, sha256)
        f = self._open_hit(final, size)
        if f is not None:
            self.stats.hits += 1
            return f, final
        with self._entry_lock(final):
            f = self._open_hit(final, size)  # another process filled it while we waited
            if f is not None:
                self.stats.hits += 1
                return f, final
            self.stats.misses += 1
            tmp = self._private_name(_TMP, final)
            f = None
            try:
                with open(tmp, "w+b") as out:  # read back for the sha256
                    fill(out)
                    out.flush()
                    os.fsync(out.fileno())
                # Opened before it is published: once renamed, any process (or a prefetch
                # thread of ours) adding an entry may evict it before we could open it by name.
                f = open(tmp, "rb", buffering=0)
                os.replace(tmp, final)
            except BaseException:
                if f is not None:
                    f.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        self.evict(keep=final)
        return f, final

    def _private_name(self, kind: str, final: str) -> str:
        """``<kind><entry>.<pid>.<hex>``: unique, and says which process may remove it."""
        name = f"{kind}{os.path.basename(final)}.{os.getpid()}.{secrets.token_hex(4)}"
        return os.path.join(self.root, name)

    def pin(self, f: BinaryIO, final: str) -> str:
        """A path to the entry ``f`` (from ``get``) is open on that eviction never removes.

        Handing out ``final`` itself would race: any process adding an entry may evict it
        before the caller opens the path. The pin is a hard link to the very file ``f`` reads
        (same inode, checked), or a copy from ``f`` where that cannot be had (the entry was
        evicted or replaced meanwhile, or the filesystem has no hard links). The caller deletes
        it when done; a pin whose process died is removed like a stale download.
        """
        pin = self._private_name(_PIN, final)
        try:
            os.link(final, pin)
        except OSError:
            pass
        else:
            if os.path.samestat(os.stat(pin), os.fstat(f.fileno())):
                return pin
            os.unlink(pin)  # a newer entry took the name meanwhile: copy the bytes we hold
        pin = self._private_name(_PIN, final)
        try:
            with open(pin, "xb") as out:  # a fresh file, never another link to an entry
                f.seek(0)
                shutil.copyfileobj(f, out, 1 << 20)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pin)
            raise
        return pin

    @contextlib.contextmanager
    def _entry_lock(self, final: str) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        lock = os.path.join(self.root, _LOCK + os.path.basename(final))
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # flock unsupported here: go without de-duplication
                os.close(fd)
                yield
                return
            try:
                now = os.stat(lock)
                mine = os.fstat(fd)
                if (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the previous holder removed the file we locked: start over
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)  # while still holding it, so no one can be inside with it
            os.close(fd)

    def entries(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every complete entry, oldest first; other files are not ours."""
        out = []
        with os.scandir(self.root) as it:
            for e in it:
                if not _ENTRY.fullmatch(e.name):
                    continue
                try:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, st.st_size, e.path))
        out.sort()
        return out

    def size(self) -> int:
        """Bytes held by complete entries (what ``limit`` bounds)."""
        return sum(size for _, size, _ in self.entries())

    def evict(self, keep: str | None = None) -> int:
        """Delete least-recently-used entries until the total fits ``limit``; return bytes freed."""
        self._remove_stale_temps()
        if self.limit is None:
            return 0
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        freed = 0
        for _, size, path in entries:
            if total <= self.limit:
                break
            if path == keep:
                continue
            try:
                os.unlink(path)
                self.stats.evicted += 1
                freed += size
            except FileNotFoundError:
                pass  # another process evicted it first; it is gone either way
            except OSError:
                continue  # replaced by something we cannot remove: leave it, count it
            total -= size
        return freed

    def _remove_stale_temps(self) -> None:
        """Remove downloads and pins whose process is gone (never a live one's, however old)."""
        me = os.getpid()
        with os.scandir(self.root) as it:
            for e in it:
                m = _TEMP.fullmatch(e.name)
                if m is None or int(m.group(1)) == me or pid_alive(int(m.group(1))):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if e.is_file(follow_symlinks=False):
                        os.unlink(e.path)
