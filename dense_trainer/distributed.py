"""Disaggregated training: embedding-server ranks and trainer ranks in one torch.distributed world.

    dlrm train ... --embedding-servers E --trainers T      one machine: this module spawns the
                                                           E + T processes over loopback
    torchrun ... -m dlrm_cli worker ... (same flags)       several machines: each process takes
                                                           its role from its rank

Every process builds the same feature spec; the master trainer plans the sharding (pooling
factors measured on the first training file) and broadcasts the plan. Trainers run the usual
``Trainer`` with a ``DistributedEmbeddingClient``; servers run ``EmbeddingServer.serve``.

Faults: the local launcher hosts the rendezvous store and watches its children: when one dies,
or stops beating for ``dist.timeout_s`` (SIGSTOP, a hang: ``runtime/watchdog.py``), it stops
the others at once, names the lost rank and records it in ``OUT/last-fault.json``. Under
torchrun (or bare ``dlrm worker`` processes) every rank watches every other's beat and gives up
within ``dist.timeout_s`` (plus a beat) of losing one, naming it; a failed collective ends it
within the same timeout.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from dense_trainer.checkpointing import FAULT_FILE, storage_rate
from dense_trainer.config import Config
from dense_trainer.job_plan import make_plan, tower_layout
from dense_trainer.rank_context import adopt_launcher_state, launcher_state, rank_context
from dlrm_core.errors import DlrmError
from dlrm_core.logs import setup_logging
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.checkpoint.writer import CheckpointWriter, exit_status
from embedding_server.client.distributed import DistributedEmbeddingClient
from embedding_server.planner import (
    ShardingPlan,
    piece_bytes,
    wire_id_bound,
)
from embedding_server.runtime.cluster import Roles, join, open_slow_group
from embedding_server.runtime.pipelining import pipelining
from embedding_server.runtime.server import EmbeddingServer
from embedding_server.runtime.transport import exchange_chunks, open_transport
from embedding_server.runtime.watchdog import SUPERVISED_ENV, JobMonitor, PeerLost, io_bound_s
from embedding_server.towers.stage import TowerClientStage, TowerServerStage
from embedding_server.wire import ids_dtype

log = logging.getLogger(__name__)

SLOW_MARGIN_S = 30.0
"""The slow group's timeout exceeds every phase bound by this much."""


