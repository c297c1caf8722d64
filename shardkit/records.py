"""The typed records that flow between the shard readers, the streaming stages and the packer."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Record", "ShardInfo", "ShardSlice", "ShardStats", "UNKNOWN"]

#: A sample count or size that no manifest gives (e.g. tars written by other tools).
UNKNOWN = -1


@dataclass(slots=True)
class Record:
    """One stored sample as read from a shard, before decoding.

    Not frozen on purpose: a frozen dataclass builds through ``object.__setattr__`` (about 4x
    slower), and one Record is built per sample on the hottest path.

    ``ext`` is the image member's extension (``jpg``, ``png`` ...), so decoders and ``decode="raw"``
    users know what the bytes are. ``label`` is -1 when the shard stores none.
    """

    key: str
    ext: str
    data: bytes
    label: int
    shard: str = ""
    #: Extra members asked for by extension (``{"json": b"..."}``), raw; None when none were.
    fields: dict[str, bytes] | None = None
    #: Which source of a mixture it came from (its position in the list; 0 without a mixture).
    source: int = 0


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard of a dataset, as known before it is opened: the record that travels from source
    resolution through planning and reading to the storage that fetches it.

    ``samples`` and ``bytes`` are ``UNKNOWN`` and ``sha256`` empty when no manifest describes the
    shard (the dataset counts its samples; remote storage then cannot verify it). ``index`` is an
    older manifest's sparse byte-offset index (tar without ``index_sha256``), so a reader
    starting mid-shard can seek; a shard with ``index_sha256`` seeks through its sample index.
    """

    url: str
    samples: int = UNKNOWN
    bytes: int = UNKNOWN
    sha256: str = ""
    index: tuple[int, ...] = ()
    #: The sha256 of the shard's sample index file, where the manifest gives it.
    index_sha256: str = ""


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """Samples ``[start, stop)`` of shard number ``shard`` in the dataset's shard list.

    The unit of work handed to one DataLoader worker: splitting by slices rather than whole shards
    is what keeps every worker busy when there are fewer shards than ranks x workers.
    """

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class ShardStats:
    """What a writer reports when a shard is complete: the manifest's per-shard facts."""

    path: str
    samples: int
    bytes: int
    sha256: str
    #: Byte offset of every ``INDEX_EVERY``-th sample (0, 64, 128, ...); empty where the format
    #: needs none (LMDB seeks by key). Lets a reader start mid-shard without reading the prefix.
    index: tuple[int, ...] = ()
    #: The sha256 of the sample index written beside the shard ("": none written).
    index_sha256: str = ""
