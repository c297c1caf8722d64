"""The on-disk B-tree of an LMDB file, read with plain ``pread`` calls and checked as it goes.

Layout constants are LMDB 0.9's (mdb.c), which FORMAT.md pins: the meta pages (``pick_meta``),
a page's header and node offsets (``read_page``), the keys and children of its nodes, and the
``Walker`` that visits every page of a tree once before a shard is read (``check_structure``).
Every fault is a ``Damaged`` (text for the ``ShardFormatError`` the reader raises, naming the
shard); nothing here keeps a file open or knows about samples.
"""

from __future__ import annotations

import os
import struct

__all__ = [
    "Damaged",
    "Walker",
    "check_structure",
    "child",
    "key_at",
    "lower_bound",
    "pick_meta",
    "read_meta",
    "read_page",
]

# --- structural check before reading ----------------------------------------------------------
#
# An LMDB file holds offsets, sizes and page numbers: one flipped byte in a node pointer or an
# overflow size points outside the page or the file (LMDB's own reader would SIGBUS or abort
# there). Before a shard is read, its B-tree is walked with plain reads (bounds-checked) and any
# page that cannot be followed safely is refused, once per file identity; the reader (``reader``)
# checks each page it reads again. Layout constants are LMDB 0.9's (mdb.c), which FORMAT.md pins.

META = struct.Struct("<IIQQ")  # magic, version, address, mapsize (at page offset 16)
DB = struct.Struct(
    "<IHHQQQQQ"
)  # pad (psize for the free DB), flags, depth, branch/leaf/ovf, entries, root
PAGE_HDR = struct.Struct(
    "<QHHHH"
)  # pgno, pad, flags, lower, upper (upper/lower = pages on overflow)
NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
HDR, NODE_HDR = 16, 8
MAGIC, DATA_VERSION = 0xBEEFC0DE, 1
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA = 0x01
MAX_DEPTH = 32  # 2^32 samples at the smallest fan-out; anything deeper is damage


class Damaged(Exception):
    """A structural fault, as text for the ShardFormatError that names the shard."""


def read_meta(f, off: int) -> tuple[int, int, int, tuple]:
    """(txnid, last_pgno, psize, main DB record) of the meta page at ``off``."""
    raw = os.pread(f, HDR + 136, off)
    if len(raw) < HDR + 136:
        raise Damaged("meta page is short")
    magic, version, _, _ = META.unpack_from(raw, HDR)
    if magic != MAGIC or version != DATA_VERSION:
        raise Damaged("meta page has no LMDB magic number")
    free = DB.unpack_from(raw, HDR + META.size)
    main = DB.unpack_from(raw, HDR + META.size + DB.size)
    last_pgno, txnid = struct.unpack_from("<QQ", raw, HDR + META.size + 2 * DB.size)
    return txnid, last_pgno, free[0], main


def pick_meta(fd: int, size: int) -> tuple[int, int, int, tuple]:
    """The meta page LMDB will use (the newer transaction), checked against the file size."""
    first = read_meta(fd, 0)
    psize = first[2]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise Damaged(f"meta page gives page size {psize}")
    second = read_meta(fd, psize)
    if second[2] != psize:
        raise Damaged("the two meta pages disagree on the page size")
    txnid, last_pgno, _, main = max(first, second, key=lambda m: m[0])  # LMDB: newest txn wins
    if (last_pgno + 1) * psize > size:
        raise Damaged(f"{size} of {(last_pgno + 1) * psize} bytes", "truncated")
    if main[1] != 0:
        raise Damaged(f"database flags {main[1]:#x}; shardkit writes none")
    return txnid, last_pgno, psize, main


def read_page(fd: int, psize: int, last: int, pgno: int, want: int):
    """Page ``pgno``'s bytes and node offsets, after checking its header (type ``want``)."""
    if not 2 <= pgno <= last:
        raise Damaged(f"page number {pgno} outside 2..{last}")
    raw = os.pread(fd, psize, pgno * psize)
    if len(raw) != psize:
        raise Damaged(f"page {pgno} is {len(raw)} of {psize} bytes", "truncated")
    got, _, flags, lower, upper = PAGE_HDR.unpack_from(raw)
    if got != pgno or flags != want:
        raise Damaged(f"page {pgno} says it is page {got} with flags {flags:#x}")
    if not (HDR < lower <= upper <= psize) or lower % 2:
        raise Damaged(f"page {pgno} has bounds {lower}..{upper}")
    ptrs = struct.unpack_from(f"<{(lower - HDR) // 2}H", raw, HDR)
    if ptrs and (min(ptrs) < upper or max(ptrs) > psize - NODE_HDR):
        raise Damaged(f"page {pgno} has a node outside its free space")
    return raw, ptrs


