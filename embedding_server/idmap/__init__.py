"""Dynamic ids: raw 64-bit ids -> rows of a table of fixed capacity, on the parameter node.

A ``dynamic`` table (``embedding.ids = "dynamic"``) receives raw ids from the featuriser (no
modulo) and its shard maps them to rows before the fused kernel runs:

    hash_table.py   IdHashTable: vectorised open addressing, id -> row (find / insert / delete)
    sketch.py       CountMinSketch: bounded occurrence counts, for admission
    dynamic.py      DynamicIdMap: one table's map: admission (admit_after), eviction (lru / lfu /
                    ttl), the hashed shared rows, counters; fixed-size tensors throughout
    remap.py        ShardIdMaps: a shard's maps applied to a lookup's ids, fresh rows for new ids
    batched.py      MapGroup: admission and eviction of a group of a shard's maps in one set of
                    tensor ops (the same decisions as one DynamicIdMap per table)
    native.py       the hash-table probes and inserts and the eviction choices in C (idhash.c,
                    called through ctypes; the torch code where it is off)
    native_build.py idhash.c compiled on first use, cached by the source's hash
    pieces.py       PieceLayout: a table split by rows over servers, its ids routed by hash
    reshard.py      a checkpoint restored onto another split: ids moved with their rows

Hashed tables never come here: their rows are ``id % rows`` from the featuriser, as always.
"""

from embedding_server.idmap.dynamic import DynamicIdMap
from embedding_server.idmap.remap import ShardIdMaps

__all__ = ["DynamicIdMap", "ShardIdMaps"]
