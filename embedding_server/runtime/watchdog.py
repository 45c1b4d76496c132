"""Liveness of a job's ranks: heartbeats through the rendezvous store, and bounds on long waits.

A process that dies closes its sockets and its peers notice at once. A *hung* one (SIGSTOP, a
stuck disk, a host cut off without a TCP reset) keeps them open: a peer waiting on it waits for
its collective's timeout, or, in a long wait (restoring a large checkpoint), much longer. So
every rank beats, from a thread of its own, through the rendezvous store:

    heartbeat thread, every dist.heartbeat_s     add(dlrm/hb/<rank>, 1); set(dlrm/st/<rank>,
                                                 {step, phase})
    watcher: the local launcher (which hosts     a rank whose beat has not moved for
    the store), or every rank itself under       dist.timeout_s is lost: the job ends naming it
    torchrun or a bare ``dlrm worker``           (a store that stops answering names its host)

A beat shows that the process runs, not that its main thread progresses: a rank's own long
waits (restoring, publishing, finishing a checkpoint) are *phases* with a bound scaled to the
bytes they move (:func:`io_bound_s`); a rank past its bound ends itself, naming the phase, and
shows the phase in its status so that the launcher can name it too.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from dlrm_core.errors import DlrmError

log = logging.getLogger(__name__)

SUPERVISED_ENV = "DLRM_SUPERVISED"
"""Set by the local launcher: it watches the ranks' beats, so ranks do not watch each other."""
EXIT_LOST = 3
"""Exit status of a rank that gave up on a lost peer or a phase past its bound."""


class PeerLost(DlrmError):
    """A collective failed because a peer went silent (the message names it)."""


def io_bound_s(nbytes: int, timeout_s: float, min_bytes_per_s: float) -> float:
    """How long moving ``nbytes`` to or from storage may take before it counts as stuck."""
    return timeout_s + nbytes / min_bytes_per_s


def _prefix() -> str:
    # torchrun may restart a job on the same store: each attempt beats under its own keys.
    return f"dlrm/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def beat_key(rank: int) -> str:
    return f"{_prefix()}/hb/{rank}"


def status_key(rank: int) -> str:
    return f"{_prefix()}/st/{rank}"


def done_key(rank: int) -> str:
    return f"{_prefix()}/done/{rank}"


