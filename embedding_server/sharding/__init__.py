"""One module per placement: how a table's bags are routed to its pieces (input_dist), and how
the pieces' pooled outputs come back together (output_dist) and their gradients go back.

Every module offers the same three functions over one table's bags of a batch of B examples:

    route(values [N], lengths [B], pieces, table)       -> per piece (values, lengths)
    combine(outputs [per piece [B, d_p]], lengths, table) -> pooled [B, D]
    split_grad(grad [B, D], lengths, pieces, table)       -> per piece gradient [B, d_p]
"""

from embedding_server.sharding import column_wise, hash_routed, row_wise, table_wise

SCHEMES = {"table_wise": table_wise, "row_wise": row_wise, "column_wise": column_wise}


def scheme_for(kind: str, table):
    """The module of a placement ``kind`` for ``table`` (a ``TableSpec``): a dynamic table split
    by rows routes its raw ids by hash (``hash_routed``), not by row range."""
    if kind == "row_wise" and table.dynamic is not None:
        return hash_routed
    return SCHEMES[kind]
