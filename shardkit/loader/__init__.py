"""ShardLoader: decoded batches from worker processes through a reused shared-memory ring.

The parts, in the order a batch travels: ``fill.py`` (a worker's loop: records -> decoded
pixels in a slot), ``workers.py`` (where that loop runs: worker processes, or the caller for
``num_workers=0``), ``messages.py`` (what crosses the pipe: slot numbers, labels, keys),
``ring.py`` (the slots' memory, shared and reused), ``epoch.py`` (the consumer: batch order,
device staging, when a slot may be reused) and ``shard_loader.py`` (the ``ShardLoader`` surface);
``stats.py`` says who waits for whom (``ShardLoader.stats()``, ``replay``), and
``device_feed.py`` decodes stored bytes on the GPU for ``decode_on="device"`` and ``"auto"``.
"""

from .shard_loader import ShardLoader, default_workers
from .stats import Replay, StatsOptions, gather_stats, replay, verdict_of

__all__ = [
    "Replay",
    "ShardLoader",
    "StatsOptions",
    "default_workers",
    "gather_stats",
    "replay",
    "verdict_of",
]
