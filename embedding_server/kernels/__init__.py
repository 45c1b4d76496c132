"""The kernels that hold rows and update them: fbgemm's fused table-batched embedding bags and a
PyTorch fallback with the same maths, state names and shapes.

    tbe.py               TBEKernel: ``SplitTableBatchedEmbeddingBagsCodegen``, optimizer fused
                         in backward
    torch_kernel.py      TorchKernel: the same in PyTorch (optimizers fbgemm cannot run there)
    optimizers.py        the sparse optimizers in PyTorch and the dense optimizer factory
    optimizer_config.py  the optimizers' settings and state shapes, without torch
    row_blocks.py        rows of several pieces of a kernel read and written with one indexing op

May import: ``idmap``, ``local_table``, ``wire`` (layers: ``scripts/check_layout.py``).
"""
