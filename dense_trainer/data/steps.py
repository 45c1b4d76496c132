"""Steps that every trainer takes together, each on its own share of the data.

Trainer t of T reads the blocks whose number is t modulo T (``BatchLoader(part=t, parts=T)``):
T trainers parse each row once. Their shares differ in size, yet every trainer must take every
step (the embedding servers answer each step once every trainer has spoken, DDP all-reduces
each step), so before each step they agree, with one small all-reduce, on:

    how many rows the step has in all (the loss is the mean over the global batch),
    whether anyone still has rows of the current epoch (a trainer whose share is done takes the
    step with an empty batch), whether anyone has rows at all (else the data is over),
    whether anyone was asked to stop (then all stop at the same step).

A single process can read the same way (``data.interleave = T``): it concatenates the T shares'
batches, which are then exactly the global batches of a T-trainer run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dense_trainer.data.elastic import Consumed
from dense_trainer.data.loader import BatchLoader
from dlrm_core.batch import Batch, Position, SparseFeatures

log = logging.getLogger(__name__)

Agree = Callable[[list[float]], list[float]]
"""Sums a vector over the trainers (an all-reduce; identity for one trainer)."""


@dataclass
class Step:
    batch: Batch
    """This trainer's rows of the step (possibly none)."""
    global_rows: int
    """Rows of the step over every trainer."""
    epoch: int
    stop: bool
    """Some trainer was asked to stop: this step is not taken."""
    positions: list[Position]
    """Where each of this process's shares resumes after the step."""


def empty_batch(num_dense: int, num_features: int, position: Position) -> Batch:
    """A batch of no rows (a trainer whose share of the epoch is done)."""
    sparse = SparseFeatures(
        torch.zeros(0, dtype=torch.int64), torch.zeros(num_features * 0 + 1, dtype=torch.int64), 0
    )
    return Batch(torch.zeros(0, num_dense), sparse, torch.zeros(0), position)


class _Share:
    """One share of the data: a loader's batches, one held back when it is of the next epoch."""

    def __init__(self, loader: BatchLoader, start: Position) -> None:
        self.loader = loader
        self.it: Iterator[Batch] = iter(loader)
        self.held: Batch | None = None
        self.done = False
        self.position = start

    def peek(self) -> Batch | None:
        if self.held is None and not self.done:
            self.held = next(self.it, None)
            self.done = self.held is None
        return self.held

    def take(self, epoch: int) -> Batch | None:
        """The next batch if it belongs to ``epoch`` (None otherwise)."""
        b = self.peek()
        if b is None or b.position.epoch != epoch:
            return None
        self.held = None
        self.position = b.position
        return b

    def close(self) -> None:
        self.loader.close()


class Steps:
    """Agreed steps over one or more shares (several: a single process reading as T trainers).

    Args:
        loaders: this process's shares, in trainer order.
        num_dense / num_features: I and F, for empty batches.
        agree: sums the agreement vector over the trainers (identity for one process).
        start_epoch: the epoch the run resumes in.
    """

    def __init__(
        self,
        loaders: list[BatchLoader],
        num_dense: int,
        num_features: int,
        agree: Agree,
        start_epoch: int = 0,
    ) -> None:
        self.shares = [_Share(loader, loader.start) for loader in loaders]
        self.num_dense, self.num_features = num_dense, num_features
        self.agree = agree
        self.epoch = start_epoch

    def next(self, stop: bool = False) -> Step | None:
        """The next step (None at the end of the data); trainers call it together."""
        while True:
            heads = [s.peek() for s in self.shares]
            in_epoch = [b is not None and b.position.epoch == self.epoch for b in heads]
            rows = sum(b.batch_size for b, ok in zip(heads, in_epoch, strict=True) if ok)
            total = self.agree(
                [
                    float(any(in_epoch)),
                    float(any(b is not None for b in heads)),
                    float(rows),
                    float(stop),
                ]
            )
            if total[3] > 0:
                return Step(self._empty(), 0, self.epoch, True, self.positions())
            if total[0] > 0:
                taken = [s.take(self.epoch) for s in self.shares]
                parts = [b for b in taken if b is not None]
                batch = Batch.cat(parts) if parts else self._empty()
                return Step(batch, int(total[2]), self.epoch, False, self.positions())
            if total[1] == 0:
                return None
            self.epoch += 1  # every share is done with this epoch

    def _empty(self) -> Batch:
        return empty_batch(self.num_dense, self.num_features, self.positions()[0])

    def positions(self) -> list[Position]:
        """Where each share resumes (its last consumed batch's position)."""
        return [s.position for s in self.shares]

    def close(self) -> None:
        for s in self.shares:
            s.close()


def resume_positions(
    saved: list[Position] | None, parts: int, consumed: Consumed | None = None
) -> tuple[list[Position], Consumed | None]:
    """Where each of ``parts`` shares starts, and what earlier runs consumed of the current epoch.

    The saved positions of a run with as many trainers are taken as they are. With another
    number of trainers (an elastic restart), every share starts at the earliest block of the
    epoch that some old trainer had not finished, and skips what the old trainers consumed
    (``Consumed``, kept in later checkpoints until the epoch ends): every row is read once."""
    if not saved:
        return [Position()] * parts, None
    epoch = max(p.epoch for p in saved)
    runs = consumed.runs if consumed is not None and consumed.epoch == epoch else []
    if len(saved) == parts:
        return list(saved), Consumed(epoch, runs) if runs else None
    current = [p for p in saved if p.epoch == epoch]
    if len(current) < len(saved):  # some trainer had not started the epoch: its blocks are all left
        start = Position(epoch=epoch)
    else:
        first = min(current, key=lambda p: p.block)
        start = Position(
            epoch, first.file_index, first.block_offset, first.block_line, 0, first.block
        )
    log.warning(
        "resuming %d trainer(s) from a checkpoint of %d: the shares restart at block %d of epoch "
        "%d, "
        "skipping the rows the old trainers read",
        parts,
        len(saved),
        start.block,
        epoch,
    )
    return [start] * parts, Consumed(epoch, [*runs, (len(saved), list(saved))])


@contextlib.contextmanager
def partial_step(optimizer: torch.optim.Optimizer, rows: int, batch_size: int) -> Iterator[None]:
    """A step of fewer rows than the batch size (an epoch's tail, where the trainers' shares run
    out unevenly) moves the dense weights that much less: its learning rate is scaled by
    rows / batch size (Adam's step does not shrink with its gradient)."""
    if rows >= batch_size:
        yield
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * rows / batch_size
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved, strict=True):
            g["lr"] = lr
