"""Dense side of the system: data readers and generators, DenseArch / InteractionArch /
OverArch, the training loop and ``dlrm train``.

Shape letters (as in ``embedding_server``):
    B  batch size
    F  sparse features;  N = F + 1 interaction inputs (F embeddings + the dense arch output)
    D  embedding dim (the dense arch output dim)
    I  dense (integer) features, 13 for Criteo
"""
