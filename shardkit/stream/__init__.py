"""Reading: packed shards to samples, one module per step of the flow.

``ShardDataset.__iter__`` (``dataset``) runs, in each DataLoader worker::

    sources:  "out/*.tar", a manifest or URLs -> the shard list (ShardInfo: url, samples, bytes)
    world:    this process's rank and worker
    shuffle:  shard_order(seed, epoch) -> the epoch's shard order, the same on every rank
    resume:   worker_plan -> this worker's slices (stages.plan_epoch), continued after a checkpoint
    stages:   read_slices -> check_labels -> (resumed: resume.arrange) -> shuffle.shuffle_buffer
              -> resume.count_delivered -> decode_records -> apply_transforms
    storage:  where read_slices gets the shard bytes (local files; remote.RemoteStorage for URLs)

``mix`` makes an epoch of several weighted ``Source``s, subsets, splits or a fixed epoch size:
one stream of positions the same stages read, one reader and shuffle buffer per source.
``view`` (``ShardView``) is random access by index or key, for evaluation and debugging, and
``show`` what ``shardkit ls``/``show`` print over it.

``folder`` is the per-file baseline (``FolderDataset``) the benchmarks compare against. The
stages are plain generators, each testable alone on a list; they are exported here.
"""

from .stages import (
    DECODE_MODES,
    EQUALIZE_MODES,
    ON_ERROR_MODES,
    apply_transforms,
    check_labels,
    decode_records,
    plan_epoch,
    rank_samples,
    read_slices,
    sample_counts,
    sample_error,
    worker_span,
)

__all__ = [
    "DECODE_MODES",
    "EQUALIZE_MODES",
    "ON_ERROR_MODES",
    "apply_transforms",
    "check_labels",
    "decode_records",
    "plan_epoch",
    "rank_samples",
    "read_slices",
    "sample_counts",
    "sample_error",
    "worker_span",
]
