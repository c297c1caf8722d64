"""Writing: an image folder (or your own samples) into shards and a manifest, and checking them.

- ``packer``: ``pack()`` and its ``PackOptions``, the folder -> shards command (scan, check,
  optional resize, write).
- ``samples``: your own (image, label) samples into ``ShardWriter`` records.
- ``writer``: ``ShardWriter``, size-capped shards and the manifest, committed all or nothing.
- ``index``: a manifest for shards written by another tool.
- ``verify``: ``verify()``/``dataset_info()``, a dataset checked against its manifest.

The shard formats themselves (bytes on disk) are in ``shardkit.formats``; the listing of a
source folder in ``shardkit.scan``, which ``FolderDataset`` reads too.
"""
