"""Typed configuration of a training run: sections, one docstring per field.

Precedence: command-line flags > TOML file (``--config``) > the defaults below. A TOML file has
one table per section (``[data]``, ``[embedding]``, ``[model]``, ``[optim]``, ``[train]``);
unknown keys are errors, with a suggestion when a known key is close.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from embedding_server.errors import ConfigError
from embedding_server.features import FeatureSpec, TableSpec
from embedding_server.optimizers import SparseOptimizerConfig

CRITEO_DENSE = 13
CRITEO_SPARSE = 26


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class DataConfig(_Section):
    """How training and test files are read."""

    num_workers: int = Field(default=2, ge=0)
    """Background threads parsing blocks of the input files (0: parse in the loader thread)."""
    block_bytes: int = Field(default=4 << 20, ge=1 << 12)
    """Bytes of text parsed at once; with num_workers and prefetch_batches it bounds memory."""
    prefetch_batches: int = Field(default=8, ge=1)
    """Batches assembled ahead of the training step."""
    strict: bool = False
    """Stop at the first malformed line (naming file and line) instead of skipping it."""
    multi_hot_sep: str | None = None
    """Separator of several values in one categorical cell (multi-hot bags); None: one value."""


class TableOverride(_Section):
    """Per-table settings that differ from the [embedding] defaults."""

    name: str
    """Table (feature) name, C1..C26."""
    rows: int | None = Field(default=None, gt=0)
    """Rows of this table (e.g. its number of distinct values); capped by hash_size."""
    dim: int | None = Field(default=None, gt=0)
    """Embedding dim of this table."""
    pooling: Literal["sum", "mean"] | None = None
    """Pooling of multi-hot bags for this table."""


class EmbeddingConfig(_Section):
    """The embedding tables and their fused optimizer."""

    dim: int = Field(default=16, gt=0)
    """Embedding dim of every table without an override (DLRM's Kaggle model uses 16)."""
    hash_size: int = Field(default=1_000_000, gt=0)
    """Rows per table; a table with its own ``rows`` gets min(rows, hash_size)."""
    pooling: Literal["sum", "mean"] = "sum"
    """Pooling of multi-hot bags."""
    tables: list[TableOverride] = []
    """Per-table overrides, e.g. ``{name = "C3", rows = 10000000, dim = 32}``."""
    init_scale: float = Field(default=0.05, ge=0)
    """Initial weights are uniform(+-init_scale) (Keras's default); 0: uniform(+-sqrt(1/rows)),
    the TorchRec / DLRM-reference rule, which starts large tables near zero and learns slower."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the tables live: host memory (the parameter-node default) or GPU memory."""
    optimizer: SparseOptimizerConfig = SparseOptimizerConfig()
    """Fused optimizer of the embedding rows."""


class ModelConfig(_Section):
    """The dense network: DenseArch -> InteractionArch -> OverArch."""

    kind: Literal["dlrm", "lr"] = "dlrm"
    """dlrm (embeddings + MLPs + interaction) or lr (logistic regression on hashed features:
    one weight per row and a linear dense term; the quality baseline)."""
    interaction: Literal["dot", "dcn"] = "dot"
    """dot: DLRM pairwise dot products; dcn: DCN-v2 cross layers over all features."""
    dense_arch_layer_sizes: list[int] = [512, 256, 64]
    """Hidden sizes of the bottom MLP; an output layer of the embedding dim is appended."""
    over_arch_layer_sizes: list[int] = [512, 256]
    """Hidden sizes of the top MLP; an output layer of size 1 (the logit) is appended."""
    dcn_num_layers: int = Field(default=3, ge=1)
    """DCN-v2 cross layers (interaction = dcn)."""
    dcn_low_rank: int = Field(default=512, ge=0)
    """Rank of each DCN-v2 cross layer's weight (0: full rank)."""


class DenseOptimizerConfig(_Section):
    """Optimizer of the dense parameters (MLPs and interaction)."""

    kind: Literal["adam", "adagrad", "sgd"] = "adam"
    """adam, adagrad or sgd."""
    lr: float = Field(default=3e-3, gt=0)
    """Learning rate of the dense parameters."""
    weight_decay: float = Field(default=0.0, ge=0)
    """L2 weight decay of the dense parameters."""
    eps: float = Field(default=1e-8, gt=0)
    """Denominator epsilon of Adam/Adagrad."""


class TrainConfig(_Section):
    """The training loop."""

    epochs: int = Field(default=1, ge=1)
    """Passes over the training files."""
    batch_size: int = Field(default=512, ge=1)
    """Examples per step (512: the best one-epoch AUC in bench/quality.py; 2048 is faster)."""
    eval_batch_size: int = Field(default=16384, ge=1)
    """Examples per evaluation forward pass."""
    eval_every_steps: int = Field(default=0, ge=0)
    """Evaluate on the test set every this many steps (0: only at the end of each epoch)."""
    eval_max_rows: int = Field(default=200_000, ge=0)
    """Rows of the test set used by periodic evaluations (0: all); the final one uses all."""
    checkpoint_every_steps: int = Field(default=1000, ge=0)
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk; older ones are deleted."""
    max_steps: int = Field(default=0, ge=0)
    """Stop after this many steps in all (0: run all epochs); a resumed run counts from 0."""
    seed: int = 0
    """Seed of the initialisation of every table and layer."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the dense network: auto picks cuda when available."""
    threads: int = Field(default=0, ge=0)
    """Intra-op threads of the dense network (0: PyTorch's default, one per core)."""
    progress: bool = True
    """Show a progress bar (samples/s, running loss)."""
    log_step_losses: bool = False
    """Record every step's loss in metrics.json (``step_losses``), for comparing runs."""


class DistConfig(_Section):
    """Embedding servers and trainers in one torch.distributed world."""

    embedding_servers: int = Field(default=0, ge=0)
    """Embedding-server ranks (0: tables in the trainer process)."""
    trainers: int = Field(default=1, ge=1)
    """Trainer ranks (data parallel; DDP over the dense network)."""
    sharding: Literal["auto", "table_wise", "row_wise", "column_wise"] = "auto"
    """Placement of tables on servers (auto: whole tables, balanced; row-wise when too large)."""
    server_memory: str | None = None
    """Memory each embedding server may use for tables and optimizer state, e.g. "8GB"."""
    timeout_s: float = Field(default=60.0, gt=0)
    """A lost rank ends the job within this many seconds, naming it (never a hang)."""
    join_timeout_s: float = Field(default=600.0, gt=0)
    """How long ranks wait for each other at start-up (they may start in any order)."""
    exchange_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """Type of pooled embeddings and gradients on the wire (fp16/bf16 halve the bytes)."""
    hosts: int = Field(default=0, ge=0)
    """Emulated hosts: trainers and servers each split in this many contiguous blocks, one per
    host (0: one host per machine, by DLRM_HOST or the hostname)."""
    topology: str | None = None
    """Topology file, JSON {"hosts": [[ranks of host 0], ...]}; overrides ``hosts``."""
    hierarchical: bool = False
    """Route the trainer/server all-to-all through host-mates (intra-host, then one message per
    peer pair across hosts); needs as many ranks on every host."""
    towers: str | None = None
    """Tower plan file (``dlrm plan-towers``): features grouped into towers whose tower modules
    run on the embedding servers and compress the embeddings before they leave (DMT)."""
    tower_compress: int = Field(default=0, ge=0)
    """Outputs c_t of every tower module, capped at the tower's features (0: as in the plan file)."""
    tower_dim: int = Field(default=0, ge=0)
    """Dim D' of the tower modules' output vectors, a learned projection of the tables' D; it
    compresses without merging features (0: D, no projection)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address (local launch; torchrun sets MASTER_ADDR itself)."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Rendezvous port (0: a free port, local launch only)."""


class LiveConfig(_Section):
    """Live updates to a serving store while training runs."""

    store: str | None = None
    """Serving store URL (redis://... or file://...); None: no live updates."""
    push_every_s: float = Field(default=1.0, gt=0)
    """Seconds between pushes of the rows changed since the last push."""
    dense_every_s: float = Field(default=10.0, gt=0)
    """Seconds between pushes of the dense weights."""


class Config(_Section):
    """A whole training run."""

    data: DataConfig = DataConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    model: ModelConfig = ModelConfig()
    optim: DenseOptimizerConfig = DenseOptimizerConfig()
    train: TrainConfig = TrainConfig()
    live: LiveConfig = LiveConfig()
    dist: DistConfig = DistConfig()

    def feature_spec(self) -> FeatureSpec:
        """The Criteo schema with this config's tables (rows, dims, pooling)."""
        emb = self.embedding
        overrides = {t.name: t for t in emb.tables}
        names = [f"C{i + 1}" for i in range(CRITEO_SPARSE)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ConfigError(f"config: embedding.tables: unknown table {unknown[0]!r} (tables are C1..C26)")
        tables = []
        for name in names:
            o = overrides.get(name, TableOverride(name=name))
            rows = min(o.rows, emb.hash_size) if o.rows else emb.hash_size
            dim = 1 if self.model.kind == "lr" else (o.dim or emb.dim)
            tables.append(TableSpec(name=name, rows=rows, dim=dim, pooling=o.pooling or emb.pooling))
        return FeatureSpec(
            dense=[f"I{i + 1}" for i in range(CRITEO_DENSE)],
            tables=tables,
            multi_hot_sep=self.data.multi_hot_sep,
        )


def _suggest(key: str, section: type[BaseModel] | None) -> str:
    if section is None:
        return ""
    close = difflib.get_close_matches(key, list(section.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _section_of(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def format_validation_error(exc: ValidationError, source: str) -> str:
    """The first error as one line: ``<source>: <section.field>: <what is wrong>``."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{source}: {where}: unknown setting{_suggest(str(loc[-1]), _section_of(loc))}"
    got = err.get("input")
    got_txt = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{source}: {where}: {err['msg']}{got_txt}{more}"


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``section.field=value`` (value in TOML syntax, bare words as strings) -> nested dict."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    node: dict[str, Any] = {}
    out = node
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return out


def load_config(path: Path | str | None = None, overrides: list[dict[str, Any]] | None = None) -> Config:
    """Defaults, then the TOML file, then each override (nested dicts), validated once.

    Raises:
        ConfigError: naming the file (or ``--set``/flag) and the offending setting.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
    for override in overrides or []:
        data = _deep_merge(data, override)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "command line")) from None
