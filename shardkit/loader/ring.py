"""The ring: every batch buffer of a ShardLoader, allocated once and reused across epochs.

Each worker owns ``slots`` slots; slot memory is an anonymous shared file (``memfd_create``)
that the worker process and the training process both map, so a decoded batch is handed over
by naming its slot: nothing is pickled or copied on the host. No named segment exists: nothing
can be left in /dev/shm, whatever kills whom. With ``num_workers=0`` the caller's fill loop
writes the same kind of memory itself.

Only the consumer (``epoch.py``) decides when a slot may be written again. Every batch handed
out is a new tensor over the slot (``lend``), whose storage holds a reference to a token of that
loan and drops it when the storage dies or moves its data elsewhere (``share_memory_``, a
``torch.multiprocessing`` queue). So "is the slot still the caller's" (``kept``) is a plain
reference count of the token, whatever the caller did through torch's API: kept the tensor, a
view, a numpy array over it, only its ``untyped_storage()``, or moved it to shared memory. A
kept slot's memory stays the caller's and the slot is given fresh memory (``replace``). With CUDA
the slots are page-locked in place (``cudaHostRegister``), the device copy reads the slot
itself, and the slot goes back once the copy's event has completed.

Forked worker processes inherit every mapping and descriptor of the process that forks them; a
worker drops what is not its own first (``forget_inherited``), so closing one loader returns its
memory while other loaders' workers live. Every other process forked from this one (a
DataLoader's workers, a user's ``os.fork``) closes the ring descriptors at once (an at-fork
hook): the mappings it inherited stay, as objects it inherited may be over them, and go when it
exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
import tempfile
import weakref

import numpy as np
import torch

__all__ = ["MappedSlots", "Ring", "forget_inherited", "keeping_at_fork"]


def _anonymous_file() -> int:
    """A descriptor of shared memory with no name anywhere (inherited by fork, passed to
    spawned workers as a descriptor)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("shardkit-ring", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        fd, path = tempfile.mkstemp(prefix="shardkit-ring-")
        os.unlink(path)
    _FDS.add(fd)
    return fd


def _close_fd(fd: int) -> None:
    """Close a ring descriptor this process still holds (a forked child closed the inherited ones
    at fork: their numbers may name other files since)."""
    if fd in _FDS:
        _FDS.discard(fd)
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

#: This process's ring descriptors and mappings (address -> their unmapping), so that a forked
#: worker can drop those it inherited (``forget_inherited``).
_FDS: set[int] = set()
_MAPS: dict[int, weakref.finalize] = {}
#: The descriptors the worker being forked keeps (its own slots), set while it starts.
_KEEP_AT_FORK: frozenset[int] = frozenset()


def _close_at_fork() -> None:
    """In every forked child: close the ring descriptors it was not started to keep."""
    for fd in list(_FDS - _KEEP_AT_FORK):
        _FDS.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_at_fork)


@contextlib.contextmanager
def keeping_at_fork(fds):
    """While a worker is forked: the child keeps ``fds`` (its slots), closes the others."""
    global _KEEP_AT_FORK
    _KEEP_AT_FORK = frozenset(fds)
    try:
        yield
    finally:
        _KEEP_AT_FORK = frozenset()


def _map(fd: int, nbytes: int):
    """``nbytes`` of the file ``fd`` mapped shared, as a buffer unmapped when the last array
    or tensor over it is gone. Not ``mmap.mmap``: it keeps a duplicate descriptor open for as
    long as the mapping lives, one per batch a caller keeps (a ``list(loader)`` of an
    ImageNet epoch would exhaust the descriptor limit)."""
    if os.fstat(fd).st_size < nbytes:
        os.ftruncate(fd, nbytes)
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a {nbytes}-byte ring slot failed: {os.strerror(err)}")
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    _MAPS[addr] = weakref.finalize(buf, _unmap, addr, nbytes)
    return buf


def _unmap(addr: int, nbytes: int) -> None:
    _MAPS.pop(addr, None)
    _libc.munmap(addr, nbytes)


def forget_inherited(keep: set[int]) -> None:
    """In a worker (forked, spawned or from a fork server), before it maps anything: unmap every
    ring mapping and close every ring descriptor it inherited except ``keep`` (its own slots),
    which it tracks from now on (a spawned worker's arrive as bare numbers: untracked, a
    replaced slot's old file was never closed, and kept its memory alive). Without this, a
    loader's ring stays alive in the workers of every loader started after it. Any other ring
    file open here (``_ring_files``: one this process's bookkeeping missed) is closed too. The
    inherited Python objects over those mappings are never touched in the worker; their
    unmapping is cancelled, as the address range may be reused."""
    for fin in list(_MAPS.values()):
        info = fin.detach()
        if info is not None:
            _unmap(*info[2])
    _MAPS.clear()
    for fd in (_FDS | set(_ring_files())) - keep:
        _FDS.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass
    _FDS.update(keep)


