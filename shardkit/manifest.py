"""manifest.json: what a packed dataset holds, written last so its presence means "complete".

Readers use it for exact per-shard sample counts (exact ``len()`` and within-shard splitting
without opening a shard), the class list, and checksums. Plain JSON; FORMAT.md specifies it.
"""

from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import repeat
from typing import Any

from .errors import ManifestError
from .fsutil import atomic_write_bytes, interrupted_commit, interrupted_message, open_regular
from .records import ShardTable
from .urls import is_url, join_url, url_name, url_parent, url_path

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "Manifest",
    "INDEX_EVERY",
    "ShardEntry",
    "ShardEntries",
    "SkippedFile",
    "manifest_location",
    "portable_text",
    "read_manifest",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"shardkit {version('shardkit')}"
    except Exception:
        return "shardkit"


def portable_text(text: str) -> str:
    """``text`` as valid Unicode: a name that is not UTF-8 shows its bad bytes as ``\\xff``.

    ``os.fsdecode`` turns such bytes into lone surrogates, which no UTF-8 file (the manifest)
    can hold; a class folder ``b"caf\\xe9"`` is named ``caf\\xe9`` (Python's backslashreplace,
    as ``ls -b`` shows it), so the pack goes on and the name still says which folder it was.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # surrogates that no file name gave: show their code points
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def _portable(value: Any) -> Any:
    """A JSON document with every string made ``portable_text`` (keys included)."""
    if isinstance(value, str):
        return portable_text(value)
    if isinstance(value, dict):
        return {_portable(k): _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return value


#: Samples between two entries of a shard's sparse byte-offset index.
INDEX_EVERY = 64


#: manifest.json larger than this is refused before parsing: a million-shard manifest with offset
#: indexes is a few hundred MB; anything bigger is not ours.
MAX_MANIFEST_BYTES = 512 << 20
#: Counts and byte sizes above this are damage (2^53: still exact as a JSON number anywhere).
MAX_COUNT = 2**53


class _Bad(Exception):
    """What is wrong with a manifest field; ``Manifest.from_json`` adds the file name."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _count(value: Any, what: str) -> int:
    """A non-negative JSON integer (not a bool, float or string) within ``MAX_COUNT``."""
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise _Bad(f"{what} is {_short(value)}, expected an integer 0..{MAX_COUNT}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise _Bad(f"{what} is {_short(value)}, expected a string without NUL")
    return value


def _name(value: Any, what: str) -> str:
    """A file name inside the manifest's directory: no separators, no ``..``, no NUL."""
    name = _text(value, what)
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise _Bad(
            f"{what} {_short(name)} points outside the manifest's directory "
            "(a plain file name is expected)"
        )
    return name


def _list(doc: dict, key: str, *, required: bool = True) -> list:
    if key not in doc and not required:
        return []
    value = doc.get(key)
    if not isinstance(value, list):
        raise _Bad(f"{key!r} is {_short(value)}, expected a list")
    return value


@dataclass(frozen=True)
class ShardEntry:
    """One shard: ``path`` is relative to the manifest's directory (or URL prefix).

    ``index_sha256`` (plain tar, optional: older packs have none) is the sha256 of the shard's
    sample index ``path + ".idx"``, so the manifest's checksums cover the index as they cover
    the shard. That index holds every sample's byte offset, so a worker whose slice starts
    mid-shard seeks there (``formats.sample_index.sample_offset``), and the manifest lists no
    offsets of its own: opening a dataset costs O(shards) in every process, whatever the
    sample count.

    ``index`` (a tar shard without ``index_sha256`` only: packs made before the sample index)
    holds the byte offset of samples 0, ``INDEX_EVERY``, 2 x ``INDEX_EVERY`` ...: such a
    worker seeks there and hops over at most 63 samples. An older manifest that lists both
    keeps only ``index_sha256``: the offsets come from the index its sha256 checks, and are not
    held by every process.

    ``columns_sha256`` (optional) is the sha256 of the index's
    fixed-width columns (``sample_index.columns_of``: its head, offsets, key hashes and, from
    index version 3, sample digests):
    what a growth check reads of each old shard, vouched for without reading and hashing the
    whole index (its key table and members, ~5x the bytes). A tar shard's is used beside
    ``index_sha256`` only; an LMDB shard's (no ``index_sha256``: its index record is inside
    it) covers the record's head, split hashes and digests (``lmdb_columns_sha256``), so a
    split uses its stored hashes without hashing every key.
    """

    path: str
    samples: int
    bytes: int
    sha256: str
    index: tuple[int, ...] = ()
    index_sha256: str = ""
    columns_sha256: str = ""

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "path": self.path,
            "samples": self.samples,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }
        if self.index_sha256:  # its offsets are in the sample index this sha256 covers
            doc["index_sha256"] = self.index_sha256
        if self.columns_sha256:  # beside it, or an LMDB shard's index record's
            doc["columns_sha256"] = self.columns_sha256
        if not self.index_sha256 and self.index:
            doc["index_every"] = INDEX_EVERY
            doc["index"] = list(self.index)
        return doc

    @classmethod
    def from_dict(cls, s: Any) -> ShardEntry:
        """One ``shards`` item, every field type- and range-checked (raises ``_Bad``)."""
        if not isinstance(s, dict):
            raise _Bad(f"a shards item is {type(s).__name__}, not an object")
        path = _name(s.get("path"), "shard path")
        samples = _count(s.get("samples"), f"shard {path!r} samples")
        size = _count(s.get("bytes"), f"shard {path!r} bytes")
        sha = _sha(s.get("sha256"), f"shard {path!r}: sha256")
        if "index_sha256" in s:  # offsets listed beside it (older packs) are not used
            index_sha = _sha(s["index_sha256"], f"shard {path!r}: index_sha256")
            columns = ""
            if "columns_sha256" in s:
                columns = _sha(s["columns_sha256"], f"shard {path!r}: columns_sha256")
            return cls(path, samples, size, sha, (), index_sha, columns)
        columns = ""
        if "columns_sha256" in s:  # an LMDB shard's: its index record is inside it
            columns = _sha(s["columns_sha256"], f"shard {path!r}: columns_sha256")
        index: tuple[int, ...] = ()
        if "index" in s:
            if s.get("index_every") != INDEX_EVERY:
                raise _Bad(
                    f"shard {path!r}: index_every {s.get('index_every')!r} is not {INDEX_EVERY}"
                )
            raw = s["index"]
            if not isinstance(raw, list):
                raise _Bad(f"shard {path!r}: index is not a list")
            index = tuple(_count(x, f"shard {path!r} index entry") for x in raw)
        return cls(path, samples, size, sha, index, "", columns)


