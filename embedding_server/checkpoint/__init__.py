"""Checkpoints of the sparse side: what a training run saves of its tables, and how it reads them
back in any other sharding.

    files.py      checkpoint files: atomic, checksummed directories (``step-<N>/`` and its
                  manifest), loaded without executing pickled code
    tables.py     CheckpointTables: a shard's tables written piece by piece (rows, optimizer
                  state, id maps), read back onto any split by rows, columns or tables
    snapshot.py   a consistent cut of the rows a shard holds at a step (TouchedRows, CutRequest)
    writer.py     the background writer: snapshots written off the training thread
    finalizer.py  the master's side: wait for every writer's record, then make the step current
    server.py     an embedding server's checkpoints: snapshot between steps, write in the background

May import: ``idmap``, ``kernels``, ``local_table``, ``sharding``, ``wire`` (layers:
``scripts/check_layout.py``).
"""
