"""The parameter node: embedding shards with fused optimizers, the trainer-side clients, the
planner and sharding schemes, the server loop and its wire format, table checkpoints, towers,
publishing and the serving stores.

It imports ``dlrm_core`` only (shape letters: ``dlrm_core/__init__.py``).
"""

__version__ = "0.1.0"