class ShardEntries(ShardTable):
    """manifest.json's ``shards`` as columns (``ShardTable``), each item a ``ShardEntry``.

    What ``read_manifest`` gives as ``Manifest.shards``: a 40,000-shard manifest is parsed into
    a few columns, not 40,000 objects, because every process that opens the dataset parses it;
    ``entries[i]`` makes shard ``i``'s ``ShardEntry`` when asked. ``names`` are the entries'
    ``path``. Writers may still give ``Manifest`` a plain list of ``ShardEntry``; an item may be
    replaced (``entries[i] = entry``), which copies the columns it changes.
    """

    __slots__ = ()

    @staticmethod
    def _name(row: ShardEntry) -> str:  # type: ignore[override]
        return row.path  # an entry's name is its path in the folder, not a URL

    def _row(self, i: int) -> ShardEntry:  # type: ignore[override]
        return ShardEntry(
            self.names[i],
            int(self.samples[i]),
            int(self.bytes[i]),
            self.sha256[i],
            self.index.get(i, ()),
            self.index_sha256[i],
            self.columns_sha256[i],
        )

    def __setitem__(self, i: int, entry: ShardEntry) -> None:
        i = range(len(self))[i]
        samples, size = self.samples.copy(), self.bytes.copy()
        samples[i], size[i] = entry.samples, entry.bytes
        samples.flags.writeable = size.flags.writeable = False
        self.samples, self.bytes = samples, size
        self.names = [*self.names[:i], entry.path, *self.names[i + 1 :]]
        self.sha256 = [*self.sha256[:i], entry.sha256, *self.sha256[i + 1 :]]
        isha = self.index_sha256
        self.index_sha256 = [*isha[:i], entry.index_sha256, *isha[i + 1 :]]
        csha = self.columns_sha256
        self.columns_sha256 = [*csha[:i], entry.columns_sha256, *csha[i + 1 :]]
        self.index = {k: v for k, v in self.index.items() if k != i}
        if entry.index:
            self.index[i] = tuple(entry.index)