def rank_threads(roles: Roles, rank: int) -> int:
    """Intra-op threads of a rank sharing this machine with the others.

    The step is sequential (trainers wait for lookups, servers for gradients), and a server's
    fused lookups are light, so the cores go to the trainers' dense math and each server gets
    one thread. Oversubscribed OpenMP pools would spin against each other.
    """
    if not roles.is_trainer(rank):
        return 1
    cores = os.cpu_count() or 1
    local_trainers = int(os.environ.get("LOCAL_TRAINERS", roles.num_trainers))
    return max(1, cores // local_trainers)


def slow_timeout_s(cfg: Config, plan: ShardingPlan) -> float:
    """Bound of the waits on long work (restore, last checkpoint, publishing): the step timeout
    plus the model's bytes (tables and optimizer state) at ``dist.io_min_bytes_per_s``, plus a
    margin so that a rank past its own phase bound ends itself first, naming the phase."""
    nbytes = sum(piece_bytes(p.rows, p.dim, cfg.embedding.optimizer.kind) for p in plan.pieces)
    return io_bound_s(nbytes, cfg.dist.timeout_s, storage_rate(cfg)) + SLOW_MARGIN_S


def run_worker(
    rank: int,
    cfg: Config,
    train: list[Path],
    test: list[Path],
    out: Path,
    resume: bool,
    plan: ShardingPlan | None = None,
    prog: str = "dlrm worker",
) -> dict | None:
    """One rank's whole life: join, plan, train or serve, leave. Returns metrics on the master.
    The master plans (or takes ``plan``, made by the local launcher) and broadcasts the plan."""
    roles = Roles(cfg.dist.trainers, cfg.dist.embedding_servers)
    d = cfg.dist
    device = "cuda" if cfg.train.device in ("cuda", "auto") and torch.cuda.is_available() else "cpu"
    cluster = join(
        roles,
        d.timeout_s,
        rank,
        d.join_timeout_s,
        d.hosts,
        d.topology,
        d.hierarchical,
        device,
        d.heartbeat_s,
        prog,
    )
    # Who is who, for operators (and the fault tests): out/ranks/rank-<r>.json
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    (out / "ranks" / f"rank-{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "role": roles.describe(rank),
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
        )
    )
    # Ranks sharing a machine share its cores: oversubscribed OpenMP pools spin against each
    # other and slow every rank down many times over.
    torch.set_num_threads(cfg.train.threads or rank_threads(roles, rank))
    try:
        holder = [(plan or make_plan(cfg, train)).model_dump_json() if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        plan = ShardingPlan.model_validate_json(holder[0])
        open_slow_group(cluster, slow_timeout_s(cfg, plan))
        spec = cfg.feature_spec()
        cluster.transport = open_transport(cluster, ids_dtype(wire_id_bound(plan, spec)))
        layout = tower_layout(cfg, cluster.topology)
        chunks = exchange_chunks(d.exchange_chunks, cluster, layout is not None)
        # Every rank makes every tower's group (a collective), in tower order.
        groups = None
        if layout is not None:
            timeout = datetime.timedelta(seconds=d.timeout_s)
            groups = [
                dist.new_group([roles.server_rank(s) for s in servers], timeout=timeout)
                if len(servers) > 1
                else None
                for servers in layout.servers_of
            ]
        if cluster.is_trainer:
            return _run_trainer(
                cluster, cfg, plan, spec, layout, chunks, device, train, test, out, resume
            )
        _run_server(cluster, cfg, plan, spec, layout, groups, chunks, out, resume)
        return None
    # a failed collective (DistBackendError): name the silent peer, if any
    except RuntimeError as exc:
        if (why := cluster.heartbeat.suspect()) is not None:
            raise PeerLost(
                f"{why}; {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            ) from None
        raise
    finally:
        cluster.heartbeat.close()
        try:
            dist.destroy_process_group()
        except Exception:  # a broken world cannot be torn down cleanly; the process ends anyway
            pass


def _run_trainer(
    cluster,
    cfg: Config,
    plan,
    spec,
    layout,
    chunks,
    device: str,
    train: list[Path],
    test: list[Path],
    out: Path,
    resume: bool,
) -> dict | None:
    """A trainer rank: its distributed client, then the Trainer's run; metrics on the master."""
    from dense_trainer.train import Trainer

    roles, d = cluster.roles, cfg.dist
    stage = (
        TowerClientStage(layout, cluster.rank, roles.num_servers) if layout is not None else None
    )
    client = DistributedEmbeddingClient(
        cluster,
        plan,
        spec,
        grad_scale=1.0 / roles.num_trainers,
        exchange_dtype=d.exchange_dtype,
        stage=stage,
        chunks=chunks,
        device=device,
        corrected=pipelining(d).expects_corrections(),
    )
    trainer = Trainer(cfg, out, client=client, cluster=cluster)
    cluster.heartbeat.progress = lambda: trainer.state.step
    if cfg.stream.url:  # online: the tables on the servers, the rows from the streams
        from dense_trainer.online import OnlineTraining

        metrics = OnlineTraining(trainer).run(resume)
    else:
        metrics = trainer.fit(train, test, resume=resume)
    return metrics if cluster.is_master else None


def _run_server(
    cluster, cfg: Config, plan, spec, layout, groups, chunks, out: Path, resume: bool
) -> None:
    """An embedding server rank: it outlives signals and stops when the trainers say so (after
    their last checkpoint), or when they are gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stage = None
    if layout is not None:

        def stage(server):
            return TowerServerStage(server, layout, plan, groups, cfg.optim, cfg.train.seed)

    index = cluster.roles.server_index(cluster.rank)
    writer = CheckpointWriter(f"server-{index}", cfg.train.checkpoint_write_bytes_per_s)
    server = EmbeddingServer(
        cluster,
        plan,
        spec,
        cfg.embedding,
        cfg.dist,
        cfg.live,
        cfg.train.seed,
        out / "checkpoints",
        stage,
        chunks,
        writer,
    )
    cluster.heartbeat.progress = lambda: server.steps
    if resume and (ckpt := latest_checkpoint(out / "checkpoints")) is not None:
        with cluster.heartbeat.phase(
            f"restoring {ckpt.name}", cluster.slow_timeout_s - SLOW_MARGIN_S
        ):
            server.restore(ckpt)
    dist.barrier(group=cluster.slow_group)  # every rank restored (however long that took)
    stats = server.serve()
    dist.gather_object(stats, None, dst=0)


def _child(
    rank: int,
    cfg_json: str,
    train,
    test,
    out,
    resume,
    addr: str,
    port: int,
    result_path: str,
    plan_json: str,
    env: dict[str, str],
    cwd: str,
) -> None:
    adopt_launcher_state(env, cwd)  # as a spawned process would start
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank))
    os.environ[SUPERVISED_ENV] = "1"  # the launcher watches every rank's beat
    cfg = Config.model_validate_json(cfg_json)
    os.environ["WORLD_SIZE"] = str(cfg.dist.trainers + cfg.dist.embedding_servers)
    setup_logging(quiet=rank != 0)  # the master speaks for the job
    try:
        metrics = run_worker(
            rank,
            cfg,
            [Path(f) for f in train],
            [Path(f) for f in test],
            Path(out),
            resume,
            ShardingPlan.model_validate_json(plan_json),
            prog="dlrm train",
        )
        if metrics is not None:
            Path(result_path).write_text(json.dumps({"ok": True}))
    except KeyboardInterrupt as exc:
        Path(result_path).write_text(json.dumps({"interrupted": str(exc)}))
        raise SystemExit(exit_status(130)) from None
    except DlrmError as exc:
        print(
            f"dlrm train: {Roles(cfg.dist.trainers, cfg.dist.embedding_servers).describe(rank)}: "
            f"error: {exc}",
            flush=True,
        )
        raise SystemExit(exit_status(2)) from None
    except Exception as exc:  # a lost peer, or a bug: one line, the traceback only when asked
        role = Roles(cfg.dist.trainers, cfg.dist.embedding_servers).describe(rank)
        print(
            f"dlrm train: {role} stopped: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}",
            flush=True,
        )
        if os.environ.get("DLRM_DEBUG"):
            traceback.print_exc()
        raise SystemExit(exit_status(1)) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def watch_ranks(procs: list, monitor: JobMonitor, timeout_s: float) -> tuple[int, str] | None:
    """Wait while the ranks run; (rank, what happened to it) for the first one lost, else None.

    A rank killed by a signal is the cause; a rank that failed otherwise (a collective's timeout)
    most likely failed *because of* a silent one, which is named instead when there is one.
    """
    next_check = time.monotonic() + 1.0
    while True:
        alive = [p.is_alive() for p in procs]
        codes = [p.exitcode for p in procs]
        killed = [(r, c) for r, c in enumerate(codes) if c is not None and c < 0]
        if killed:
            rank, code = killed[0]
            return rank, f"was killed by {signal.Signals(-code).name}"
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, 130)]
        if failed:
            cause = monitor.suspect(alive, min(10.0, timeout_s / 2))
            if cause is not None:
                return cause
            rank, code = failed[0]
            phase = monitor.phase(rank)
            return rank, f"exited with status {code}" + (f" while {phase}" if phase else "")
        if not any(alive):
            return None
        if time.monotonic() >= next_check:
            if (lost := monitor.lost(alive)) is not None:
                return lost
            next_check = time.monotonic() + 1.0
        time.sleep(0.1)


def write_rank_files(out: Path, roles: Roles, pids: list[int]) -> None:
    """``OUT/ranks/rank-<r>.json`` of every rank as soon as it is spawned (each rank rewrites its
    own once it has joined); files of an earlier, larger job are removed."""
    ranks = out / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    for old in ranks.glob("rank-*.json"):
        old.unlink(missing_ok=True)
    for rank, pid in enumerate(pids):
        (ranks / f"rank-{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "role": roles.describe(rank),
                    "pid": pid,
                    "host": socket.gethostname(),
                }
            )
        )


def record_fault(
    out: Path, roles: Roles, rank: int, how: str, monitor: JobMonitor, alive: list[bool]
) -> None:
    """``OUT/last-fault.json``: who was lost, how, and the step the job had reached (the trainers'
    last beats, each live one's after it beats once more; a resumed run reports the steps it
    redoes from it)."""
    steps = [monitor.step(r, alive=alive[r] and r != rank) for r in range(roles.num_trainers)]
    step = max((s for s in steps if s is not None), default=None)
    fault = {
        "rank": rank,
        "role": roles.describe(rank),
        "how": how,
        "step": step,
        "time": time.time(),
    }
    (out / FAULT_FILE).write_text(json.dumps(fault))


def launch_local(
    cfg: Config,
    train: list[Path],
    test: list[Path],
    out: Path,
    resume: bool,
    plan: ShardingPlan | None = None,
) -> dict:
    """Run the whole cluster as local processes; return the master's metrics.

    The plan is made here (before any process starts, so that a model that cannot fit is
    refused at once) unless given. The launcher hosts the rendezvous store, so it can read every
    rank's beat whatever the ranks do (rank 0 stopped included).
    """
    plan = plan or make_plan(cfg, train)
    roles = Roles(cfg.dist.trainers, cfg.dist.embedding_servers)
    port = cfg.dist.master_port or free_port()
    out.mkdir(parents=True, exist_ok=True)
    result = out / ".launch-result.json"
    result.unlink(missing_ok=True)
    store = dist.TCPStore(
        cfg.dist.master_addr,
        port,
        roles.world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=cfg.dist.join_timeout_s),
    )
    ctx = rank_context()
    procs = []
    for rank in range(roles.world_size):
        p = ctx.Process(
            target=_child,
            name=roles.describe(rank),
            args=(
                rank,
                cfg.model_dump_json(),
                [str(f) for f in train],
                [str(f) for f in test],
                str(out),
                resume,
                cfg.dist.master_addr,
                port,
                str(result),
                plan.model_dump_json(),
                *launcher_state(),
            ),
        )
        p.start()
        procs.append(p)
    write_rank_files(out, roles, [p.pid for p in procs])
    trainers = procs[: roles.num_trainers]

    def forward_signal(signum, _frame):  # trainers checkpoint and stop the servers themselves
        for p in trainers:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    old = {sig: signal.signal(sig, forward_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        monitor = JobMonitor(store, [p.pid for p in procs], cfg.dist.timeout_s)
        failed = watch_ranks(procs, monitor, cfg.dist.timeout_s)
        if failed is not None:
            rank, how = failed
            record_fault(out, roles, rank, how, monitor, [p.is_alive() for p in procs])
            for p in procs:  # the others cannot go on without it (servers ignore SIGTERM)
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            raise DlrmError(f"{roles.describe(rank)} {how}; the other ranks were stopped")
        for p in procs:
            p.join()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    status = json.loads(result.read_text()) if result.exists() else {}
    result.unlink(missing_ok=True)
    if "interrupted" in status:
        raise KeyboardInterrupt(status["interrupted"])
    return json.loads((out / "metrics.json").read_text())
