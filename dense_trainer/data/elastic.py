"""What earlier runs read of the current epoch, when a run resumes with another number of trainers.

Trainer t of T reads the blocks whose number is t modulo T; its checkpointed position says how
far. Resumed by T' trainers, the blocks are dealt modulo T' instead: each share then skips the
blocks (and the first rows of the block) that the old trainer of that block had consumed, so
that every row of the epoch is still read once. The record stays in checkpoints until the epoch
ends (a run may change T several times within one epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrm_core.batch import Position


@dataclass
class Consumed:
    """Rows of epoch ``epoch`` that runs with other numbers of trainers consumed (an elastic
    restart): trainer t of such a run of T read the blocks t mod T up to its position."""

    epoch: int
    runs: list[tuple[int, list[Position]]]
    """(T, the T trainers' positions) of each earlier run."""

    def rows(self, block: int) -> int | None:
        """Valid rows of block number ``block`` already consumed (None: all of them)."""
        done = 0
        for parts, positions in self.runs:
            p = positions[block % parts]  # the block's reader in that run
            if p.epoch != self.epoch:
                continue  # it had not started this epoch
            if block < p.block:
                return None
            if block == p.block:
                done = max(done, p.rows_into_block)
        return done

    def to_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "runs": [[n, [p.to_dict() for p in ps]] for n, ps in self.runs],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Consumed:
        return cls(d["epoch"], [(n, [Position(**p) for p in ps]) for n, ps in d["runs"]])
