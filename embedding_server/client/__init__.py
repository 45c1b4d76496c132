"""What a trainer uses to reach its embedding tables: one interface, two implementations.

    base.py         EmbeddingClient: the complete interface (lookup, backward, prefetch,
                    checkpoint, publish hooks) every trainer codes against
    local.py        InProcessEmbeddingClient: every table in one shard inside the trainer
    distributed.py  the distributed client: routing to servers, id messages, pooled vectors and
                    gradients, prefetching (pipelining), towers

May import every other part of ``embedding_server`` but ``publish`` and ``cli`` (layers:
``scripts/check_layout.py``).
"""
