"""Reading: packed shards to samples, one module per step of the flow.

``ShardDataset.__iter__`` (``dataset``) runs, in each DataLoader worker::

    sources:   "out/*.tar", a manifest or URLs -> the shard list (a ShardTable of columns;
               table[i] is shard i's ShardInfo: url, samples, bytes)
    indexes:   the shards' sample indexes (keys, byte ranges, split hashes), checked before use
    world:     this process's rank and worker
    shuffle:   shard_order(seed, epoch) -> the epoch's shard order, the same on every rank
    partition: the epoch's stream (EpochLayout; MixLayout drawn) cut into rank and worker parts
    planner:   worker_plan, the one planner of every epoch: this worker's part, fresh or
               continued after a checkpoint, as the slices it reads
    resume:    the checkpoint state: its format, the facts it must agree on, the live count
    stages:    read_slices -> check_labels -> (resumed: planner.arrange) -> shuffle_buffer
               -> resume.count_delivered -> decode_records -> apply_transforms
    ranges:    the exact byte ranges read_slices takes for the few samples a slice wants
    fields:    extra members (txt, json, seg.png ...) decoded by their extension
    storage:   where read_slices gets the shard bytes (local files; remote.RemoteStorage for URLs)

``selection`` turns what the user names (a path, a ``Source`` or a list of them) into one
``Selection``: a path and its one ``Source`` that narrows nothing are read alike, by the plain
epoch's plan; anything else is mixed. ``mix`` makes an epoch of several weighted ``Source``s,
subsets, splits or a fixed epoch size: one stream of positions (``partition.MixLayout``) the
same stages read, one reader and shuffle buffer per source; ``members`` holds the samples each
source may draw shard by shard (a split as its val bits). ``retired`` turns the keywords the
option objects replaced into them.
``view`` (``ShardView``) is random access by index or key, for evaluation and debugging, within
what ``lookup`` bounds (its indexes held, its key table on disk), and ``show`` what
``shardkit ls``/``show`` print over it.

``folder`` is the per-file baseline (``FolderDataset``) the benchmarks compare against. The
stages are plain generators, each testable alone on a list; they are exported here.
"""

from .partition import plan_epoch, rank_samples, sample_counts, worker_span
from .stages import (
    DECODE_MODES,
    EQUALIZE_MODES,
    ON_ERROR_MODES,
    apply_transforms,
    check_labels,
    decode_records,
    read_slices,
    sample_error,
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
