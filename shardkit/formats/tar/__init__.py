"""Tar shards in the WebDataset convention: writer and readers, one module per concern.

Why our own code instead of ``tarfile``: the writer must be byte-reproducible (fixed headers, no
PAX records) and the reader must stream at disk speed; ``tarfile`` builds a ``TarInfo`` object and
a member list per entry, which costs more than the I/O for 10-100 KB images. The layout is
specified in FORMAT.md; any ustar/GNU reader (``tarfile``, GNU tar, WebDataset) reads our shards.

- ``writer``: ``TarShardWriter`` (headers built, never parsed);
- ``parse``: what every reader shares: the window over the stream, header fields, member names
  and kinds, gzip, and the errors that name the shard;
- ``reader``: ``iter_tar_records``, the one hot streaming loop;
- ``tally``: counting and indexing by headers only (``count_tar_samples``, ``tally_tar``);
- ``format``: ``TarFormat``, the ``ShardFormat`` that reads a shard as a stream.
"""

from .format import TarFormat
from .parse import IMAGE_EXTS, LABEL_EXTS, is_gzip_name, split_member_name
from .reader import iter_tar_records
from .tally import TarTally, count_tar_samples, tally_tar, warn_imageless
from .writer import TarShardWriter

__all__ = [
    "IMAGE_EXTS",
    "LABEL_EXTS",
    "TarFormat",
    "TarShardWriter",
    "TarTally",
    "count_tar_samples",
    "is_gzip_name",
    "iter_tar_records",
    "split_member_name",
    "tally_tar",
    "warn_imageless",
]
