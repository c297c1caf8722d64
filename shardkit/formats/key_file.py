"""The bytes of a dataset's key file, ``manifest.keys`` (FORMAT.md, "Key file"): its runs (the
base file and one file per growth step since it was last written whole), each run's head, the
sha256 its manifest lists, its columns memory-mapped, its block table, its count table (each
shard's count below a few grid points of hash space: ``CountTable``, ``counts_below``), and a
search of its sorted hashes that reads only the bytes the searched hashes need, every partial
read through ``read_at``. Written by growth (``write.keyfile``) and read by growth, by a
view's ``get(key)`` and by a split's counts (``stream.lookup``): both sides of the format in
one place, below both."""

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
    "CountTable",
    "RunUnchecked",
    "block_table",
    "blocks_problem",
    "checked_block",
    "checked_find",
    "count_bits",
    "count_bytes",
    "counts_below",
    "file_digest",
    "shard_counts",
    "key_file_sha256",
    "key_runs",
    "mapped",
    "problem",
    "head_problem",
    "listed_size",
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
    ``blocks_sha256``), less its count table's where it lists ``counts``; a size no count
    fits is refused by ``problem``."""
    size, table = int(entry["bytes"]) - _counts_of(entry), "blocks_sha256" in entry
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
    fields = ("path", "sha256", "bytes", "blocks_sha256", "counts")
    base = {k: listed[k] for k in fields if k in listed}
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
    size = listed_size(listed, n)
    try:
        if os.path.getsize(path) != size or listed["bytes"] != size:
            return f"not the {size} bytes of {n} samples"
        if whole and key_file_sha256(path, n) != listed["sha256"]:
            return "its sha256 is not the manifest's"
        with open(path, "rb") as f:
            head = f.read(HEAD)
        why = head_problem(head, n, shards, last, whole if identity is None else identity, listed)
        if why:
            return why
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return ""


def listed_size(listed: dict, n: int) -> int:
    """The bytes the run the manifest lists as ``listed`` has for ``n`` samples: its columns,
    its block table where it lists ``blocks_sha256``, its count table where it lists
    ``counts``."""
    return run_size(n, "blocks_sha256" in listed) + _counts_of(listed)


def head_problem(
    head: bytes, n: int, shards: Sequence, last: bool, identity: bool, listed: dict
) -> str:
    """Why a run's 56-byte ``head`` does not name its ``n`` samples and the dataset's
    ``shards`` (``last``, ``identity``: as ``problem`` takes them), or its listed count table
    (``listed``: the manifest's entry) is not the size of its points over the shards the head
    names; "" where it does: what a reader of the run checks of it wherever the run lies (a
    file, an object read by ranges)."""
    named = int.from_bytes(head[16:24], "little")
    if (
        head[:8] != MAGIC
        or int.from_bytes(head[8:16], "little") != n
        or not _shards_ok(named, len(shards), last)
        or (identity and head[24:56] != shards_digest(shards, named))
    ):
        return "its head does not name this manifest's shards"
    if "counts" in listed:
        got = listed["counts"]
        if "blocks_sha256" not in listed:
            return "it lists a count table and no block table"
        if count_bytes(int(got["k"]), named) != int(got["bytes"]):
            return f"its count table is not the bytes of 2^{got['k']} points of {named} shards"
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
        return checked_block(fd, self.path, self.n, b, int(self.digests[b]))

    def blocks_of(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``first, last``: the blocks ``first .. last - 1`` that may hold each of ``want``
        (the one whose range it falls in; more only where equal hashes cross a fence)."""
        first = np.maximum(np.searchsorted(self.fences, want, "left") - 1, 0)
        return first, np.searchsorted(self.fences, want, "right")


def checked_block(fd: int, path: str, n: int, b: int, digest: int):
    """Block ``b`` of the run of ``n`` samples open as ``fd``: its hashes and shards (one read
    of each column), once their digest is ``digest`` (its block-table row's)."""
    i, j = b * BLOCK, min((b + 1) * BLOCK, n)
    h = read_at(fd, 8 * (j - i), HEAD + 8 * i)
    s = read_at(fd, 4 * (j - i), HEAD + 8 * n + 4 * i)
    if _block_digest(h, s) != digest:
        raise RunUnchecked(path, f"its block {b} (samples {i} .. {j}) is not its digest")
    return np.frombuffer(h, "<u8"), np.frombuffer(s, "<u4")


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
    the listed ``blocks_sha256``, or its count table (where ``counts`` is listed) not the one
    its columns and block table give (``CountTable``, built in the same pass: its ``k``, its
    rows' sha256, every row and vector; the first point that differs named); "" where they
    are, or the run has none (written before them)."""
    if "blocks_sha256" not in entry:
        return ""
    hashes, shards = mapped(path, n)
    with open(path, "rb") as f:
        f.seek(HEAD + 12 * n)
        stored = f.read(ENTRY * -(-n // BLOCK))
        named = int.from_bytes(read_at(f.fileno(), 8, 16), "little")
        listed = entry.get("counts")
        counts = f.read(int(listed["bytes"])) if listed else b""
    if hashlib.sha256(stored).hexdigest() != entry["blocks_sha256"]:
        return "its block table's sha256 is not the manifest's"
    step, built = BLOCK << 10, CountTable(n, named)
    for i in range(0, n, step):
        h, s = np.asarray(hashes[i : i + step]), np.asarray(shards[i : i + step])
        got = block_table(h, s)
        at = ENTRY * (i // BLOCK)
        if got != stored[at : at + len(got)]:
            return f"its block table is not its columns' (from sample {i})"
        built.add(h, s)
    if not listed:  # a run written before the count table, or too small for one
        return ""
    if built.k != int(listed["k"]):
        return f"its count table has 2^{listed['k']} points, its size gives 2^{built.k}"
    if hashlib.sha256(counts[: 16 << built.k]).hexdigest() != listed["sha256"]:
        return "its count table's sha256 is not the manifest's"
    want = built.table(stored)
    if counts != want:
        j = _first_vector(counts, want, built.k, named)
        return f"its count table is not its columns' (point {j}: the counts below it)"
    return ""


def _first_vector(got: bytes, want: bytes, k: int, shards: int) -> int:
    """The first grid point whose row or vector differs between two count tables."""
    rows, bad = 16 << k, next(i for i in range(len(want)) if got[i] != want[i])
    return bad // 16 if bad < rows else 1 + (bad - rows) // (4 * shards)


#: The count table's vectors take at most 1/RATIO of a run's column bytes (FORMAT.md).
COUNT_RATIO = 64


def count_bytes(k: int, shards: int) -> int:
    """The bytes of a count table of ``2^k`` grid points over ``shards`` shards: ``2^k``
    rows of 16 bytes (each point's position and digest) and ``2^k - 1`` vectors of ``4 *
    shards`` bytes (none where ``k`` is 0)."""
    return 0 if not k else 16 * (1 << k) + 4 * shards * ((1 << k) - 1)


def count_bits(n: int, shards: int) -> int:
    """The ``k`` a writer gives a run of ``n`` samples over ``shards`` shards: the largest
    with ``4^k <= n`` (no more points than reading a point's samples saves) and a table of at
    most ``12 n / 64`` bytes (``count_bytes``); 0 (no table) where even ``k = 1`` is more:
    a small run's prefix is small anyway."""
    k = 0
    while 4 ** (k + 1) <= n and count_bytes(k + 1, shards) * COUNT_RATIO <= 12 * n:
        k += 1
    return k


def _counts_of(entry: dict) -> int:
    got = entry.get("counts")
    return int(got["bytes"]) if got else 0


class CountTable:
    """A run's count table built as its columns are written (or read, to check it), in
    order, in pieces: each piece's samples counted a shard in each segment of hash space
    between two grid points (``g_j = j * 2^(64 - k)``); ``table`` gives the bytes once the
    block table is known. Holds ``2^k x shards`` uint32 (at most 1/64 of the run's bytes)."""

    def __init__(self, n: int, shards: int):
        self.n, self.shards, self.k = int(n), int(shards), count_bits(n, shards)
        self.segments = np.zeros(((1 << self.k) if self.k else 0, self.shards), np.uint32)

    def add(self, hashes: np.ndarray, shards: np.ndarray) -> None:
        """The next samples of the run, in order (hashes ascending)."""
        if not self.k or not len(hashes):
            return
        shards = np.asarray(shards, np.int64)
        if int(shards.max()) >= self.shards:
            raise ValueError(f"a key's shard is past the {self.shards} shards")
        seg = np.asarray(hashes, np.uint64) >> np.uint64(64 - self.k)
        lo, hi = int(seg[0]), int(seg[-1]) + 1
        where = (seg.astype(np.int64) - lo) * self.shards + shards
        got = np.bincount(where, minlength=(hi - lo) * self.shards)
        self.segments[lo:hi] += got.reshape(hi - lo, self.shards).astype(np.uint32)

    def table(self, blocks: bytes) -> bytes:
        """The count table (FORMAT.md, "Count table") of the samples added, given the run's
        block table ``blocks``: each point's position and digest, then its vector."""
        if not self.k:
            return b""
        vectors = np.cumsum(self.segments[:-1], axis=0, dtype=np.uint64).astype("<u4")
        pos = [0, *vectors.sum(axis=1, dtype=np.int64).tolist(), self.n]
        rows = np.empty((1 << self.k, 2), "<u8")
        for j in range(1 << self.k):
            vec = vectors[j - 1].tobytes() if j else b""
            b0, b1 = _segment_blocks(pos[j], pos[j + 1], self.n)
            rows[j] = (pos[j], xxh3_64_intdigest(vec + blocks[ENTRY * b0 : ENTRY * b1]))
        return rows.tobytes() + vectors.tobytes()


def _segment_blocks(p: int, q: int, n: int) -> tuple[int, int]:
    """The blocks ``b0 .. b1 - 1`` whose block-table rows a point's digest covers: from the
    block holding its position ``p`` through the one holding the next point's ``q`` (the
    last block where that is the run's end): every block a count below a threshold between
    the two points reads."""
    last = max(-(-n // BLOCK) - 1, 0)
    return min(p // BLOCK, last), min(q // BLOCK, last) + 1


def counts_below(fd: int, path: str, n: int, shards: int, entry: dict, threshold: int):
    """Each of the run's ``shards`` shards' count of its hashes below ``threshold`` (the run
    of ``n`` samples open as ``fd``, listed as ``entry`` with a ``counts`` table), from the
    count table: its rows (16 bytes a point, checked by the listed sha256), the vector of the
    last point at most ``threshold`` (``4 * shards`` bytes), the block-table rows of its
    segment, both checked by the point's digest, and the blocks from the point's position to
    ``threshold``'s, each checked by its digest: ``16 * 2^k + 4 * shards + 16 * (n / 512 /
    2^k + 2) + 12 * (n / 2^k + 512)`` bytes at most, whatever ``threshold`` is."""
    k, listed = int(entry["counts"]["k"]), entry["counts"]
    nb, at = -(-n // BLOCK), HEAD + 12 * n + ENTRY * -(-n // BLOCK)
    raw = read_at(fd, 16 << k, at)
    if hashlib.sha256(raw).hexdigest() != listed["sha256"]:
        raise RunUnchecked(path, "its count table's sha256 is not the manifest's")
    rows = np.frombuffer(raw, "<u8").reshape(1 << k, 2)
    j = min(threshold >> (64 - k), (1 << k) - 1)
    p = int(rows[j, 0])
    q = int(rows[j + 1, 0]) if j + 1 < len(rows) else n
    vec = read_at(fd, 4 * shards, at + (16 << k) + 4 * shards * (j - 1)) if j else b""
    b0, b1 = _segment_blocks(p, q, n)
    table = read_at(fd, ENTRY * (b1 - b0), HEAD + 12 * n + ENTRY * b0) if nb else b""
    counts = np.frombuffer(vec, "<u4").astype(np.int64) if j else np.zeros(shards, np.int64)
    if xxh3_64_intdigest(vec + table) != int(rows[j, 1]) or int(counts.sum()) != p:
        raise RunUnchecked(path, f"its count table's point {j} is not its digest")
    t = np.frombuffer(table, "<u8").reshape(-1, 2)
    point, end = np.uint64(j << (64 - k)), np.uint64(min(threshold, 2**64 - 1))
    for b in range(b0, b1):
        if b > b0 and ((threshold < 2**64 and t[b - b0, 0] >= end) or BLOCK * b >= q):
            break  # every hash from this block on is at or past the threshold
        h, s = checked_block(fd, path, n, b, int(t[b - b0, 1]))
        lo = p - BLOCK * b if p > BLOCK * b else 0
        if (lo and h[lo - 1] >= point) or (lo < len(h) and h[lo] < point):
            raise RunUnchecked(path, f"its count table's point {j} is not its position")
        upto = len(h) if threshold >= 2**64 else int(h.searchsorted(end))
        counts += shard_counts(s[lo:upto], shards)
        if upto < len(h):
            break
    return counts
