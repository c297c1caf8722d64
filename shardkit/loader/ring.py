"""The ring: every batch buffer of a ShardLoader, allocated once and reused across epochs.

Each worker owns ``slots`` slots; slot memory is an anonymous shared file (``memfd_create``)
that the worker process and the training process both map, so a decoded batch is handed over
by naming its slot: nothing is pickled or copied on the host. No named segment exists: nothing
can be left in /dev/shm, whatever kills whom. With ``num_workers=0`` the slots are plain (pinned)
memory of the caller's process.

Only the consumer (``epoch.py``) decides when a slot may be written again. On the CPU the batch
it yields is a view of its slot: the slot goes back to its worker once nothing outside the loader
refers to it (``kept``); a batch the caller keeps (a list of batches, a numpy view) keeps the
slot's memory, and the slot is given fresh memory instead (``replace``). With CUDA the slots are
page-locked in place (``cudaHostRegister``), the device copy reads the slot itself, and the slot
goes back once the copy's event has completed.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import tempfile
import weakref

import numpy as np
import torch

__all__ = ["MappedSlots", "Ring"]


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _anonymous_file() -> int:
    """A descriptor of shared memory with no name anywhere (inherited by fork, passed to
    spawned workers as a descriptor)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("shardkit-ring", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="shardkit-ring-")  # pragma: no cover - not Linux
    os.unlink(path)
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


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
    weakref.finalize(buf, _libc.munmap, addr, nbytes)
    return buf


class _Slot:
    """One slot as the training process sees it: the batch-shaped tensor over its memory and
    the storage use count with only the loader's references (``baseline``)."""

    def __init__(self, images: torch.Tensor, pinned: int | None, shared: bool):
        self.images = images
        self.pinned = pinned  # the registered address, to unregister
        # Without worker processes the fill loop writes through this array (made before the
        # baseline is counted: a numpy view holds a reference to the storage).
        self.array = None if shared else images.numpy()
        self.baseline = _use_count(images)


class Ring:
    """``workers`` x ``slots`` batch buffers; sized by the first batch each slot receives."""

    def __init__(self, workers: int, slots: int, *, shared: bool, pin: bool):
        self.workers, self.slots, self.shared, self.pin = workers, slots, shared, pin
        self._fds: list[list[int]] = (
            [[_anonymous_file() for _ in range(slots)] for _ in range(workers)] if shared else []
        )
        self._slots: dict[tuple[int, int], _Slot] = {}

    def fds(self, worker: int) -> list[int]:
        """The descriptors of ``worker``'s slots (what its process maps)."""
        return list(self._fds[worker])

    def images(self, worker: int, slot: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot as a uint8 tensor of ``shape`` (a whole batch), mapped on first use."""
        s = self._slots.get((worker, slot))
        if s is None or tuple(s.images.shape) != tuple(shape):
            if s is not None:
                self._release(s)
            s = self._slots[(worker, slot)] = self._new(worker, slot, shape)
        return s.images

    def array(self, worker: int, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        """The slot as the fill loop of a ``num_workers=0`` loader writes it."""
        self.images(worker, slot, shape)
        return self._slots[(worker, slot)].array

    def kept(self, worker: int, slot: int) -> bool:
        """Whether anything outside the loader still refers to the slot's memory."""
        s = self._slots.get((worker, slot))
        return s is not None and _use_count(s.images) > s.baseline

    def replace(self, worker: int, slot: int) -> int | None:
        """Leave the slot's memory to whoever keeps it; the slot gets fresh memory. Returns the
        new descriptor the worker must map (None without worker processes)."""
        s = self._slots.pop((worker, slot), None)
        if s is not None and s.pinned is not None:
            self._release(s)
        if not self.shared:
            return None
        os.close(self._fds[worker][slot])
        fd = self._fds[worker][slot] = _anonymous_file()
        return fd

    @property
    def nbytes(self) -> int:
        return sum(s.images.numel() for s in self._slots.values())

    def close(self) -> None:
        for s in self._slots.values():
            self._release(s)
        self._slots.clear()
        for fds in self._fds:
            for fd in fds:
                os.close(fd)
        self._fds = []

    def __repr__(self) -> str:
        mb = self.nbytes / 2**20
        kind = "shared" if self.shared else "private"
        return f"Ring({self.workers} workers x {self.slots} slots, {mb:.1f} MiB {kind}" + (
            ", pinned)" if self.pin else ")"
        )

    def _new(self, worker: int, slot: int, shape: tuple[int, ...]) -> _Slot:
        nbytes = math.prod(shape)
        if self.shared:
            images = torch.frombuffer(_map(self._fds[worker][slot], nbytes), dtype=torch.uint8)
            images = images.view(shape)
        else:
            images = torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin)
        pinned = None
        if self.pin and self.shared:
            pinned = images.data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(pinned, nbytes, 1)  # portable
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte ring slot failed: {err}")
        return _Slot(images, pinned, self.shared)

    def _release(self, s: _Slot) -> None:
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
            os.close(self._fds[slot])
            self._fds[slot] = fd
