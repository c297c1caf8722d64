"""``TarFormat``: tar shards as a ``ShardFormat``, read front to back from ``storage.open()``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ...manifest import INDEX_EVERY
from ...records import Record, ShardInfo
from ...urls import is_url
from ..base import ShardFormat
from ..sample_index import (
    ShardDigests,
    ShardSides,
    remember_checked,
    sample_offset,
    sides_checked,
    was_checked,
)
from .reader import iter_tar_records
from .tally import count_tar_samples
from .writer import TarShardWriter, TarSizer


class TarFormat(ShardFormat):
    name = "tar"
    suffix = ".tar"
    also = (".tar.gz", ".tgz")

    def open_writer(self, path: str) -> TarShardWriter:
        return TarShardWriter(path)

    def sizer(self) -> TarSizer:
        return TarSizer()

    def iter_records(
        self,
        source: Any,
        *,
        shard: str = "",
        start: int = 0,
        stop: int | None = None,
        index: Sequence[int] = (),
        fields: Sequence[str] = (),
    ) -> Iterator[Record]:
        return iter_tar_records(
            source, shard=shard, start=start, stop=stop, index=index, fields=fields
        )

    def records(
        self,
        storage: Any,
        shard: ShardInfo,
        start: int = 0,
        stop: int | None = None,
        fields: Sequence[str] = (),
        sides: ShardSides | None = None,
        digests: ShardDigests | None = None,
    ) -> Iterator[Record]:
        at = _seek_point(shard, start)
        with storage.open(shard) as stream:  # a generator: opened on the first sample asked
            seen = None
            if sides is not None and not is_url(shard.url):
                # a split's slice of a local file checked once a process (``sides_checked``)
                last = shard.samples if stop is None else stop
                seen = sides_checked(stream, start, last, sides, at)
                if was_checked(seen):
                    sides = seen = None
            yield from iter_tar_records(
                stream,
                shard=shard.url,
                start=start,
                stop=stop,
                index=shard.index,
                fields=fields,
                at=at,
                sides=sides,
                digests=digests,
            )
            remember_checked(seen)  # every sample of the slice read, each key on its side

    def count(self, storage: Any, shard: ShardInfo) -> int:
        with storage.open(shard) as stream:
            return count_tar_samples(stream, shard=shard.url)


def _seek_point(shard: ShardInfo, start: int) -> int | None:
    """Where sample ``start`` of ``shard`` begins, from its sample index (checked against the
    manifest's ``index_sha256``), for a slice that starts past the first ``INDEX_EVERY``
    samples of a local plain tar whose manifest lists no offsets of its own; None: seek by the
    manifest's ``index`` (older packs), or read from the start. A remote shard is read whole
    into memory (or the cache) before its first sample, so hopping there costs no transfer."""
    if start < INDEX_EVERY or shard.index or not shard.index_sha256:
        return None
    url = shard.url.removeprefix("file://")
    if not url.endswith(".tar") or is_url(url):
        return None
    return sample_offset(url, start, shard.samples, shard.bytes, shard.sha256, shard.index_sha256)
