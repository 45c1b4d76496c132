"""The pipeline modes (``dist.pipeline``), one class each, chosen once from the config by
:func:`pipelining`: nothing else compares the mode's name.

    off        lockstep: a step's ids travel once its previous step is done; each update is
               applied as soon as its gradients arrive
    exact      the next batch's ids travel, and the servers look it up, while the trainers compute
               the current one; the lookup sees the previous update (corrected early lookups:
               ``correction.py``), so results are those of ``off``
    semi-sync  as exact, but a lookup does not wait for the previous step's update (one step stale)

A mode answers two sides: the trainer (whether it sends the next step's ids during this one, and
whether it expects corrections), and the server (:meth:`Pipelining.schedule`: when it applies a
chunk's update relative to the next lookup). Adding a mode is adding a class here and its name to
``DistConfig.pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from embedding_server.config import DistConfig


@dataclass(frozen=True)
class ServerSchedule:
    """When a server applies each chunk's update, for one route."""

    eager: bool
    """Apply an update as soon as its gradients arrive (lockstep, or a route that cannot hold it
    until the next step's ids are in)."""
    stale: bool
    """Look the next batch up before the previous update (semi-sync), then apply it."""
    corrected: bool
    """Look up early, then send corrections for the bags the update changed (exact)."""


@dataclass(frozen=True)
class Pipelining:
    """A pipeline mode."""

    name: ClassVar[str]
    prefetch: ClassVar[bool] = True
    """Trainers send step i+1's ids while step i computes."""
    corrected_lookups: bool = False
    """``dist.corrected_lookups`` where the mode uses it."""

    def expects_corrections(self) -> bool:
        """Whether the trainers' client receives corrections after early lookups."""
        return False

    def schedule(self, deferrable: bool, pipelined: bool, has_tables: bool) -> ServerSchedule:
        """The server's schedule, given whether its stage may defer an update (``deferrable``),
        whether its transport overlaps steps (``pipelined``) and whether it holds tables."""
        return ServerSchedule(eager=not pipelined, stale=False, corrected=False)


@dataclass(frozen=True)
class Lockstep(Pipelining):
    name: ClassVar[str] = "off"
    prefetch: ClassVar[bool] = False

    def schedule(self, deferrable: bool, pipelined: bool, has_tables: bool) -> ServerSchedule:
        return ServerSchedule(eager=True, stale=False, corrected=False)


@dataclass(frozen=True)
class Exact(Pipelining):
    name: ClassVar[str] = "exact"

    def expects_corrections(self) -> bool:
        return self.corrected_lookups

    def schedule(self, deferrable: bool, pipelined: bool, has_tables: bool) -> ServerSchedule:
        corrected = self.corrected_lookups and deferrable and pipelined and has_tables
        return ServerSchedule(eager=not pipelined, stale=False, corrected=corrected)


@dataclass(frozen=True)
class SemiSync(Pipelining):
    name: ClassVar[str] = "semi-sync"

    def schedule(self, deferrable: bool, pipelined: bool, has_tables: bool) -> ServerSchedule:
        return ServerSchedule(eager=not pipelined, stale=deferrable and pipelined, corrected=False)


MODES: dict[str, type[Pipelining]] = {m.name: m for m in (Lockstep, Exact, SemiSync)}


def pipelining(dist: DistConfig) -> Pipelining:
    """The mode ``dist.pipeline`` names."""
    return MODES[dist.pipeline](corrected_lookups=dist.corrected_lookups)
