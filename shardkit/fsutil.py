"""Crash-safe file output: temporary names, one lock per output, and one all-or-nothing publish.

Every writer in shardkit follows the same rules, kept here so there is one policy:

- files are written under a temporary (hidden) name and renamed when complete;
- a staging name carries its owner's host and pid (``.partial-<host>-<pid>-<random>``), and
  staging is removed only when its owner is provably gone: the remover holds the output's lock
  (so no other shardkit writer is live there), the host is this one *and* the pid is dead (a pid
  says nothing about another machine's processes, so their staging is left alone). A concurrent
  writer's files are never touched. A job folder (``.partial-job-<plan>``: a planned pack's
  finished shards and receipts, kept for a re-run to resume) is never stale by pid;
- a directory of many files is published by ``publish``: a journal written atomically is the
  commit point, so a kill before it leaves the old contents intact and a kill after it is
  finished (rolled forward) by the next writer, and readers refuse the directory meanwhile.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import stat
import weakref

from .errors import OutputError

__all__ = [
    "HOST",
    "JOB_MARK",
    "JOURNAL_NAME",
    "STAGING_PREFIX",
    "stale_staging",
    "DirLock",
    "HashingReader",
    "atomic_write_bytes",
    "fsync_dir",
    "interrupted_commit",
    "interrupted_message",
    "open_regular",
    "pid_alive",
    "publish",
    "recover",
    "remove_stale_staging",
    "staging_name",
    "temp_name",
    "write_error",
]

#: Prefix of a writer's staging directory inside its output: ``.partial-<host>-<pid>-<hex>``.
STAGING_PREFIX = ".partial-"
#: After ``STAGING_PREFIX``: a planned pack's job folder, removed by its commit, never by pid.
JOB_MARK = "job-"
#: This machine's name as staging names carry it: no ``-`` (the field separator), nothing odd.
HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
#: The commit journal: present in a directory only between a commit point and its completion.
JOURNAL_NAME = ".shardkit-commit.json"


def open_regular(path: str, buffering: int = -1):
    """Open a user-given path for reading in binary, refusing anything but a regular file.

    ``open()`` of a FIFO blocks until a writer appears (forever, for a FIFO named like
    ``manifest.json`` or a shard), and a device can stream without end: the path is opened with
    ``O_NONBLOCK`` (which never blocks), checked with ``fstat`` on that same descriptor (no race
    with a swap), and only then made blocking again. A refusal is an ``OSError`` whose
    ``strerror`` says what the path is, so callers' ``except OSError`` turn it into their own
    one-line error. ``buffering=0`` gives a raw ``FileIO`` (``readinto`` without a copy).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
            raise OSError(code, f"not a regular file ({_kind(mode)}); expected a file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def temp_name(path: str) -> str:
    """A sibling name no other process picks, hidden and marked as incomplete."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{HOST}-{os.getpid()}-{secrets.token_hex(4)}")


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
        _unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def write_error(out: str, exc: BaseException, what: str) -> OutputError:
    """The one-line error for a failed write into ``out`` (disk full, quota, I/O error).

    Says what was being written, the system's reason and how much room is left on the disk
    holding ``out``, and the fix; the callers have already removed what they had half-written.
    """
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    try:
        free = shutil.disk_usage(out).free
        room = f" ({_human(free)} free on its disk)"
    except OSError:
        free, room = None, ""
    full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or (
        free is not None and free < 1 << 20
    )
    fix = (
        "free space on that disk (or choose another output) and pack again"
        if full
        else "check the disk holding it (or choose another output) and pack again"
    )
    return OutputError(f"cannot write {what} in {out!r}: {reason}{room}; {fix}")


def _human(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --- ownership ---------------------------------------------------------------------------------


def staging_name(prefix: str = STAGING_PREFIX) -> str:
    """``<prefix><host>-<pid>-<random>``: unique, and says which process on which machine owns
    it (a pid alone is ambiguous once writers run on several machines into one output)."""
    return f"{prefix}{HOST}-{os.getpid()}-{secrets.token_hex(6)}"


def _owner(name: str, prefix: str) -> tuple[str, int] | None:
    """``(host, pid)`` of a staging name; ``<pid>-<hex>`` (older shardkit) is this host's."""
    parts = name[len(prefix) :].split("-")
    if len(parts) == 2 and parts[0].isdigit() and parts[1]:
        return HOST, int(parts[0])
    if len(parts) == 3 and parts[1].isdigit() and parts[0] and parts[2]:
        return parts[0], int(parts[1])
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (signal 0 checks without sending)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def stale_staging(directory: str, prefix: str = STAGING_PREFIX) -> list[str]:
    """Names of the staging entries in ``directory`` whose owner is gone (what a kill -9 left),
    without removing them: for commands that only read to mention them. As for
    ``remove_stale_staging``: another host's staging and a resumable job folder are not stale."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    stale = []
    for n in names:
        if not n.startswith(prefix) or n[len(prefix) :].startswith(JOB_MARK):
            continue
        owner = _owner(n, prefix)
        if owner is None or (owner[0] == HOST and not pid_alive(owner[1])):
            stale.append(n)
    return stale


def remove_stale_staging(
    directory: str, prefix: str = STAGING_PREFIX, *, keep_unowned: bool = False
) -> list[str]:
    """Remove the staging entries in ``directory`` whose owner is dead; return their names.

    An entry named by ``staging_name`` is removed only when it names this host and its pid is not
    alive here (another host's staging is kept: its pid cannot be checked from here); a job
    folder (``JOB_MARK``) is kept for its re-run to resume. Pack's caller also holds
    ``directory``'s ``DirLock``, which proves no other shardkit writer is live in it; so a name
    without a pid, from an older shardkit that took no lock, is stale too. Callers without such a
    lock (synth, in a user's directory) pass ``keep_unowned=True``.
    """
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(prefix) or name[len(prefix) :].startswith(JOB_MARK):
            continue
        owner = _owner(name, prefix)
        if owner is None and keep_unowned:
            continue
        if owner is not None and (
            owner[0] != HOST or owner[1] == os.getpid() or pid_alive(owner[1])
        ):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)
        removed.append(name)
    return removed


def _safe_name(name: object) -> bool:
    """A plain file name inside the directory: what a journal may name, nothing else."""
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\x00" not in name
        and not name.startswith(".")
    )


# --- one lock per output -----------------------------------------------------------------------


class DirLock:
    """An exclusive ``flock`` on the directory itself: one writer per output, refused at once.

    Locking the directory's own descriptor needs no lock file (nothing to clean up, no
    OS-global name) and the kernel drops it when the process dies, even by SIGKILL. A forked
    child (a pool worker, a loader worker) closes its copy of the descriptor at once: a flock
    belongs to the open file, so a child outliving a killed writer would otherwise keep the
    output locked and refuse the rerun that finishes the job.
    """

    _held: weakref.WeakSet[DirLock] = weakref.WeakSet()

    def __init__(self, path: str, what: str = "output"):
        import fcntl

        self.path = path
        self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            self._fd = None
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputError(
                    f"{what} {path!r} is in use by another shardkit writer (pack or ShardWriter); "
                    "wait for it to finish or choose another output"
                ) from None
            raise
        DirLock._held.add(self)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        DirLock._held.discard(self)

    @classmethod
    def _forget_in_child(cls) -> None:
        """After ``fork``, in the child: close the inherited descriptors (the parent keeps its
        locks: a flock is dropped only when every descriptor of the open file is closed)."""
        for lock in list(cls._held):
            if lock._fd is not None:
                try:
                    os.close(lock._fd)
                except OSError:
                    pass
                lock._fd = None
        cls._held.clear()

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# --- publish: many files, one commit point -----------------------------------------------------


def interrupted_commit(directory: str) -> str | None:
    """The journal's path if a publish into ``directory`` was cut short after its commit point."""
    path = os.path.join(directory, JOURNAL_NAME)
    return path if os.path.lexists(path) else None


def interrupted_message(directory: str) -> str:
    """What readers say about a directory whose publish was cut short: refuse, and the fix."""
    return (
        f"{directory}: a pack, append or merge into this directory was interrupted while "
        f"committing its shards ({JOURNAL_NAME} is there, manifest.json is not), so the shards "
        "are incomplete; run the same command again (`shardkit pack ...` or `shardkit merge "
        "...`), which first finishes the commit and keeps every shard"
    )


#: A shard's companion file (its sample index, ``formats.sample_index``): moved and removed
#: with the shard by ``publish``.
COMPANION = ".idx"


def publish(
    directory: str, staging: str, names: list[str], last: str, *, remove: list[str] = ()
) -> str:
    """Move ``staging/<names>`` into ``directory``, then ``staging/<last>``, all or nothing.

    ``last`` (the manifest) must already be complete in ``staging``. The commit point is the
    atomic creation of the journal: before it ``directory`` is untouched (old dataset intact);
    after it the move is decided and ``recover`` finishes it after any crash. ``remove`` are
    old files of ``directory`` that the new contents replace (deleted before ``last`` lands).
    Returns the path of ``directory/<last>``. Where ``directory`` holds a ``last`` (a
    manifest), a file already under one of ``names`` that is not in ``remove`` is not its
    dataset's (a user's file named like a shard): refused before the commit point, never
    replaced. Without one, nothing tells ours from theirs, and the caller's overwrite decides.
    """
    listed = set(remove) if os.path.isfile(os.path.join(directory, last)) else set(names)
    for name in names:
        if name not in listed and os.path.lexists(os.path.join(directory, name)):
            raise OutputError(
                f"{os.path.join(directory, name)} is in the way: the dataset's manifest does not "
                "list it, so shardkit did not write it and will not replace it; move it out of "
                f"{directory} and run the command again"
            )
    # Companions are named after a shard, ours to move, replace and remove with it.
    companions = [n + COMPANION for n in names]
    names = [*names, *(n for n in companions if os.path.isfile(os.path.join(staging, n)))]
    remove = [*remove, *(n + COMPANION for n in remove)]
    journal = {
        "staging": os.path.basename(staging),
        "names": list(names),
        "last": last,
        "remove": [n for n in remove if n not in set(names)],
        "pid": os.getpid(),
    }
    atomic_write_bytes(os.path.join(directory, JOURNAL_NAME), json.dumps(journal).encode())
    _roll_forward(directory, journal)
    return os.path.join(directory, last)


def _roll_forward(directory: str, journal: dict) -> None:
    """Finish a committed publish; idempotent, so a kill at any step is finished by a rerun."""
    staging = os.path.join(directory, journal["staging"])
    last = journal["last"]
    if os.path.exists(os.path.join(staging, last)):
        # No manifest may describe a mix: the old one goes before the first shard is replaced.
        _unlink(os.path.join(directory, last))
        fsync_dir(directory)
        for name in journal["names"]:
            src = os.path.join(staging, name)
            if os.path.lexists(src):
                os.replace(src, os.path.join(directory, name))
        for name in journal["remove"]:
            _unlink(os.path.join(directory, name))
        fsync_dir(directory)
        os.replace(os.path.join(staging, last), os.path.join(directory, last))
        fsync_dir(directory)
    _unlink(os.path.join(directory, JOURNAL_NAME))
    fsync_dir(directory)
    shutil.rmtree(staging, ignore_errors=True)


def recover(directory: str) -> bool:
    """Finish a publish that a crash interrupted after its commit point; True if there was one.

    Call it holding ``directory``'s ``DirLock``. A journal that does not parse, or names
    anything but plain files and a ``.partial-`` staging dir, was not written by us: refused.
    """
    path = interrupted_commit(directory)
    if path is None:
        return False
    try:
        with open_regular(path) as f:
            journal = json.load(f)
        ok = (
            isinstance(journal, dict)
            and isinstance(journal.get("staging"), str)
            and journal["staging"].startswith(STAGING_PREFIX)
            and "/" not in journal["staging"]
            and _safe_name(journal.get("last"))
            and isinstance(journal.get("names"), list)
            and isinstance(journal.get("remove", []), list)
            and all(_safe_name(n) for n in journal["names"])
            and all(_safe_name(n) for n in journal.get("remove", []))
        )
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise OutputError(
            f"{path}: unreadable commit journal; remove it by hand if no shardkit writer is "
            "running, then pack again"
        )
    journal.setdefault("remove", [])
    _roll_forward(directory, journal)
    return True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=DirLock._forget_in_child)


class HashingReader(io.RawIOBase):
    """A non-seekable view of a file that hashes and counts every byte read through it.

    ``verify`` and ``index`` parse a tar shard through it: one read of the file gives both the
    records and the sha256 the manifest keeps.
    """

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, buf) -> int:
        n = self._f.readinto(buf) or 0
        self.sha.update(memoryview(buf)[:n])
        self.bytes += n
        return n

    def drain(self) -> None:
        """Hash what the parser did not read (end-of-archive padding, a gzip trailer)."""
        chunk = bytearray(1 << 20)
        while self.readinto(chunk):
            pass
