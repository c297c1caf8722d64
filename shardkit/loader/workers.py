"""The worker backends: where the fill loop runs and how its batches reach the consumer.

``ProcessWorkers``: one process per worker, started on the first iteration and kept across
epochs (each runs ``Filler`` for every ``Start`` it is sent). A worker's process is the only
place its shards are opened (remote storage and prefetch included), it never touches CUDA, and it
talks to the loader over one duplex pipe of small messages (``messages.py``). Faults are errors,
never hangs: the loader waits on the pipe and on the process's sentinel together, so a worker
killed by a signal (the OOM killer's SIGKILL) is reported within the wait, and so is one that
dies while the loader hands it a slot back; a worker whose loader died sees its pipe close or the
loader's process end (a pidfd: right under fork, spawn and forkserver alike) and exits by itself.
A worker that sends nothing for ``STALL_WARN_S`` (stopped, deadlocked in a transform) is warned
about with its pid and state. Workers belong to the process that started them: a forked child
of that process cannot talk to them (``ForeignLoaderError``) and never stops them.

No bubble between epochs: a worker whose part of an epoch is done fills the first batches of the
epoch the loader expects next (``Start.ahead``) into the slots the consumer gives back while it
drains the rest, and keeps their messages; the next iteration takes them when it starts exactly
that epoch from its beginning, and otherwise they are dropped and the slots are free again.

``LocalWorkers``: the same loop in the caller, for ``num_workers=0`` (nothing runs while the caller
is away, so nothing is filled ahead).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
import warnings
from collections import deque
from multiprocessing import connection, reduction

import torch
import torch.multiprocessing as mp

from ..errors import ShardkitError, TransformError
from .fill import Abandon, Filler, FillSpec
from .messages import Batch, End, Free, Replace, Share, Start, Stop
from .ring import MappedSlots, Ring, forget_inherited, keeping_at_fork

__all__ = [
    "ForeignLoaderError",
    "LocalWorkers",
    "ProcessWorkers",
    "STALL_WARN_S",
    "WorkerDied",
    "default_start_method",
]

_PARENT_CHECK_S = 1.0  # where no pidfd exists: how often an idle worker checks its parent
_STOP_S = 5.0  # how long ``close`` lets its workers take to exit before killing them
#: Seconds without a message from a worker before the loader warns (with ``timeout=0`` it keeps
#: waiting, as DataLoader does: a long transform or a slow remote read is not a fault).
STALL_WARN_S = 60.0


class WorkerDied(ShardkitError):
    """A worker process ended without saying why (a signal, the OOM killer, a crash)."""


class ForeignLoaderError(ShardkitError):
    """A forked child used a loader whose workers belong to its parent."""


def default_start_method() -> str:
    """fork where the platform has it (workers start in milliseconds), else spawn."""
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


class _Fd:
    """A descriptor for a worker process: inherited as is by fork, duplicated into the child by
    spawn and forkserver (pickled at start, when multiprocessing can pass descriptors)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _Fd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> _Fd:
        return _Fd(dup.detach())


# --- the loader's side -----------------------------------------------------------------------


class LocalWorkers:
    """``num_workers=0``: the fill loop runs in the caller, one batch per draw."""

    fills_ahead = False  # nothing runs between the caller's draws
    ahead = None

    def __init__(self, dataset, spec: FillSpec, ring: Ring):
        self.ring = ring
        self.slots = MappedSlots(ring=ring)
        self.filler = Filler(dataset, spec, 0, self.slots)
        self.gen = -1
        self._free: deque[int] = deque()
        self._batches = None

    def start(
        self, gen: int, epoch: int, resumes: list[dict | None], ahead: tuple | None = None
    ) -> None:
        self.abandon()
        self.gen = gen
        self._free = deque(range(self.ring.slots))
        self._batches = self.filler.run(Start(gen, epoch, resumes[0]), self._acquire)

    def next(self, worker: int) -> Batch | End:
        try:
            batch = next(self._batches)
        except StopIteration:
            return End(self.gen, 0)
        batch.gen = self.gen
        self.filler.count_skips(batch)
        return batch

    def free(self, worker: int, slot: int) -> None:
        self._free.append(slot)

    def replace(self, worker: int, slot: int) -> None:
        self.ring.replace(worker, slot)
        self.slots.replace(slot, None)
        self.filler.forget(slot)
        self._free.append(slot)

    def share(self, fraction: float) -> None:
        self.filler.share = fraction

    def abandon(self) -> None:
        if self._batches is not None:
            self._batches.close()  # closes the record stream (its shard files)
            self._batches = None

    def close(self) -> None:
        self.abandon()

    @property
    def pids(self) -> list[int]:
        return []

    def _acquire(self) -> int:
        if not self._free:  # the consumer holds every slot: a bug in the slot count
            raise ShardkitError("ShardLoader: no free slot in the caller's own ring")
        return self._free.popleft()


