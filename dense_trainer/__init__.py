"""The dense side: data loading, DenseArch / InteractionArch / OverArch, the training loop and its
checkpoints and report, the distributed launcher, ``dlrm train``.

It imports ``dlrm_core`` and ``embedding_server`` (shape letters: ``dlrm_core/__init__.py``).
"""
