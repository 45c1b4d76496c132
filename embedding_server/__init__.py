"""Parameter-node side of the system: table specs and hashing, embedding shards with fused
optimizers, the trainer-side embedding client, checkpoints and (later) serving stores.

This package imports neither ``dense_trainer`` nor ``api``: both of those import it.

Shape letters used throughout the package:
    B  batch size (examples)
    F  sparse features (one table each)
    D  embedding dim of a table (D_t when tables differ)
    N  number of ids in a batch (sum of all bag lengths)
"""

__version__ = "0.1.0"
