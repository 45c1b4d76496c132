"""The parameter node at run time: the server loop and everything that carries its messages.

    server.py      the embedding server's loop: commands, chunked lookups and updates, exact /
                   semi-sync pipelining, live pushes, checkpoints
    pipelining.py  the pipeline modes (off, exact, semi-sync), a class each, chosen once from
                   ``dist.pipeline``: what the trainer prefetches, when the server applies updates
    transport.py   trainer/server messages (point to point by default; world all-to-alls for the
                   hierarchical route)
    exchange.py    the flat or hierarchical all-to-all
    cluster.py     the torch.distributed world: roles, groups, timeouts
    topology.py    hosts and which ranks share one
    watchdog.py    liveness of the ranks: heartbeats and bounds on long waits, so a peer that
                   hangs without dying is named, never waited on forever
    correction.py  corrected early lookups (``pipeline = exact``): batch i+1 looked up before step
                   i's update, corrected with the rows that update changed

The message format itself is ``embedding_server/wire.py``, shared with the serving stores.
May import: ``checkpoint``, ``config``, ``idmap``, ``kernels``, ``local_table``, ``planner``,
``shard``, ``sharding``, ``stores``, ``wire`` (layers: ``scripts/check_layout.py``).
"""