class ProcessWorkers:
    """``num_workers`` persistent worker processes filling their slots of ``ring``."""

    fills_ahead = True

    def __init__(self, dataset, spec: FillSpec, ring: Ring, start_method: str, timeout: float):
        self.ring, self.timeout = ring, timeout
        self.gen = -1
        #: (generation, epoch) the workers fill ahead once their part of this one is done
        self.ahead: tuple[int, int] | None = None
        self.owner = os.getpid()
        ctx = mp.get_context(start_method)
        forked = start_method == "fork"
        self.conns: list[connection.Connection] = []
        self.procs = []
        try:
            for w in range(spec.num_workers):
                mine, theirs = ctx.Pipe(duplex=True)
                self.conns.append(mine)
                # A forked child inherits every open descriptor: it closes the loader's ends of
                # all pipes, or a dead loader's pipes would never read as closed.
                inherited = [c.fileno() for c in self.conns] if forked else []
                proc = ctx.Process(
                    target=_worker_main,
                    args=(dataset, spec, w, theirs, [_Fd(fd) for fd in ring.fds(w)], os.getpid()),
                    kwargs={"inherited": inherited},
                    name=f"shardkit-worker-{w}",
                    daemon=True,
                )
                try:
                    with keeping_at_fork(ring.fds(w)):  # fork: its slots survive the hook
                        proc.start()
                finally:
                    theirs.close()
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(
        self, gen: int, epoch: int, resumes: list[dict | None], ahead: tuple | None = None
    ) -> None:
        """Every worker fills its part of ``epoch`` as generation ``gen`` (a ``gen`` equal to
        the last ``ahead``'s takes the batches filled ahead for it), then ``ahead``'s."""
        self.gen, self.ahead = gen, ahead
        for w, resume in enumerate(resumes):
            # a worker dead since the last epoch raises
            self._send(w, Start(gen, epoch, resume, ahead))

    def next(self, worker: int) -> Batch | End:
        """The next message of the current generation from ``worker`` (stale ones dropped)."""
        self._check_owner()
        conn, proc = self.conns[worker], self.procs[worker]
        waited = 0.0
        while True:
            wait = STALL_WARN_S if not self.timeout else min(self.timeout - waited, STALL_WARN_S)
            t0 = time.monotonic()
            ready = connection.wait([conn, proc.sentinel], timeout=max(wait, 0.0))
            if not ready:
                waited += time.monotonic() - t0
                if self.timeout and waited >= self.timeout:
                    raise ShardkitError(
                        f"ShardLoader worker {worker} (pid {proc.pid}) sent no batch in "
                        f"{self.timeout} s (timeout=)"
                    )
                warnings.warn(
                    f"ShardLoader worker {worker} (pid {proc.pid}, {_process_state(proc.pid)}) "
                    f"has sent no batch for {waited:.0f} s; still waiting (pass timeout= to "
                    "raise instead)",
                    RuntimeWarning,
                    stacklevel=5,
                )
                continue
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise self._died(worker) from None
                if msg.gen == self.gen:
                    return msg
            elif not conn.poll():
                raise self._died(worker)

    def free(self, worker: int, slot: int) -> None:
        self._send(worker, Free(slot))

    def replace(self, worker: int, slot: int) -> None:
        fd = self.ring.replace(worker, slot)
        self._send(worker, Replace(slot))
        try:
            reduction.send_handle(self.conns[worker], fd, self.procs[worker].pid)
        except OSError:
            raise self._died(worker) from None

    def share(self, fraction: float) -> None:
        """decode_on="auto": every worker decodes ``fraction`` of its batches from now on."""
        for w in range(len(self.conns)):
            self._send(w, Share(fraction))

    def abandon(self) -> None:
        """Nothing to do: the next ``Start`` abandons the current generation in every worker."""

    def _send(self, worker: int, msg) -> None:
        self._check_owner()
        try:
            self.conns[worker].send(msg)
        except OSError:  # a broken pipe: the worker is dead (or dying: the sentinel says why)
            raise self._died(worker) from None

    def _check_owner(self) -> None:
        if os.getpid() != self.owner:
            raise ForeignLoaderError(
                f"this ShardLoader's workers belong to process {self.owner}, and this process "
                f"({os.getpid()}) is a fork of it: build a new ShardLoader here (the parent's "
                "keeps working)"
            )

    def close(self) -> None:
        if os.getpid() != self.owner:  # a fork of the loader's process: the workers are not ours
            for conn in self.conns:
                conn.close()
            self.conns, self.procs = [], []
            return
        for conn in self.conns:
            try:
                conn.send(Stop())
            except OSError:
                pass
        deadline = time.monotonic() + _STOP_S
        # not strict: a failed start leaves a pipe more than processes
        for conn, proc in zip(self.conns, self.procs, strict=False):
            _until_exit(conn, proc, deadline)
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []

    def _died(self, worker: int) -> WorkerDied:
        proc = self.procs[worker]
        proc.join(timeout=5)
        code = proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            how = f"killed by signal {name}"
            if -code == signal.SIGKILL:
                how += " (when nobody sent it, the kernel's OOM killer did: see dmesg)"
        else:
            how = f"exited with code {code}"
        return WorkerDied(f"ShardLoader worker {worker} (pid {proc.pid}) died: {how}")


