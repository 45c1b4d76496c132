"""Config sections of the parameter node: the tables and their optimizer, the distributed job,
live updates. ``dense_trainer.config.Config`` composes them with the trainer's own sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dlrm_core.config import Section, flag
from dlrm_core.schema import EvictPolicy, IdMode
from embedding_server.kernels.optimizer_config import SparseOptimizerConfig


class TableOverride(Section):
    """Per-table settings that differ from the [embedding] defaults."""

    name: str
    """Table (feature) name, C1..C26."""
    rows: int | None = Field(default=None, gt=0)
    """Rows of this table (e.g. its number of distinct values); capped by hash_size."""
    dim: int | None = Field(default=None, gt=0)
    """Embedding dim of this table."""
    pooling: Literal["sum", "mean"] | None = None
    """Pooling of multi-hot bags for this table."""
    ids: IdMode | None = None
    """This table's id mode (see [embedding] ids)."""
    admit_after: int | None = Field(default=None, ge=1)
    """Dynamic ids: this table's admission threshold (see [embedding] admit_after)."""
    evict: EvictPolicy | None = None
    """Dynamic ids: this table's eviction policy (see [embedding] evict)."""
    ttl_steps: int | None = Field(default=None, ge=1)
    """Dynamic ids: this table's expiry (see [embedding] ttl_steps)."""
    shared_rows: float | None = Field(default=None, ge=0, lt=1)
    """Dynamic ids: this table's fraction of hashed shared rows (see [embedding] shared_rows)."""
    start_from_shared: bool | None = None
    """Dynamic ids: whether this table's admitted ids start from their shared row (see
    [embedding])."""


class EmbeddingConfig(Section):
    """The embedding tables and their fused optimizer."""

    dim: int = flag(16, "--embedding-dim", gt=0)
    """Embedding dim of every table without an override (DLRM's Kaggle model uses 16)."""
    hash_size: int = flag(1_000_000, "--hash-size", gt=0)
    """Rows per table; a table with its own ``rows`` gets min(rows, hash_size)."""
    pooling: Literal["sum", "mean"] = "sum"
    """Pooling of multi-hot bags."""
    ids: IdMode = "hashed"
    """hashed: row = id % rows (ids collide once the vocabulary outgrows the table); dynamic:
    raw 64-bit ids, each admitted id a row of its own while it holds one, the table's rows its
    capacity (its first rows, ``shared_rows``, shared by hash by ids not admitted),
    ``embedding_server/idmap/``. Per table:
    ``[[embedding.tables]] ids``."""
    admit_after: int = Field(default=1, ge=1)
    """Dynamic ids: occurrences (training lookups, count-min sketch) before an id gets its own
    row; 1 admits every id at first sight."""
    evict: EvictPolicy = "lru"
    """Dynamic ids, when every row is taken: lru (least recently used rows go), lfu (least
    used), ttl (only rows unused for ttl_steps; none: new ids share row 0 meanwhile)."""
    ttl_steps: int = Field(default=10_000, ge=1)
    """Dynamic ids, evict = ttl: training steps after which an unused id loses its row."""
    shared_rows: float = Field(default=0.1, ge=0, lt=1)
    """Dynamic ids: fraction of each dynamic table's rows kept as hashed shared rows; an id
    without a row of its own (not admitted, evicted, unseen) uses shared row hash(id) % S at
    training and serving alike, so the tail scatters instead of piling on one row; 0: one
    shared row (row 0). More shared rows take rows from admitted ids: 0.25 lost 0.004 AUC to
    hashing on the Criteo sample at 2,000 rows per table (README, Results)."""
    start_from_shared: bool = True
    """Dynamic ids: an admitted id's fresh row starts as a copy of its shared row (False: from a
    hash of the id); its optimizer state starts fresh either way."""
    tables: list[TableOverride] = []
    """Per-table overrides, e.g. ``{name = "C3", rows = 10000000, dim = 32}``."""
    init_scale: float = Field(default=0.05, ge=0)
    """Initial weights are uniform(+-init_scale) (Keras's default); 0: uniform(+-sqrt(1/rows)),
    the TorchRec / DLRM-reference rule, which starts large tables near zero and learns slower."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the tables live: host memory (the parameter-node default) or GPU memory."""
    optimizer: SparseOptimizerConfig = SparseOptimizerConfig()
    """Fused optimizer of the embedding rows."""