class Walker:
    """Visits every branch, leaf and overflow page of the tree, counting them as it goes.

    Each page is visited at most once: a tree reaches every page by one path, so a page met
    twice (branch pages of a crafted file all naming one child) is damage, and the walk is
    bounded by the file's page count instead of the fan-out to the power of the depth."""

    def __init__(self, fd: int, psize: int, last_pgno: int):
        self.fd, self.psize, self.last = fd, psize, last_pgno
        self.seen = [0, 0, 0, 0]  # branch pages, leaf pages, overflow pages, entries
        self.visited: set[int] = set()

    def page(self, pgno: int, want: int) -> tuple[bytes, tuple[int, ...]]:
        if pgno in self.visited:
            raise Damaged(f"page {pgno} is reached twice (a tree reaches each page once)")
        self.visited.add(pgno)
        return read_page(self.fd, self.psize, self.last, pgno, want)

    def walk(self, pgno: int, level: int) -> None:
        raw, ptrs = self.page(pgno, P_LEAF if level == 1 else P_BRANCH)
        self.seen[0 if level > 1 else 1] += 1
        for ptr in ptrs:
            lo, hi, nflags, ksize = NODE.unpack_from(raw, ptr)
            end = ptr + NODE_HDR + ksize
            if level == 1:
                self.leaf_node(raw, pgno, end, lo | hi << 16, nflags)
            elif end > self.psize:
                raise Damaged(f"page {pgno} has a key running past the page")
            else:  # branch node: lo/hi/flags are the child's page number
                self.walk(lo | hi << 16 | nflags << 32, level - 1)

    def leaf_node(self, raw: bytes, pgno: int, end: int, dsize: int, nflags: int) -> None:
        self.seen[3] += 1
        if nflags not in (0, F_BIGDATA):
            raise Damaged(f"page {pgno} has node flags {nflags:#x}; shardkit writes none")
        if end + (8 if nflags else dsize) > self.psize:
            raise Damaged(f"page {pgno} has a value running past the page")
        if not nflags:
            return
        (opg,) = struct.unpack_from("<Q", raw, end)
        pages = (HDR - 1 + dsize) // self.psize + 1
        if not 2 <= opg <= self.last + 1 - pages:
            raise Damaged(f"page {pgno} points to overflow pages {opg}+{pages}")
        got, _, oflags, opages = struct.unpack("<QHHI", os.pread(self.fd, HDR, opg * self.psize))
        if got != opg or oflags != P_OVERFLOW or opages != pages:
            raise Damaged(f"overflow page {opg} does not match its {dsize}-byte value")
        self.seen[2] += pages


def check_structure(fd: int, size: int) -> tuple[int, int, int, tuple]:
    """Walk the main B-tree of the meta LMDB will pick; raise Damaged at the first unsafe field.

    Returns (txnid, last_pgno, psize, main DB record) so the caller can confirm LMDB chose the
    same meta page after opening.
    """
    txnid, last_pgno, psize, main = pick_meta(fd, size)
    _, _, depth, n_branch, n_leaf, n_over, entries, root = main
    walker = Walker(fd, psize, last_pgno)
    if depth == 0:
        if entries != 0 or root != 2**64 - 1:
            raise Damaged("empty tree with entries")
    elif depth > MAX_DEPTH:
        raise Damaged(f"tree depth {depth}")
    else:
        walker.walk(root, depth)
    seen = walker.seen
    if seen != [n_branch, n_leaf, n_over, entries]:
        raise Damaged(
            f"tree holds {seen[0]}/{seen[1]}/{seen[2]} branch/leaf/overflow pages and {seen[3]} "
            f"entries, the meta page says {n_branch}/{n_leaf}/{n_over} and {entries}"
        )
    return txnid, last_pgno, psize, main


def key_at(raw: bytes, ptr: int, psize: int) -> bytes:
    (ksize,) = struct.unpack_from("<H", raw, ptr + 6)
    if ptr + NODE_HDR + ksize > psize:
        raise Damaged(f"a key at offset {ptr} runs past the page")
    return raw[ptr + NODE_HDR : ptr + NODE_HDR + ksize]


def lower_bound(raw: bytes, ptrs: tuple[int, ...], key: bytes, psize: int) -> int:
    """The first node of a leaf page whose key is not below ``key``."""
    lo, hi = 0, len(ptrs)
    while lo < hi:
        mid = (lo + hi) // 2
        if key_at(raw, ptrs[mid], psize) < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def child(raw: bytes, ptr: int) -> int:
    """The page number a branch node points to (48 bits in its lo, hi and flags fields)."""
    lo, hi, flags, _ = NODE.unpack_from(raw, ptr)
    return lo | hi << 16 | flags << 32