def shard_entries(shards: Sequence[ShardEntry]) -> ShardEntries:
    """A manifest's shards as columns, whether it was parsed (a table) or built (a list)."""
    return ShardEntries.of(shards)


_SHA = re.compile("[0-9a-f]{64}")
_HEX = b"0123456789abcdef"
_COLUMNS = tuple(map(operator.itemgetter, ("path", "samples", "bytes", "sha256")))


def _entries(items: list) -> ShardEntries:
    plain = _plain_entries(items)
    return ShardEntries.of(map(ShardEntry.from_dict, items)) if plain is None else plain


def _plain_entries(items: list) -> ShardEntries | None:
    """``items`` checked column by column, in C loops, not a dozen calls a shard: the shape
    every writer gives (``path``, ``samples``, ``bytes``, ``sha256``, and ``index_sha256`` with
    or without ``columns_sha256``, or neither; or both ``index_sha256`` and the offsets,
    ``index_every``/``index``, that the manifest then ignores), which a 40,000-shard dataset
    opens in every process. None where any item is not of that shape or fails a check:
    ``ShardEntry.from_dict`` then checks each and names the problem (the same checks, so the
    same manifests pass). The columns become the table as they are: no object a shard."""
    if not items:
        return ShardEntries([], (), ())
    if set(map(type, items)) != {dict}:
        return None
    lengths = list(map(len, items))
    if not set(lengths) <= {4, 5, 6, 7, 8}:
        return None
    try:
        paths, counts, sizes, shas = (list(map(column, items)) for column in _COLUMNS)
    except KeyError:
        return None
    index_shas = list(map(dict.get, items, repeat("index_sha256"), repeat("")))
    column_shas = list(map(dict.get, items, repeat("columns_sha256"), repeat("")))
    listed = [x for x in index_shas if x != ""]
    more = [x for x in column_shas if x != ""]
    # Every item has at least the keys counted here, so equal sums mean no item has another.
    extra = sum(lengths) - 4 * len(items) - len(listed) - len(more)
    if extra:  # an older pack's offsets beside its index_sha256: not used, as in from_dict
        offsets = [("index" in s and "index_every" in s) for s in items]
        alone = any(o and not i for o, i in zip(offsets, index_shas, strict=True))
        if extra != 2 * sum(offsets) or alone:
            return None  # any other keys, or offsets alone: checked item by item
    listed += more
    if set(map(type, paths)) | set(map(type, shas)) | set(map(type, listed)) != {str}:
        return None
    if set(map(type, counts)) | set(map(type, sizes)) != {int}:
        return None
    if min(min(counts), min(sizes)) < 0 or max(max(counts), max(sizes)) > MAX_COUNT:
        return None
    if not _plain_text(paths, shas, listed):
        return None
    return ShardEntries(paths, counts, sizes, shas, index_shas, columns_sha256=column_shas)


def _plain_text(paths: list, shas: list, listed: list) -> bool:
    """Whether every path is a plain name and every sha256 64 lowercase hex digits."""
    names = "\0".join(paths)
    if "/" in names or "\\" in names or names.count("\0") != len(paths) - 1:
        return False
    if not {"", ".", ".."}.isdisjoint(paths):
        return False
    if set(map(len, shas)) | set(map(len, listed)) != {64}:
        return False
    return _hex_digits(shas) and _hex_digits(listed)