class DistConfig(Section):
    """Embedding servers and trainers in one torch.distributed world."""

    embedding_servers: int = flag(0, "--embedding-servers", ge=0)
    """Embedding-server ranks (0: tables in the trainer process)."""
    trainers: int = flag(1, "--trainers", ge=1)
    """Trainer ranks (data parallel; DDP over the dense network)."""
    sharding: Literal["auto", "table_wise", "row_wise", "column_wise"] = flag("auto", "--sharding")
    """Placement of tables on servers (auto: whole tables, balanced; row-wise when too large)."""
    server_memory: str | None = flag(None, "--server-memory")
    """Memory each embedding server may use for tables and optimizer state, e.g. "8GB"."""
    timeout_s: float = Field(default=60.0, gt=0)
    """A lost rank (dead, or silent: stopped, hung, cut off) ends the job within this many seconds,
    naming it (never a hang); also the timeout of every step's collectives."""
    join_timeout_s: float = Field(default=600.0, gt=0)
    """How long ranks wait for each other at start-up (they may start in any order)."""
    pipeline: Literal["off", "exact", "semi-sync"] = flag("exact", "--pipeline")
    """exact: the next batch's ids travel, and the servers look it up, while the trainers compute
    the current one (results identical to off); semi-sync: lookups do not wait for the previous
    step's update (one step stale); off: lockstep. The hierarchical route is always lockstep.
    In one process (no servers), exact and semi-sync both remap the next batch's ids of dynamic
    tables during this step where the dense step leaves a core for it (a GPU, or train.threads
    below the cores: ``idmap/ahead.py``, exact either way)."""
    corrected_lookups: bool = True
    """exact: look the next batch up before the previous update and then send only the bags that
    update changed, looked up again (``correction.py``; false: wait for the update, then look
    up)."""
    exchange_chunks: int = Field(default=0, ge=0)
    """Pooled-vector and gradient messages per trainer/server pair and step (0: auto, 4 when some
    trainer and server are on different hosts, else 1): a chunk's gradients are applied, and its
    rows looked up again, while the next chunk is on the wire, so that the two directions of a
    link overlap. Towers and the hierarchical route use 1 (more is refused with --hierarchical)."""
    heartbeat_s: float = Field(default=1.0, gt=0)
    """Seconds between a rank's heartbeats through the rendezvous store (its liveness signal)."""
    io_min_bytes_per_s: float = Field(default=20e6, gt=0)
    """The slowest storage throughput still counted as progress: restoring, publishing and
    finishing a checkpoint may take timeout_s + their bytes / this, then count as stuck."""
    exchange_dtype: Literal["fp32", "fp16", "bf16"] = flag("fp32", "--exchange-dtype")
    """Type of pooled embeddings and gradients on the wire (fp16/bf16 halve the bytes)."""
    hosts: int = flag(0, "--hosts", ge=0)
    """Emulated hosts: trainers and servers each split in this many contiguous blocks, one per
    host (0: one host per machine, by DLRM_HOST or the hostname)."""
    topology: str | None = flag(None, "--topology")
    """Topology file, JSON {"hosts": [[ranks of host 0], ...]}; overrides ``hosts``."""
    hierarchical: bool = flag(False, "--hierarchical")
    """Route the trainer/server all-to-all through host-mates (intra-host, then one message per
    peer pair across hosts); needs as many ranks on every host."""
    towers: str | None = flag(None, "--towers")
    """Tower plan file (``dlrm plan-towers``): features grouped into towers whose tower modules
    run on the embedding servers and compress the embeddings before they leave (DMT)."""
    tower_compress: int = flag(0, "--tower-compress", ge=0)
    """Outputs c_t of every tower module, capped at the tower's features (0: as in the plan
    file)."""
    tower_dim: int = flag(0, "--tower-dim", ge=0)
    """Dim D' of the tower modules' output vectors, a learned projection of the tables' D; it
    compresses without merging features (0: D, no projection)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address (local launch; torchrun sets MASTER_ADDR itself)."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Rendezvous port (0: a free port, local launch only)."""


class LiveConfig(Section):
    """Live updates to a serving store while training runs."""

    store: str | None = flag(None, "--live-store")
    """Serving store URL (redis://... or file://...); None: no live updates."""
    push_every_s: float = Field(default=1.0, gt=0)
    """Seconds between pushes of the rows changed since the last push."""
    dense_every_s: float = Field(default=10.0, gt=0)
    """Seconds between pushes of the dense weights."""