def _until_exit(conn, proc, deadline: float) -> None:
    """Read and drop what a stopping worker still sends until it has exited (or ``deadline``):
    a batch larger than the pipe's buffer (``sample_transform`` outputs, masks) blocks its worker
    in the send, where it would never read its ``Stop``."""
    while (left := deadline - time.monotonic()) > 0:
        ready = connection.wait([conn, proc.sentinel], timeout=left)
        if not ready or proc.sentinel in ready:
            return
        try:
            conn.recv()
        except (EOFError, OSError):
            return


# --- the worker's side ------------------------------------------------------------------------


class _Inbox:
    """A worker's view of its pipe: free slots, the generation it fills, and where that
    generation's messages go: to the loader at once, or kept while it fills ahead (``kept``),
    until a ``Start`` of that generation sends them or any other drops them."""

    def __init__(self, conn, parent: int, slots: MappedSlots, filler: Filler, count: int):
        self.conn, self.parent, self.slots, self.filler = conn, parent, slots, filler
        self.count = count
        self.loader_end, self.loader_gone = _process_end(parent)
        self.free: deque[int] = deque()
        self.next: Start | Stop | None = None  # what ended the current generation
        self.job: Start | None = None  # the generation being (or last) filled
        self.kept: list | None = None  # filling ahead: its messages so far; None: sent at once
        self.taken: int | None = None  # the slot acquired last, until its batch is delivered
        self.failed = False  # the generation ended with an error: nothing is filled ahead

    def wait(self) -> Start | None:
        """The next generation to fill (None: stop): a new ``Start``; or, once a part is done
        and sent, the epoch its ``Start`` said to fill ahead."""
        while True:
            if self.next is not None:
                return self._begin()
            job = self.job
            if self.kept is None and not self.failed and job is not None and job.ahead:
                self._drain()  # a Start already sent wins
                if self.next is None:
                    gen, epoch = job.ahead
                    self.job, self.kept = Start(gen, epoch), []
                    return self.job  # the free slots: those given back meanwhile
                continue
            self._handle(self._recv())

    def acquire(self) -> int:
        """A free slot; raises ``Abandon`` once a new ``Start`` or ``Stop`` has arrived."""
        self._drain()
        while (not self.free or self._ahead_full()) and self.next is None:
            self._handle(self._recv())
        if self.next is not None:
            raise Abandon
        self.taken = self.free.popleft()
        return self.taken

    def deliver(self, msg: Batch | End) -> None:
        """Send ``msg`` to the loader, or keep it while filling ahead."""
        if isinstance(msg, End):
            self.failed = msg.error is not None
            if self.taken is not None:  # acquired for a batch that came out empty: still free
                self.free.appendleft(self.taken)
        self.taken = None
        if self.kept is not None:
            self.kept.append(msg)
            return
        if isinstance(msg, Batch):
            self.filler.count_skips(msg)
        self.conn.send(msg)

    def _ahead_full(self) -> bool:
        """Filling ahead, and ``fill_ahead`` batches are ready: wait for the loader (a batch
        more is work thrown away if no epoch follows, as after the last one)."""
        if self.kept is None:
            return False
        return sum(isinstance(m, Batch) for m in self.kept) >= self.filler.spec.fill_ahead

    def _begin(self) -> Start | None:
        msg, self.next = self.next, None
        if isinstance(msg, Stop):
            return None
        self.free = deque(range(self.count))  # the loader holds none of them now
        self.job, self.kept, self.failed = msg, None, False  # anything filled ahead is dropped
        self.taken = None
        return msg

    def _adopts(self, msg: Start) -> bool:
        """``msg`` starts the generation being filled ahead: keep filling it, for the loader."""
        job = self.job
        return (
            self.kept is not None
            and self.next is None
            and msg.resume is None
            and (msg.gen, msg.epoch) == (job.gen, job.epoch)
        )

    def _adopt(self, msg: Start) -> None:
        """Send what was filled ahead; every slot not holding one of its batches is free (the
        loader holds none of its own now)."""
        kept, self.kept, self.job = self.kept, None, msg
        busy = {m.slot for m in kept if isinstance(m, Batch)}
        self.free = deque(s for s in range(self.count) if s not in busy)
        for m in kept:
            self.deliver(m)

    def _drain(self) -> None:
        while self.conn.poll():
            self._handle(self.conn.recv())

    def _handle(self, msg) -> None:
        if isinstance(msg, Free):
            self.free.append(msg.slot)
        elif isinstance(msg, Replace):
            self.slots.replace(msg.slot, reduction.recv_handle(self.conn))
            self.filler.forget(msg.slot)
            self.free.append(msg.slot)
        elif isinstance(msg, Share):
            self.filler.share = msg.fraction
        elif isinstance(msg, Start) and self._adopts(msg):
            self._adopt(msg)
        else:  # Start, Stop
            self.next = msg

    def _recv(self):
        while True:
            ready = connection.wait([self.conn, *self.loader_end], timeout=_PARENT_CHECK_S)
            if self.conn in ready:
                return self.conn.recv()
            if ready or self.loader_gone():
                os._exit(0)  # the loader's process is gone: so is everyone who wanted batches


