"""What every process shares: the feature schema and featurising, input formats, the batch
types, typed configuration, errors, ``DLRM_*`` environment handling and logging.

It imports none of this project's other packages; ``embedding_server`` builds on it, and
``dense_trainer`` and ``api`` on both (``scripts/check_layout.py`` checks it).

Shape letters, defined here once for every package:
    B  examples in a batch (B_r: trainer r's share)
    I  dense features
    F  categorical (sparse) features; each reads one table, several may share a table
    D  embedding dim (D_f: of feature f's table; D': of tower outputs)
    N  ids in a batch (the sum of all bag lengths)
    P  pairs of the dot interaction: (F + 1) F / 2 with dense features, F (F - 1) / 2 without
    E  embedding servers;  T  trainers;  K  towers (C = sum of their c_t outputs)
"""