def connect(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection of its own to the rendezvous store (never the process group's)."""
    return dist.TCPStore(
        addr,
        port,
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class PeerBeats:
    """The beats of some ranks as one watcher sees them: when each last moved (local clock)."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.count = {r: 0 for r in ranks}
        self.moved: dict[int, float] = {}
        """rank -> monotonic time its beat last moved (absent: never seen)."""

    def read(self, store: dist.TCPStore, now: float) -> None:
        for r in list(self.ranks):
            n = store.add(beat_key(r), 0)  # reads without waiting (creates the counter at 0)
            if n != self.count[r]:
                self.count[r] = n
                self.moved[r] = now
            elif r in self.moved and store.add(done_key(r), 0):  # quiet because it ended on its own
                self.ranks.remove(r)
                del self.moved[r]

    def silent(self, now: float) -> dict[int, float]:
        """Seconds since each seen rank's beat last moved."""
        return {r: now - t for r, t in self.moved.items()}


def read_status(store: dist.TCPStore, rank: int) -> dict:
    """The last status a rank published ({} when none)."""
    key = status_key(rank)
    try:
        if not store.check([key]):
            return {}
        return json.loads(store.get(key))
    except Exception:  # a status is for messages only
        return {}


class Heartbeat:
    """This rank's heartbeat (and, unsupervised, its watch over every peer): two threads, one that
    talks to the store (which may block on a lost host) and one that decides, never blocking.

    Args:
        store: a client connection of its own (:func:`connect`).
        rank / world: this rank, the world size.
        describe: rank -> its role in words (``Roles.describe``).
        timeout_s: silence after which a peer (or the store) counts as lost.
        interval_s: seconds between beats.
        watch_peers: also watch every other rank (False under the local launcher, which does).
        where: the store's address, for messages.
        prog: the command, for messages (``dlrm worker``).
    """

    def __init__(
        self,
        store: dist.TCPStore,
        rank: int,
        world: int,
        describe: Callable[[int], str],
        timeout_s: float,
        interval_s: float = 1.0,
        watch_peers: bool = True,
        where: str = "",
        prog: str = "dlrm",
    ) -> None:
        self.store = store
        self.rank = rank
        self.describe = describe
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.where = where
        self.prog = prog
        self.peers = PeerBeats([r for r in range(world) if r != rank]) if watch_peers else None
        self.progress: Callable[[], int] | None = None
        """Returns this rank's step (trainers: the global step; servers: steps served)."""
        self._phase: tuple[str, float, float] | None = None  # (what, started, bound_s)
        self._store_ok = time.monotonic()  # the store's last answer
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._io = threading.Thread(target=self._run_io, name="heartbeat", daemon=True)
        self._guard = threading.Thread(target=self._run_guard, name="heartbeat-guard", daemon=True)

    def start(self) -> Heartbeat:
        self._beat()
        self._io.start()
        self._guard.start()
        # a process that forgets close() still ends outside a store call
        atexit.register(self.close)
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._io.is_alive() and self._io is not threading.current_thread():
            self._io.join(timeout=3)  # its last beat; not inside a store call when the process ends

    @contextlib.contextmanager
    def phase(self, what: str, bound_s: float) -> Iterator[None]:
        """A long wait of this rank's own, which may last ``bound_s`` (then the rank ends
        itself)."""
        previous = self._phase
        self._phase = (what, time.monotonic(), bound_s)
        self._wake.set()  # show it now
        try:
            yield
        finally:
            self._phase = previous
            self._wake.set()

    # -- the threads -----------------------------------------------------------------------------

    def _run_io(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._beat()  # after a stop: the last word, the step this rank ends at
            if self._stop.is_set():
                try:
                    self.store.add(done_key(self.rank), 1)
                except Exception:
                    pass
                return
            if self.peers is not None:
                try:
                    self.peers.read(self.store, time.monotonic())
                    self._store_ok = time.monotonic()
                except Exception:  # the store's host is lost: the guard counts the silence
                    pass

    def _beat(self) -> None:
        status = {
            "step": self.progress() if self.progress else 0,
            "pid": os.getpid(),
            "phase": self._phase[0] if self._phase else "",
            "t": time.time(),
        }
        try:
            self.store.add(beat_key(self.rank), 1)
            self.store.set(status_key(self.rank), json.dumps(status))
            self._store_ok = time.monotonic()
        except Exception:  # the store's host is gone, stopped or cut off: the guard decides
            pass

    def _run_guard(self) -> None:
        while not self._stop.wait(min(0.25, self.interval_s)):
            if (why := self._lost(time.monotonic(), self.timeout_s)) is not None:
                self.fatal(why)
            if self._phase is not None:
                what, started, bound = self._phase
                if time.monotonic() - started > bound:
                    self.fatal(
                        f"{what} took longer than its bound of {bound:.0f}s (stuck storage or a "
                        "stuck peer?)"
                    )

    def _lost(self, now: float, quiet_s: float) -> str | None:
        """What has been silent for more than ``quiet_s``: the store (its host), else a peer."""
        if self.peers is None:
            return None
        if now - self._store_ok > quiet_s:
            return (
                f"the rendezvous store {self.where} has not answered for "
                f"{now - self._store_ok:.0f}s; its host "
                "(rank 0, or torchrun's agent) is lost"
            )
        # A peer's silence counts while the store answers (else the store is the one lost).
        silent = [(min(now, self._store_ok) - t, r) for r, t in list(self.peers.moved.items())]
        silent = [(q, r) for q, r in silent if q > quiet_s]
        if not silent:
            return None
        q, r = max(silent)
        return (
            f"{self.describe(r)} sent no heartbeat for {q:.0f}s (stopped, hung or cut off from "
            "the network)"
        )

    def suspect(self, min_quiet_s: float = 3.0) -> str | None:
        """Why a collective probably failed: the store or the quietest peer, silent for at least
        ``min_quiet_s`` (None when all beat, or when the launcher does the watching)."""
        return self._lost(time.monotonic(), min_quiet_s)

    def fatal(self, message: str) -> None:
        """End this process at once (its main thread may be stuck in a collective), saying why."""
        if self._stop.is_set():
            return
        self._stop.set()
        print(
            f"{self.prog}: {self.describe(self.rank)} stopped: {message}",
            file=sys.stdout,
            flush=True,
        )
        os._exit(EXIT_LOST)


class JobMonitor:
    """The local launcher's watch over its ranks: their beats in the store it hosts, and, before a
    rank's first beat, whether its process is stopped (``/proc``).

    Args:
        store: the launcher's own store (it hosts it, so it answers whatever the ranks do).
        pids: process id of every rank.
        timeout_s: silence after which a rank is lost.
    """

    def __init__(self, store: dist.TCPStore, pids: list[int], timeout_s: float) -> None:
        self.store = store
        self.pids = pids
        self.timeout_s = timeout_s
        self.beats = PeerBeats(list(range(len(pids))))
        self._stopped_since: dict[int, float] = {}

    def lost(self, alive: list[bool]) -> tuple[int, str] | None:
        """(rank, why) of a live rank that stopped beating (or is stopped before beating), else
        None."""
        now = time.monotonic()
        self.beats.read(self.store, now)
        silent = self.beats.silent(now)
        worst: tuple[float, int, str] | None = None
        for rank, pid in enumerate(self.pids):
            if not alive[rank]:
                continue
            state = process_state(pid)
            if state in ("T", "t"):
                self._stopped_since.setdefault(rank, now)
            else:
                self._stopped_since.pop(rank, None)
            quiet = silent.get(rank, now - self._stopped_since.get(rank, now))
            if quiet > self.timeout_s and (worst is None or quiet > worst[0]):
                how = "is stopped (SIGSTOP)" if state in ("T", "t") else "stopped responding"
                phase = self.phase(rank)
                worst = (
                    quiet,
                    rank,
                    f"{how}{f' while {phase}' if phase else ''}: no heartbeat for {quiet:.0f}s",
                )
        return (worst[1], worst[2]) if worst else None

    def suspect(self, alive: list[bool], min_quiet_s: float) -> tuple[int, str] | None:
        """The quietest live rank, silent (or stopped) for at least ``min_quiet_s``: the likely
        cause
        when another rank fails on a timeout."""
        saved, self.timeout_s = self.timeout_s, min_quiet_s
        try:
            return self.lost(alive)
        finally:
            self.timeout_s = saved

    def step(self, rank: int = 0, alive: bool = False, wait_s: float = 2.0) -> int | None:
        """The last step a rank reported (the master trainer's: the job's step). For a rank still
        ``alive``, after its next beat (it beats once more as it ends), at most ``wait_s``."""
        beats = self.store.add(beat_key(rank), 0)
        deadline = time.monotonic() + (wait_s if alive else 0.0)
        while time.monotonic() < deadline and self.store.add(beat_key(rank), 0) == beats:
            time.sleep(0.05)
        return read_status(self.store, rank).get("step")

    def phase(self, rank: int) -> str:
        return read_status(self.store, rank).get("phase", "")


def process_state(pid: int) -> str:
    """One-letter state of a process (``R``, ``S``, ``D``, ``T`` stopped...), ``?`` if unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return "?"