def _ring_files() -> dict[int, int]:
    """Every ring file this process holds a descriptor of, found by name (``memfd_create``'s):
    descriptor -> inode. Empty where ``/proc`` cannot say (not Linux). Only a worker starting
    closes what it finds: elsewhere a descriptor not in ``_FDS`` may be another owner's to
    close (closing it here would make that owner's close hit whatever reused the number)."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # pragma: no cover - not Linux
        return found
    for name in names:
        fd = int(name)
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shardkit-ring"):
                found[fd] = os.fstat(fd).st_ino
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return found


class _Slot:
    """One slot as the training process sees it: its mapped memory and the current loan."""

    def __init__(self, memory, shape: tuple[int, ...], pinned: int | None):
        self.memory = memory  # the ctypes buffer over the mapping (the loader's reference)
        self.shape = shape
        self.pinned = pinned  # the registered address, to unregister
        self.array = np.frombuffer(memory, np.uint8).reshape(shape)  # the caller's fill loop
        self.loan: memoryview | None = None

    def lend(self) -> torch.Tensor:
        """A new tensor over the slot. Its storage holds a reference to a memoryview made for
        this loan alone (``torch.frombuffer`` keeps its source object alive until the storage's
        data is freed or moved), so the memoryview's reference count says whether anything
        outside the loader still reaches the slot's bytes."""
        self.loan = memoryview(self.memory)
        return torch.frombuffer(self.loan, dtype=torch.uint8).view(self.shape)

    def kept(self) -> bool:
        # references: self.loan, getrefcount's argument, and one per live storage over it
        return self.loan is not None and sys.getrefcount(self.loan) > 2


class Ring:
    """``workers`` x ``slots`` batch buffers; sized by the first batch each slot receives."""

    def __init__(self, workers: int, slots: int, *, shared: bool, pin: bool):
        self.workers, self.slots, self.shared, self.pin = workers, slots, shared, pin
        self._fds: list[list[int]] = []
        try:
            for _ in range(workers):
                self._fds.append([])
                for _ in range(slots):
                    self._fds[-1].append(_anonymous_file())
        except BaseException:
            self.close()
            raise
        self._slots: dict[tuple[int, int], _Slot] = {}

    def fds(self, worker: int) -> list[int]:
        """The descriptors of ``worker``'s slots (what its process maps)."""
        return list(self._fds[worker])

    def lend(self, worker: int, slot: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot as a new uint8 tensor of ``shape`` (a whole batch), for the caller."""
        return self._slot(worker, slot, shape).lend()

    def array(self, worker: int, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        """The slot as the fill loop of a ``num_workers=0`` loader writes it."""
        return self._slot(worker, slot, shape).array

    def kept(self, worker: int, slot: int) -> bool:
        """Whether anything outside the loader still refers to the slot's memory."""
        s = self._slots.get((worker, slot))
        return s is not None and s.kept()

    def returned(self, worker: int, slot: int) -> None:
        """The slot's loan is over (not kept): the next batch lends it anew."""
        s = self._slots.get((worker, slot))
        if s is not None:
            s.loan = None

    def replace(self, worker: int, slot: int) -> int | None:
        """Leave the slot's memory to whoever keeps it; the slot gets fresh memory. Returns the
        new descriptor the worker must map (None without worker processes)."""
        s = self._slots.pop((worker, slot), None)
        if s is not None:
            self._release(s)
        _close_fd(self._fds[worker][slot])
        fd = self._fds[worker][slot] = _anonymous_file()
        return fd if self.shared else None

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s.shape) for s in self._slots.values())

    def close(self) -> None:
        for s in self._slots.values():
            self._release(s)
        self._slots.clear()
        for fds in self._fds:
            for fd in fds:
                _close_fd(fd)
        self._fds = []

    def __repr__(self) -> str:
        mb = self.nbytes / 2**20
        kind = "shared" if self.shared else "private"
        return f"Ring({self.workers} workers x {self.slots} slots, {mb:.1f} MiB {kind}" + (
            ", pinned)" if self.pin else ")"
        )

    def _slot(self, worker: int, slot: int, shape: tuple[int, ...]) -> _Slot:
        """Slot ``slot`` of ``worker`` holding ``shape``, mapped on first use (again when the
        batch shape changes, as when another dataset size comes through)."""
        s = self._slots.get((worker, slot))
        if s is None or s.shape != tuple(shape):
            if s is not None:
                self._release(s)
            s = self._slots[(worker, slot)] = self._new(worker, slot, tuple(shape))
        return s

    def _new(self, worker: int, slot: int, shape: tuple[int, ...]) -> _Slot:
        nbytes = math.prod(shape)
        memory = _map(self._fds[worker][slot], nbytes)
        pinned = None
        if self.pin:
            pinned = ctypes.addressof(memory)
            err = torch.cuda.cudart().cudaHostRegister(pinned, nbytes, 1)  # portable
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte ring slot failed: {err}")
        return _Slot(memory, shape, pinned)

    def _release(self, s: _Slot) -> None:
        """The loader lets go of ``s``: the mapping lives on while a kept batch reaches it."""
        if s.pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(s.pinned)
            s.pinned = None


class MappedSlots:
    """One worker's slots as its own process maps them (``num_workers=0``: the ring's memory)."""

    def __init__(self, fds: list[int] | None = None, ring: Ring | None = None):
        self._fds = fds
        self._ring = ring
        self._arrays: dict[int, np.ndarray] = {}

    def array(self, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        """The slot as a C-contiguous uint8 array of ``shape``."""
        arr = self._arrays.get(slot)
        if arr is None or arr.shape != tuple(shape):
            if self._ring is not None:
                arr = self._ring.array(0, slot, shape)
            else:
                nbytes = math.prod(shape)
                arr = np.frombuffer(_map(self._fds[slot], nbytes), np.uint8, nbytes)
                arr = arr.reshape(shape)
            self._arrays[slot] = arr
        return arr

    def replace(self, slot: int, fd: int | None) -> None:
        """The slot's memory was kept by the caller: forget it (and map ``fd`` from now on)."""
        self._arrays.pop(slot, None)
        if fd is not None:
            _close_fd(self._fds[slot])
            self._fds[slot] = fd
            _FDS.add(fd)