def _worker_main(dataset, spec: FillSpec, worker: int, conn, fds, parent: int, inherited=()):
    for fd in inherited:
        try:
            os.close(fd)
        except OSError:
            pass
    forget_inherited({f.fd for f in fds})  # other loaders' rings (fork), before mapping ours
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle
    torch.set_num_threads(1)  # one core per worker for the resize: no oversubscription
    slots = MappedSlots(fds=[f.fd for f in fds])
    filler = Filler(dataset, spec, worker, slots)
    inbox = _Inbox(conn, parent, slots, filler, len(fds))
    try:
        start = inbox.wait()
        while start is not None:
            _fill(filler, start, inbox, worker)
            start = inbox.wait()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the loader is gone
    finally:
        conn.close()


def _fill(filler: Filler, start: Start, inbox: _Inbox, worker: int) -> None:
    """One generation: its batches, then its ``End`` (with the error that stopped it early)."""
    try:
        for batch in filler.run(start, inbox.acquire):
            batch.gen = start.gen
            inbox.deliver(batch)
        inbox.deliver(End(start.gen, worker))
    except Abandon:
        pass
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, TransformError) else None
        inbox.deliver(End(start.gen, worker, _sendable(exc), cause and _sendable(cause)))


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives the pipe, else a ShardkitError with its text; non-shardkit errors
    carry the worker's traceback as a note (as DataLoader's workers do)."""
    if not isinstance(exc, ShardkitError) and hasattr(exc, "add_note"):
        exc.add_note("in a ShardLoader worker process:\n" + "".join(traceback.format_exc()))
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return ShardkitError(f"{type(exc).__name__}: {exc}")


def _process_end(pid: int):
    """(descriptors that become readable when process ``pid`` ends, a check that it has).

    A pidfd where the kernel has one: exact under every start method (a forkserver worker's
    parent is the fork server, not the loader) and immune to pid reuse. Else the parent process
    id as the worker first saw it, polled."""
    try:
        fd = os.pidfd_open(pid)
        return [fd], lambda: False
    except ProcessLookupError:  # gone already
        return [], lambda: True
    except (AttributeError, OSError):
        first = os.getppid()
        return [], lambda: os.getppid() != first


def _process_state(pid: int) -> str:
    """The kernel's word for what ``pid`` is doing ("T (stopped)", "D (disk sleep)"...)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "state " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "state unknown"
