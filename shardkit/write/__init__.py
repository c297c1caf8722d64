"""Writing: an image folder (or your own samples) into shards and a manifest, and checking them.

- ``packer``: ``pack()``, the folder -> shards command (scan, check, optional resize, write).
- ``options``: ``PackOptions``, how ``pack`` packs, handed whole to the planner and writers.
- ``plan``: a folder pack's plan (every shard's samples and name, before any image is read), its
  types (``ShardTask``, ``ShardReceipt``, ``PackPlan``).
- ``planfile``: the plan files of ``--plan-only`` that ``pack-task`` runs (arrays, checksummed).
- ``task``: ``run_task``, one task of the plan written into the job folder, a receipt per shard.
- ``commit``: ``commit_pack``, the receipts checked and published with the manifest, manifest
  last; the cluster-lock check of engines across machines.
- ``engines``: runners that run the tasks (``LocalRunner``, a process pool).
- ``read``: a source's files read, checked and resized on threads; the pack's fingerprint.
- ``samples``: your own (image, label) samples into ``ShardWriter`` records.
- ``writer``: ``ShardWriter``, size-capped shards and the manifest, committed all or nothing.
- ``keys``: the keys a dataset holds, which ``--append`` and ``merge`` must not add again.
- ``keyfile``: the dataset's key file (``manifest.keys``), what growth reads instead of every
  shard's index.
- ``merge``: ``shardkit merge``, datasets joined without rewriting their shards.
- ``index``: a manifest for shards written by another tool.
- ``verify``: ``verify()``/``dataset_info()``, a dataset checked against its manifest.

The shard formats themselves (bytes on disk) are in ``shardkit.formats``; the listing of a
source folder in ``shardkit.scan``, which ``FolderDataset`` reads too.
"""