def _hex_digits(texts: list[str]) -> bool:
    """Whether ``texts`` hold nothing but lowercase hex digits (one C pass, no regex)."""
    return not "".join(texts).encode().translate(None, _HEX)


def _sha(value: Any, what: str) -> str:
    if type(value) is not str or _SHA.fullmatch(value) is None:
        raise _Bad(f"{what} {_short(value)} is not 64 hex digits")
    return value


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str

    @classmethod
    def from_dict(cls, item: Any) -> SkippedFile:
        if not isinstance(item, dict):
            raise _Bad("a skipped item is not an object")
        return cls(_text(item.get("path"), "skipped path"), _text(item.get("reason"), "reason"))


@dataclass
class Manifest:
    shard_format: str
    classes: list[str]
    #: The shards in order: a ``ShardEntries`` table when read, any list of ``ShardEntry``
    #: when built by a writer.
    shards: Sequence[ShardEntry]
    skipped: list[SkippedFile] = field(default_factory=list)
    pack: dict[str, Any] = field(default_factory=dict)
    #: Extra fields stored beside the images: name -> samples carrying it (``{}``: none; then
    #: the manifest has no ``fields`` key, as before fields existed).
    fields: dict[str, int] = field(default_factory=dict)
    version: int = MANIFEST_VERSION
    created_by: str = field(default_factory=_version)
    #: The dataset's key file (``write.keyfile``): ``{"path", "sha256", "bytes"}``, what vouches
    #: for it, and ``runs``, a list of those for its growth runs where it has any; ``{}``:
    #: none (older packs, ``shardkit index``), and the manifest has no ``keys``.
    keys: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        if isinstance(self.shards, ShardTable):
            return sum(self.shards.samples.tolist())  # exact: no int64 wrap
        return sum(s.samples for s in self.shards)

    @property
    def total_bytes(self) -> int:
        if isinstance(self.shards, ShardTable):
            return sum(self.shards.bytes.tolist())
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> str:
        doc = {
            "version": self.version,
            "created_by": self.created_by,
            "shard_format": self.shard_format,
            "num_samples": self.num_samples,
            "total_bytes": self.total_bytes,
            "classes": self.classes,
            **({"fields": dict(sorted(self.fields.items()))} if self.fields else {}),
            "shards": [s.to_dict() for s in self.shards],
            "skipped": [asdict(s) for s in self.skipped],
            "pack": self.pack,
            **({"keys": dict(self.keys)} if self.keys else {}),
        }
        text = json.dumps(doc, indent=1, ensure_ascii=False)
        try:  # every string valid UTF-8 already (the usual case): portable as it stands
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(_portable(doc), indent=1, ensure_ascii=False)
        return text + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest.json") -> Manifest:
        """Parse and validate; any malformed manifest is a ``ManifestError`` naming ``source``.

        Every value is type- and range-checked here, so nothing downstream meets a float count,
        a string where a list belongs, a NUL or a path leaving the directory.
        """
        if len(text) > MAX_MANIFEST_BYTES:
            raise _too_large(source, f"{len(text)} bytes")
        try:
            doc = json.loads(_decoded(text, source))
        except (ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ManifestError(
                f"{source}: not valid JSON ({reason}); re-pack or restore it"
            ) from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: expected a JSON object at the top level")
        version = doc.get("version")
        if type(version) is not int or version != MANIFEST_VERSION:
            raise ManifestError(
                f"{source}: manifest version {_short(version)} is not supported (this shardkit "
                f"reads version {MANIFEST_VERSION}); upgrade shardkit or re-pack"
            )
        try:
            shards = _entries(_list(doc, "shards"))
            skipped = [
                SkippedFile.from_dict(item) for item in _list(doc, "skipped", required=False)
            ]
            pack = doc.get("pack", {})
            if not isinstance(pack, dict):
                raise _Bad(f"'pack' is {_short(pack)}, expected an object")
            shard_format = _text(doc.get("shard_format"), "shard_format")
            fields = _fields(doc)
            manifest = cls(
                shard_format=shard_format,
                classes=[_text(c, "class name") for c in _list(doc, "classes")],
                shards=shards,
                skipped=skipped,
                pack=pack,
                fields=fields,
                version=version,
                created_by=_text(doc.get("created_by", ""), "created_by"),
                keys=_keys(doc),
            )
            if "num_samples" in doc:
                _count(doc["num_samples"], "num_samples")
        except _Bad as exc:
            raise ManifestError(f"{source}: missing or malformed field: {exc}; re-pack") from None
        if "num_samples" in doc and doc["num_samples"] != manifest.num_samples:
            raise ManifestError(
                f"{source}: num_samples {doc['num_samples']} disagrees with the shard counts "
                f"({manifest.num_samples}); the manifest was edited or damaged, re-pack"
            )
        names = shards.names
        if len(set(names)) != len(names):
            raise ManifestError(f"{source}: lists a shard twice; the manifest is damaged, re-pack")
        for s in map(shards.__getitem__, shards.index):  # an older pack's offsets, if any
            if s.index and (
                len(s.index) != (s.samples + INDEX_EVERY - 1) // INDEX_EVERY
                or any(b <= a for a, b in zip(s.index, s.index[1:], strict=False))
                or s.index[-1] >= s.bytes
            ):
                raise ManifestError(
                    f"{source}: the offset index of shard {s.path!r} does not fit its "
                    f"{s.samples} samples and {s.bytes} bytes; re-pack"
                )
        return manifest


def _decoded(text: str | bytes, source: str) -> str:
    """The manifest's text, as ``json.loads`` would decode its bytes (UTF-8, -16 or -32)."""
    if isinstance(text, str):
        return text
    try:
        return text.decode(json.detect_encoding(text), "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc}); re-pack or restore it") from None


def _fields(doc: dict) -> dict[str, int]:
    """The optional ``fields`` object: field name -> samples carrying it."""
    fields = doc.get("fields", {})
    if not isinstance(fields, dict):
        raise _Bad(f"'fields' is {_short(fields)}, expected an object")
    return {_text(k, "field name"): _count(v, f"field {k!r} count") for k, v in fields.items()}


def _keys(doc: dict) -> dict[str, Any]:
    """The optional ``keys`` object: the key file's name, sha256 and size, and its growth
    runs' (``runs``)."""
    if "keys" not in doc:
        return {}
    keys = doc["keys"]
    if not isinstance(keys, dict):
        raise _Bad(f"'keys' is {_short(keys)}, expected an object")
    out = {
        "path": _name(keys.get("path"), "key file"),
        "sha256": _sha(keys.get("sha256"), "key file sha256"),
        "bytes": _count(keys.get("bytes"), "key file bytes"),
        **_blocks(keys, "key file"),
    }
    if "runs" in keys:  # the growth runs after the base file, oldest first
        runs = keys["runs"]
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise _Bad(f"'keys.runs' is {_short(runs)}, expected a list of objects")
        out["runs"] = [
            {
                "path": _name(r.get("path"), "key file run"),
                "sha256": _sha(r.get("sha256"), "key file run sha256"),
                "bytes": _count(r.get("bytes"), "key file run bytes"),
                **_blocks(r, "key file run"),
            }
            for r in runs
        ]
    return out


def _blocks(run: dict, what: str) -> dict[str, Any]:
    """A run's ``blocks_sha256`` (its block table's), where it has one: runs written before
    the table have none (and no table); and its ``counts`` (its count table's ``k``,
    ``bytes`` and ``sha256``), where it has one: runs written before it, or too small for
    one, have none."""
    out: dict[str, Any] = {}
    if "blocks_sha256" in run:
        out["blocks_sha256"] = _sha(run["blocks_sha256"], f"{what} blocks_sha256")
    if "counts" in run:
        got = run["counts"]
        if not isinstance(got, dict):
            raise _Bad(f"'{what} counts' is {_short(got)}, expected an object")
        k = _count(got.get("k"), f"{what} counts k")
        if not 1 <= k <= 32:
            raise _Bad(f"'{what} counts k' is {k}, expected 1 to 32")
        out["counts"] = {
            "k": k,
            "bytes": _count(got.get("bytes"), f"{what} counts bytes"),
            "sha256": _sha(got.get("sha256"), f"{what} counts sha256"),
        }
    return out


def _too_large(source: str, size: str) -> ManifestError:
    return ManifestError(
        f"{source}: {size}, more than any manifest shardkit writes ({MAX_MANIFEST_BYTES}); "
        "not a shardkit manifest, re-pack"
    )


def write_manifest(manifest: Manifest, out_dir: str) -> str:
    """Write ``out_dir/manifest.json`` atomically; callers write it after every shard is final."""
    path = os.path.join(out_dir, MANIFEST_NAME)
    atomic_write_bytes(path, manifest.to_json().encode())
    return path


def manifest_location(where: str | os.PathLike) -> str:
    """The manifest's own path or URL, given it, its dataset directory or its URL prefix."""
    where = os.fspath(where)
    if is_url(where):
        return where if url_name(where) == MANIFEST_NAME else join_url(where, MANIFEST_NAME)
    return os.path.join(where, MANIFEST_NAME) if os.path.isdir(where) else where


def read_manifest(
    where: str | os.PathLike,
    *,
    storage_options: dict | None = None,
    policy=None,
    missing_ok: bool = False,
) -> Manifest:
    """The one manifest reader: ``where`` is a manifest, its directory, or a URL of either.

    Fetching bytes is the only part that differs by location (a local read, or
    ``shardkit.remote.read_bytes`` with retries for URLs; ``storage_options`` and the retry
    ``policy`` go there); parsing and validation are ``Manifest.from_json`` for every caller.
    ``missing_ok``: a URL with no object there is None (its bucket there), so a reader that
    must tell "no manifest" from "a manifest" makes one GET, not an existence check first
    (on HTTP a GET of the whole manifest) and then the GET.
    """
    path = manifest_location(where)
    if is_url(path):
        from .remote.fetch import MissingObjectError, TooLargeError, read_bytes

        try:
            text = read_bytes(path, storage_options, policy=policy, max_size=MAX_MANIFEST_BYTES)
        except MissingObjectError:
            from .remote.fetch import check_bucket

            check_bucket(path, storage_options)  # a missing bucket is named as such
            if missing_ok:
                return None
            prefix = url_path(url_parent(path)) + "/"
            raise ManifestError(
                f"{path}: no manifest; pack into this prefix with `shardkit pack SRC {prefix}`"
            ) from None
        except TooLargeError:  # refused while it arrives, before it fills memory
            raise _too_large(path, f"over {MAX_MANIFEST_BYTES} bytes") from None
        return Manifest.from_json(text, source=path)
    try:
        with open_regular(path) as f:  # a FIFO named manifest.json: refused, not waited on
            # Bounded (from_json refuses anything longer), and by the file's size: a read of
            # the cap allocates the cap (512 MiB) whatever the file holds.
            size = os.fstat(f.fileno()).st_size
            text = f.read(min(size, MAX_MANIFEST_BYTES) + 1)
        if len(text) <= MAX_MANIFEST_BYTES:  # decoded here, so the bytes are gone before the
            text = _decoded(text, path)  # parse: a third less peak memory at 40,000 shards
    except FileNotFoundError:
        if interrupted_commit(os.path.dirname(path)):
            raise ManifestError(interrupted_message(os.path.dirname(path))) from None
        raise ManifestError(f"{path}: no manifest; pack the folder with `shardkit pack`") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror})") from None
    return Manifest.from_json(text, source=path)
