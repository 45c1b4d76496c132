"""The next training lookup's ids remapped while the current step computes (one process).

Only where that overlaps anything (:func:`overlaps`: a GPU dense step, or a core the dense step
leaves free); otherwise the lookup remaps its own ids, on every core.

Embedding servers overlap a step's id-map work with the trainers' dense step by pipelining
(``dist.pipeline``); a single process gets the same overlap here. When the trainer prefetches
the next batch, a worker thread runs the maps' training remap of its ids while the current
batch's dense forward, backward and table update run. It is exact, step for step the same as
remapping when the lookup comes:

    - the maps' decisions (which ids are admitted, which rows evicted, what every counter holds)
      depend on the maps alone, which nothing but a training remap changes, and remaps run in
      order (the trainer prefetches only the batch it looks up next, one at a time);
    - the rows given to new ids are reset (fresh weights, or a copy of their shared row, and new
      optimizer state) only when the lookup comes, after the current step's update, as a remap
      then would have: the reset calls are deferred (``ShardIdMaps.deferred``), not their inputs.

The trainer never prefetches across a checkpoint, an evaluation, an epoch's end or a stop, so
the maps are never read for state while a remap runs ahead; live updates in one process read
the maps between steps, so the trainer does not prefetch while they run.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.threads import LazyPool
from embedding_server.idmap.remap import ShardIdMaps

WAIT_S = 600.0
"""The longest a lookup waits for its remap (local compute: seconds at most; a bound, not a
timing)."""
_worker = LazyPool(1, "remap-ahead", torch.set_num_threads, (1,))
"""The process's one remap thread (intra-op threads: one; started on first use)."""


def overlaps(dense_device: torch.device) -> bool:
    """Whether a remap ahead runs beside the dense step rather than on its cores: the step runs
    on a GPU, or its intra-op threads leave a core free. Where the dense step takes every core
    the remap thread only preempts the step's threads, which then wait for each other: in
    bench/dynamic_ids.py's one-process regime (2 cores, 2 threads) a step took 96.7 ms with the
    remap ahead against 90.9 ms with the remap in the lookup (hashed: 75.8 ms)."""
    return dense_device.type != "cpu" or torch.get_num_threads() < len(os.sched_getaffinity(0))


class RemapAhead:
    """One batch's training remap, started now in the worker thread.

    Args:
        maps: the shard's id maps.
        sparse: the next training lookup's ids (the very object the lookup will pass).
    """

    def __init__(self, maps: ShardIdMaps, sparse: SparseFeatures) -> None:
        self.maps, self.sparse = maps, sparse
        self.future: Future = _worker.get().submit(maps.remap_deferring_resets, sparse)

    def wait(self) -> None:
        """Until the remap is done (its resets still pending)."""
        self._result()

    def take(self, sparse: SparseFeatures) -> SparseFeatures:
        """The remapped ids of ``sparse`` (the prefetched batch), its fresh rows reset now.

        Raises:
            RuntimeError: ``sparse`` is not the batch prefetched.
        """
        if sparse is not self.sparse:
            raise RuntimeError("a training lookup of another batch than the one remapped ahead")
        remapped, resets = self._result()
        for reset, args in resets:  # in the order the remap made them
            reset(*args)
        return remapped

    def _result(self):
        try:
            return self.future.result(timeout=WAIT_S)
        except FutureTimeout:
            raise TimeoutError(
                f"the id maps' remap of the next batch took over {WAIT_S:.0f}s"
            ) from None
