"""A dynamic table's ids moved onto another split by rows: resharding E -> E' servers.

A checkpoint of a dynamic table split over P pieces (``pieces.py``; P = 1: whole) restored
onto a split over P' != P: every admitted id goes to the piece its hash routes it to now, with
its row (weights and optimizer state), its last use and its use count; shared index j keeps its
row's values wherever j lands (S, and so every id's shared index, does not depend on P). Per new
piece:

    shared rows     local row j - o (o its first shared index)  <- old global row of j
    admitted ids    the ids routed here, sorted, on local rows S_p, S_p + 1, ... <- their old
                    rows; past the piece's capacity the lowest in the eviction order (lru, ttl:
                    least recent; lfu: least used) are dropped (they read their shared row)
    map             a fresh map holding them (hash table, free stack, clock of the checkpoint);
                    its admission sketch starts empty, and the table's admitted / evicted /
                    default-lookup counts are split by the pieces' shares of S

Only what the new piece needs is read, one old piece's chunk at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedding_server.idmap.dynamic import COUNTERS, DynamicIdMap
from embedding_server.idmap.pieces import PieceLayout
from embedding_server.local_table import LocalTable

CLOCK, FREE, ADMITTED, EVICTED, DEFAULTS = range(len(COUNTERS))


@dataclass
class MovedPiece:
    """What a new piece of a resharded dynamic table restores.

    Attributes:
        sources: old global rows whose states it takes, int64 [k].
        targets: its local rows that take them, int64 [k].
        state: its id map, as ``DynamicIdMap.state`` names it.
    """

    sources: torch.Tensor
    targets: torch.Tensor
    state: dict[str, torch.Tensor]


def move_piece(ckpt, local: LocalTable) -> MovedPiece:
    """The rows and map of piece ``local`` of a dynamic table whose checkpoint (``ckpt``, a
    ``CheckpointTables``) split its rows otherwise."""
    table, cfg, name = local.table, local.table.dynamic, local.table.name
    saved = ckpt.row_pieces(name)
    old = PieceLayout.of(table.rows, cfg, len(saved), name)
    new = PieceLayout.of(table.rows, cfg, local.row_pieces, name)
    s_p, _, first = new.span(local.row_start, name)
    here, rows = new.row_starts.index(local.row_start), local.spec.rows
    # Shared rows: index j of this piece from wherever the old split held it.
    j = torch.arange(first, first + s_p, dtype=torch.int64)
    sources, targets = [old.index_row(j)], [j - first]
    # Admitted ids of every old piece, those routed here.
    ids, at, last, uses, counts = [], [], [], [], torch.zeros(len(COUNTERS), dtype=torch.int64)
    for start, n in saved:
        state = ckpt.id_map(name, start, n)
        keys, slots = state[f"{name}.idmap.table.keys"], state[f"{name}.idmap.table.slots"]
        live = slots >= 0
        k, r = keys[live], slots[live]
        mine = new.piece_of(k) == here
        k, r = k[mine], r[mine]
        ids.append(k)
        at.append(r + start)
        last.append(state[f"{name}.idmap.last"][r])
        uses.append(state[f"{name}.idmap.uses"][r])
        c = state[f"{name}.idmap.counters"]
        counts[CLOCK] = max(int(counts[CLOCK]), int(c[CLOCK]))
        counts[ADMITTED:] += c[ADMITTED:]
    ids, at, last, uses = (torch.cat(x) for x in (ids, at, last, uses))
    keep = _keep(ids, last, uses, cfg.evict, rows - s_p)
    dropped = ids.numel() - keep.numel()
    ids, at, last, uses = ids[keep], at[keep], last[keep], uses[keep]
    slots = torch.arange(s_p, s_p + ids.numel(), dtype=torch.int64)
    sources.append(at)
    targets.append(slots)
    fresh = DynamicIdMap(rows, cfg, span=new.span(local.row_start))
    fresh.table.insert(ids, slots)
    fresh.row_id[slots], fresh.used[slots] = ids, True
    fresh.last[slots], fresh.uses[slots] = last, uses
    fresh.free[: rows - s_p - ids.numel()] = torch.arange(rows - 1, s_p + ids.numel() - 1, -1)
    share = s_p / new.shared
    fresh.counters[CLOCK] = counts[CLOCK]
    fresh.counters[FREE] = rows - s_p - ids.numel()
    for c in (ADMITTED, EVICTED, DEFAULTS):
        fresh.counters[c] = int(counts[c] * share)
    fresh.counters[EVICTED] += dropped
    return MovedPiece(
        torch.cat(sources),
        torch.cat(targets),
        {f"{name}.idmap.{k}": v for k, v in fresh.state().items()},
    )


def _keep(
    ids: torch.Tensor, last: torch.Tensor, uses: torch.Tensor, evict: str, capacity: int
) -> torch.Tensor:
    """Positions of the ids that stay (at most ``capacity``; the first in the eviction order go),
    in id order."""
    if ids.numel() <= capacity:
        return torch.argsort(ids)
    order = torch.argsort(ids)  # ties: lower id stays
    if evict == "lfu":
        order = order[torch.argsort(last[order], descending=True, stable=True)]
        order = order[torch.argsort(uses[order], descending=True, stable=True)]
    else:
        order = order[torch.argsort(last[order], descending=True, stable=True)]
    kept = order[:capacity]
    return kept[torch.argsort(ids[kept])]
