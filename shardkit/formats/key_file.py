"""The bytes of a dataset's key file, ``manifest.keys`` (FORMAT.md, "Key file"): its runs (the
base file and one file per growth step since it was last written whole), each run's head, the
sha256 its manifest lists, its columns memory-mapped, and a search of its sorted hashes by
``os.pread`` that reads only the bytes the searched hashes need. Written by growth
(``write.keyfile``) and read by growth and by a view's ``get(key)`` (``stream.lookup``): both
sides of the format in one place, below both."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np
from xxhash import xxh3_64_intdigest

__all__ = [
    "BLOCK",
    "HEAD",
    "KEYS_NAME",
    "MAGIC",
    "BlockTable",
    "RunUnchecked",
    "block_table",
    "blocks_problem",
    "checked_find",
    "file_digest",
    "shard_counts",
    "key_file_sha256",
    "key_runs",
    "mapped",
    "problem",
    "head_problem",
    "read_at",
    "run_count",
    "run_head",
    "run_name",
    "run_size",
    "runs_problem",
    "search",
    "shard_column",
    "shards_digest",
]

#: The key file's name beside the manifest.
KEYS_NAME = "manifest.keys"
MAGIC = b"SHKKEYS1"
#: Bytes before the hashes: magic, count, shards, the shards' identity (FORMAT.md).
HEAD = 56


#: Samples a block of a run's block table covers: 4 KB of hashes and 2 KB of shards, checked
#: by one digest (FORMAT.md, "Block table").
BLOCK = 512
#: Bytes of the block table a block: its fence (first hash) and its digest, uint64 each.
ENTRY = 16


class RunUnchecked(Exception):
    """A run whose bytes a read took are not what the manifest vouches for (its block table's
    sha256, a block's digest; a run without a table: its whole sha256): it does not serve."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


#: Hashes a search reads in its last step (at most 48 bytes): below it, one read, not more
#: halvings.
FINAL = 4


def run_name(k: int) -> str:
    """The file name of a growth run: ``manifest.keys.<k>`` beside the manifest."""
    return f"{KEYS_NAME}.{k}"


def run_size(n: int, table: bool = True) -> int:
    """The bytes of a run of ``n`` samples: ``56 + 12 n``, plus its block table (``16`` a
    block of ``BLOCK`` samples) where it has one (every run written since the table)."""
    return HEAD + 12 * n + (ENTRY * -(-n // BLOCK) if table else 0)


def run_count(entry: dict) -> int:
    """The samples of the run the manifest lists as ``entry``: the largest ``n`` whose
    ``run_size`` is at most its ``bytes`` (with a block table where it lists
    ``blocks_sha256``); a size no count fits is refused by ``problem``."""
    size, table = int(entry["bytes"]), "blocks_sha256" in entry
    if not table:
        return max(size - HEAD, 0) // 12
    n = max(size - HEAD, 0) * BLOCK // (12 * BLOCK + ENTRY)  # never below the count
    while n and run_size(n) > size:
        n -= 1
    return n


def key_runs(listed: dict) -> list[dict]:
    """The runs a manifest's ``keys`` lists, oldest (the base, ``keys`` itself) first: each
    ``{"path", "sha256", "bytes"}``."""
    if not listed:
        return []
    base = {k: listed[k] for k in ("path", "sha256", "bytes", "blocks_sha256") if k in listed}
    return [base, *(dict(r) for r in listed.get("runs", ()))]


def _doc(shards: Sequence) -> list:
    if hasattr(shards, "sha256"):  # a parsed manifest's columns: no object a shard
        return [
            list(x) for x in zip(np.asarray(shards.samples).tolist(), shards.sha256, strict=True)
        ]
    return [[s.samples, s.sha256] for s in shards]


def shards_digest(shards: Sequence, first: int | None = None) -> bytes:
    """The 32 bytes naming the shards a key file describes: ``keys.identity``'s sha256 (of
    the first ``first`` of them: what a run written when the dataset had those names)."""
    doc = _doc(shards)
    return hashlib.sha256(json.dumps(doc[:first]).encode()).digest()


def run_head(n: int, shards: Sequence) -> bytes:
    """A run's 56-byte head: the magic, its ``n`` samples, and the dataset's shards as it is
    written (their number and their identity)."""
    return (
        MAGIC + n.to_bytes(8, "little") + len(shards).to_bytes(8, "little") + shards_digest(shards)
    )


def file_digest(hashes, shards) -> str:
    """The listed sha256 from the two running sha256s, of the head and hashes and of the shards."""
    return hashlib.sha256(hashes.digest() + shards.digest()).hexdigest()


def key_file_sha256(path: str, n: int) -> str:
    """What the manifest lists as a key file's ``sha256`` (FORMAT.md): the sha256 of two
    sha256s, of its head and hashes and of its shard column, so a writer computes it as it
    writes the two in order (no read back); read here in 64 KiB pieces into one buffer."""
    parts, buf = [hashlib.sha256(), hashlib.sha256()], bytearray(1 << 16)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        for part, size in ((parts[0], HEAD + 8 * n), (parts[1], None)):
            while size is None or size > 0:  # the head and the hashes, then the shards
                got = f.readinto(view[: len(buf) if size is None else min(len(buf), size)])
                if not got:
                    break
                part.update(view[:got])
                size = None if size is None else size - got
    return file_digest(*parts)


def problem(
    path: str,
    listed: dict,
    n: int,
    shards: Sequence,
    whole: bool = True,
    last: bool = True,
    identity: bool | None = None,
) -> str:
    """Why the key file at ``path`` is not the one the manifest lists (``listed``: its
    ``keys``) for its ``n`` samples in ``shards``; "" where it is. ``whole``: its sha256 is
    checked (12 bytes a sample read) and its head's identity of the shards (their list hashed:
    ~0.6 us a shard); else only its size and its head's counts (one read of 56 bytes), what a
    reader that confirms every answer on the real key needs to use it, the rest left to when
    an answer is missing. ``identity``: the head's identity checked (default: ``whole``),
    what growth checks of the runs it searches without reading them. ``last``: the newest
    run, whose head names every shard; an older run's names the first shards, as many as the
    dataset had when it was written."""
    size = run_size(n, "blocks_sha256" in listed)
    try:
        if os.path.getsize(path) != size or listed["bytes"] != size:
            return f"not the {size} bytes of {n} samples"
        if whole and key_file_sha256(path, n) != listed["sha256"]:
            return "its sha256 is not the manifest's"
        with open(path, "rb") as f:
            head = f.read(HEAD)
        return head_problem(head, n, shards, last, whole if identity is None else identity)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"


def head_problem(head: bytes, n: int, shards: Sequence, last: bool, identity: bool) -> str:
    """Why a run's 56-byte ``head`` does not name its ``n`` samples and the dataset's
    ``shards`` (``last``, ``identity``: as ``problem`` takes them); "" where it does: what a
    reader of the run checks of it wherever the run lies (a file, an object read by ranges)."""
    named = int.from_bytes(head[16:24], "little")
    if (
        head[:8] != MAGIC
        or int.from_bytes(head[8:16], "little") != n
        or not _shards_ok(named, len(shards), last)
        or (identity and head[24:56] != shards_digest(shards, named))
    ):
        return "its head does not name this manifest's shards"
    return ""


def _shards_ok(named: int, shards: int, last: bool) -> bool:
    return named == shards if last else 0 < named <= shards


def runs_problem(
    folder: str,
    listed: dict,
    n: int,
    shards: Sequence,
    whole: bool = True,
    identity: bool | None = None,
) -> str:
    """Why the runs the manifest's ``keys`` lists (``key_runs``) do not serve its ``n``
    samples in ``shards``, naming the run; "" where they do. Their counts sum to ``n``, each
    is its listed size and head (and, ``whole``, its sha256; ``identity``, default ``whole``,
    its head's identity of the shards)."""
    runs = key_runs(listed)
    if sum(run_count(r) for r in runs) != n:
        return f"its runs hold {sum(run_count(r) for r in runs)} key hashes, not {n}"
    for i, r in enumerate(runs):
        path = os.path.join(folder, r["path"])
        why = problem(path, r, run_count(r), shards, whole, i == len(runs) - 1, identity)
        if why:
            return why if i == 0 else f"its run {path}: {why}"
    return ""


def read_at(fd, n: int, offset: int) -> bytes:
    """``n`` bytes of a key file at ``offset``, every read of one made here: ``fd`` a local
    file's descriptor (``os.pread``: no shared offset moved), or an object with a
    ``pread(n, offset)`` method (a URL dataset's key file by ranged GETs,
    ``remote.ranged.RangedFile``), so one reader serves both. Fewer bytes than ``n`` (a file
    cut short) are an ``OSError``, never a short answer."""
    raw = os.pread(fd, n, offset) if isinstance(fd, int) else fd.pread(n, offset)
    if len(raw) != n:
        raise OSError(f"a key file cut short at byte {offset + len(raw)}")
    return raw


def search(fd: int, n: int, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``lo, hi``: where each of ``want`` (uint64, ascending) is in the sorted hashes of the
    run of ``n`` samples open as ``fd`` (``hashes[lo:hi] == want``; ``lo == hi``: absent).
    A binary search of all of them at once by ``os.pread``: each halving reads the one
    8-byte hash at each distinct midpoint, down to runs of ``FINAL`` read whole with the two
    after them: about ``8 log2(n / 4) + 48`` bytes a searched hash; where that
    is more than the whole hash column (many hashes searched in a small run), the column is
    read instead."""
    m = len(want)
    want = np.asarray(want, np.uint64)
    if not n or not m:
        return np.zeros(m, np.int64), np.zeros(m, np.int64)
    steps = max(n // FINAL, 1).bit_length()
    if 8 * n <= m * (8 * steps + 8 * (FINAL + 2)):
        col = np.frombuffer(read_at(fd, 8 * n, HEAD), "<u8")
        return col.searchsorted(want, "left"), col.searchsorted(want, "right")
    lo, hi = np.zeros(m, np.int64), np.full(m, n, np.int64)
    while True:  # the first hash >= want[q] is at lo[q] .. hi[q]
        act = np.flatnonzero(hi - lo > FINAL)
        if not len(act):
            break
        mid = (lo[act] + hi[act]) // 2
        at = np.unique(mid)
        got = b"".join([read_at(fd, 8, HEAD + 8 * i) for i in at.tolist()])
        less = np.frombuffer(got, "<u8")[np.searchsorted(at, mid)] < want[act]
        lo[act[less]] = mid[less] + 1
        hi[act[~less]] = mid[~less]
    a, b = lo.copy(), lo.copy()
    starts, first = np.unique(lo, return_index=True)
    for s, q0, q1 in zip(starts.tolist(), first.tolist(), [*first[1:].tolist(), m], strict=True):
        end = min(int(hi[q0:q1].max()) + 2, n)  # past hi: the equal hashes that follow
        block = np.frombuffer(read_at(fd, 8 * (end - s), HEAD + 8 * s), "<u8")
        w = want[q0:q1]
        a[q0:q1] = s + block.searchsorted(w, "left")
        b[q0:q1] = s + block.searchsorted(w, "right")
        for q in range(q0, q1):  # equal hashes past the block (a collision): read on
            e = end
            while b[q] == e < n and a[q] < b[q]:
                nxt = min(e + 64, n)
                more = np.frombuffer(read_at(fd, 8 * (nxt - e), HEAD + 8 * e), "<u8")
                b[q] += int(more.searchsorted(want[q], "right"))
                e = nxt
    return a, b


def shard_column(fd: int, n: int, i: int, j: int) -> np.ndarray:
    """The shards of samples ``i .. j`` of the run of ``n`` samples open as ``fd``."""
    return np.frombuffer(read_at(fd, 4 * (j - i), HEAD + 8 * n + 4 * i), "<u4")


def mapped(path: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The key file's two columns, memory-mapped (read-only, nothing in the heap): the hashes
    (``uint64``, ascending) and each one's shard (``uint32``)."""
    if not n:
        return np.empty(0, np.uint64), np.empty(0, np.uint32)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return mm[HEAD : HEAD + 8 * n].view("<u8"), mm[HEAD + 8 * n : HEAD + 12 * n].view("<u4")


def shard_counts(shards, num_shards: int, offset: int = 0) -> np.ndarray:
    """How many of ``shards`` (a key file's shard column, or part of it) name each of
    ``num_shards`` shards, each numbered on by ``offset``; ValueError for one past them."""
    got = np.bincount(np.asarray(shards), minlength=0).astype(np.int64)
    if offset + len(got) > num_shards:
        raise ValueError(f"a key's shard is past the {num_shards} shards")
    out = np.zeros(num_shards, np.int64)
    out[offset : offset + len(got)] = got
    return out


def _block_digest(hashes: bytes, shards: bytes) -> int:
    return xxh3_64_intdigest(hashes + shards)


def block_table(hashes: np.ndarray, shards: np.ndarray) -> bytes:
    """The block table of a run's columns (``hashes`` uint64, ``shards`` uint32, in pieces
    of whole blocks but the last): each block's first hash and the XXH3-64 of its hash bytes
    then its shard bytes, uint64 each."""
    h, s = hashes.astype("<u8").tobytes(), shards.astype("<u4").tobytes()
    out = np.empty((-(-len(hashes) // BLOCK), 2), "<u8")
    for b in range(len(out)):
        i, j = b * BLOCK, min((b + 1) * BLOCK, len(hashes))
        out[b] = (hashes[i], _block_digest(h[8 * i : 8 * j], s[4 * i : 4 * j]))
    return out.tobytes()


class BlockTable:
    """A run's block table, read whole once and checked against the sha256 the manifest
    lists (``blocks_sha256``): 16 bytes a block of ``BLOCK`` samples."""

    def __init__(self, fd: int, path: str, n: int, sha256: str):
        nb = -(-n // BLOCK)
        raw = read_at(fd, ENTRY * nb, HEAD + 12 * n)
        if hashlib.sha256(raw).hexdigest() != sha256:
            raise RunUnchecked(path, "its block table's sha256 is not the manifest's")
        t = np.frombuffer(raw, "<u8").reshape(nb, 2)
        self.path, self.n, self.fences, self.digests = path, n, t[:, 0], t[:, 1]

    def block(self, fd: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s hashes and shards (one read of each column), once its digest is the
        table's: no byte of it trusted before."""
        i, j = b * BLOCK, min((b + 1) * BLOCK, self.n)
        h = read_at(fd, 8 * (j - i), HEAD + 8 * i)
        s = read_at(fd, 4 * (j - i), HEAD + 8 * self.n + 4 * i)
        if _block_digest(h, s) != int(self.digests[b]):
            raise RunUnchecked(self.path, f"its block {b} (samples {i} .. {j}) is not its digest")
        return np.frombuffer(h, "<u8"), np.frombuffer(s, "<u4")

    def blocks_of(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``first, last``: the blocks ``first .. last - 1`` that may hold each of ``want``
        (the one whose range it falls in; more only where equal hashes cross a fence)."""
        first = np.maximum(np.searchsorted(self.fences, want, "left") - 1, 0)
        return first, np.searchsorted(self.fences, want, "right")


def checked_find(fd: int, table: BlockTable, want: np.ndarray) -> tuple[list[int], list]:
    """``hit, shards``: the positions in ``want`` (uint64, ascending) of the hashes the run
    open as ``fd`` holds, and each one's shards (uint32), from the blocks that may hold them,
    each read and checked by its digest (``BlockTable.block``) before it answers, one at a
    time (nothing held but the answers): at most one block of ``BLOCK`` samples (``12 *
    BLOCK`` bytes) a searched hash, more only where equal hashes cross a fence."""
    want = np.asarray(want, np.uint64)
    first, last = table.blocks_of(want)
    found: list[tuple[int, np.ndarray]] = []
    one = np.flatnonzero(last - first == 1)  # want ascending: each block's are contiguous
    blocks, starts = np.unique(first[one], return_index=True)
    ends = [*starts[1:].tolist(), len(one)]
    for b, i, j in zip(blocks.tolist(), starts.tolist(), ends, strict=True):
        h, s = table.block(fd, b)
        qs = one[i:j]
        lo, hi = h.searchsorted(want[qs], "left"), h.searchsorted(want[qs], "right")
        found += [(int(qs[k]), s[lo[k] : hi[k]].copy()) for k in np.flatnonzero(hi > lo)]
    for q in np.flatnonzero(last - first > 1).tolist():  # equal hashes across a fence
        got = [table.block(fd, b) for b in range(int(first[q]), int(last[q]))]
        h, s = np.concatenate([x for x, _ in got]), np.concatenate([y for _, y in got])
        lo, hi = int(h.searchsorted(want[q], "left")), int(h.searchsorted(want[q], "right"))
        if hi > lo:
            found.append((q, s[lo:hi].copy()))
    found.sort(key=lambda x: x[0])
    return [q for q, _ in found], [x for _, x in found]


def blocks_problem(path: str, entry: dict, n: int) -> str:
    """Why the block table of the run at ``path`` (listed as ``entry``, ``n`` samples) is not
    its columns' (each block's fence and digest recomputed, ``1 << 10`` blocks at a time) or
    the listed ``blocks_sha256``; "" where it is, or the run has none (written before it)."""
    if "blocks_sha256" not in entry:
        return ""
    hashes, shards = mapped(path, n)
    with open(path, "rb") as f:
        f.seek(HEAD + 12 * n)
        stored = f.read()
    if hashlib.sha256(stored).hexdigest() != entry["blocks_sha256"]:
        return "its block table's sha256 is not the manifest's"
    step = BLOCK << 10
    for i in range(0, n, step):
        got = block_table(np.asarray(hashes[i : i + step]), np.asarray(shards[i : i + step]))
        at = ENTRY * (i // BLOCK)
        if got != stored[at : at + len(got)]:
            return f"its block table is not its columns' (from sample {i})"
    return ""
