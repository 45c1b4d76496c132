"""Typed configuration of a training run: sections, one docstring per field.

Precedence: command-line flags > TOML file (``--config``) > the defaults below. A TOML file has
one table per section: ``[data]``, ``[model]``, ``[train]`` (here), ``[optim]`` (the dense
optimizer), ``[schedule]`` (both optimizers' rates: ``lr_schedule.py``), ``[embedding]``,
``[dist]``, ``[live]`` (the parameter node's, in ``embedding_server``), ``[stream]`` (online
training: ``data/stream/config.py``). Unknown keys are errors,
with a suggestion when a known key is close; ``dlrm train --help`` lists every field as a flag
(``dlrm_core.config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from dense_trainer.data.stream.config import StreamConfig
from dense_trainer.lr_schedule import ScheduleConfig
from dlrm_core import config as core_config
from dlrm_core.config import Section, flag, parse_override
from dlrm_core.errors import ConfigError
from dlrm_core.schema import Column, Feature, FeatureSpec, FormatName, build_spec, criteo_features
from embedding_server.config import DistConfig, EmbeddingConfig, LiveConfig
from embedding_server.kernels.optimizer_config import DenseOptimizerConfig


class DataConfig(Section):
    """How training and test files are read."""

    num_workers: int = Field(default=2, ge=0)
    """Background threads parsing blocks of the input files (0: parse in the loader thread)."""
    block_bytes: int = Field(default=4 << 20, ge=1 << 12)
    """Bytes of text parsed at once; with num_workers and prefetch_batches it bounds memory."""
    prefetch_batches: int = Field(default=8, ge=1)
    """Batches assembled ahead of the training step."""
    strict: bool = flag(False, "--strict")
    """Stop at the first malformed line (naming file and line) instead of skipping it."""
    interleave: int = Field(default=0, ge=0)
    """A single process reads the input as this many trainers would (each its blocks modulo the
    count) and trains on the same global batches: to compare with a run of that many trainers."""
    multi_hot_sep: str | None = None
    """The Criteo layout's multi-hot separator of C1..C26 cells (a schema sets its own per
    feature); None: one value per cell."""


class ModelConfig(Section):
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
    wide: bool = True
    """Add a linear term over the dense features and the pooled embeddings to the logit (Wide &
    Deep's wide part): each id's first-order effect, which dot products learn slowly (on the
    generated tables of ``bench/defaults.py`` it lowered validation log loss on every one)."""
    first_order: bool = True
    """Give every id a scalar weight of its own, summed into the logit (the first-order term of
    factorization machines and DeepFM, what logistic regression learns): each table gives one
    column, its first, and the other dim - 1 feed the interaction (tables keep their dim, a
    multiple of 4 as fbgemm's kernels and the int8 rows want). A dot product
    of learned vectors carries an id's own effect only slowly, tangled with its interactions
    (bench/defaults.py: mean test AUC +0.002 over nine data sets, higher on six, up to +0.010
    on the Avazu sample). Off with a tower plan
    (``dist.towers``): tower modules see the tables' vectors whole."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout after each hidden layer of the over arch (training only)."""


class TrainConfig(Section):
    """The training loop."""

    epochs: int = flag(3, "--epochs", ge=1)
    """Passes over the training files, at most: early stopping may end sooner, and the model
    kept is the best by validation (3: on every generated data set of bench/epochs.py the best
    came at the end of epoch 2)."""
    batch_size: int = flag(512, "--batch-size", ge=1)
    """Examples per step (512: the best one-epoch AUC in bench/quality.py; 2048 is faster)."""
    eval_batch_size: int = Field(default=16384, ge=1)
    """Examples per evaluation forward pass."""
    validation: float = flag(0.05, "--validation", ge=0, lt=1)
    """Share of the training rows held out for validation, chosen by a hash of file and line
    (every trainer and every rerun agrees; ``dense_trainer/data/split.py``). Evaluations during
    training read only these rows; the test files are scored once, at the end, on the model
    kept. 0: none (no evaluation before the end, no early stopping). Unused with ``--valid``."""
    valid_files: list[str] = flag([], "--valid")
    """Validation files, instead of a share of the training rows (which are then all trained on)."""
    eval_every_steps: int = Field(default=0, ge=0)
    """Evaluate on the validation rows every this many steps (0: at the end of each epoch only)."""
    eval_max_rows: int = Field(default=200_000, ge=0)
    """Validation rows read by each evaluation (0: all of them)."""
    patience: int = flag(2, "--patience", ge=0)
    """Stop after this many evaluations in a row without a better validation log loss (Keras's
    ``EarlyStopping(patience)``); 0: train every epoch."""
    keep_best: bool = True
    """End with the model of the best validation log loss (CatBoost's ``use_best_model``): it is
    restored before the test set is scored, and the run's last checkpoint, which ``dlrm
    publish`` publishes, holds it. False: the last model."""
    checkpoint_every_steps: int = Field(default=1000, ge=0)
    """Write a full checkpoint every this many steps (0: only at the end). Checkpoints are written
    in the background while training goes on; one due while the previous is still being written
    is skipped."""
    checkpoint_every_s: float = Field(default=0.0, ge=0)
    """Also write a full checkpoint every this many seconds (0: by steps only)."""
    checkpoint_delta_every_s: float = Field(default=0.0, ge=0)
    """Between full checkpoints, write a delta every this many seconds: the rows changed since
    the last checkpoint and the dense state, so that a lost job redoes at most about this much
    work (0: no deltas)."""
    checkpoint_max_deltas: int = Field(default=30, ge=1)
    """A chain of this many deltas is compacted: the next checkpoint is a full one (a restore
    reads the full checkpoint and its deltas)."""
    checkpoint_write_bytes_per_s: float = Field(default=0.0, ge=0)
    """Rate limit of every process's background checkpoint writes (0: none), to leave the disk
    to the input pipeline."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Full checkpoints kept on disk (with the deltas of the newest); older ones are deleted."""
    max_steps: int = Field(default=0, ge=0)
    """Stop after this many steps in all (0: run all epochs); a resumed run counts from 0."""
    seed: int = 0
    """Seed of the initialisation of every table and layer."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the dense network: auto picks cuda when available."""
    threads: int = Field(default=0, ge=0)
    """Intra-op threads of the dense network (0: PyTorch's default, one per core)."""
    progress: bool = flag(True, "--no-progress")
    """Show a progress bar (samples/s, running loss)."""
    log_step_losses: bool = False
    """Record every step's loss in metrics.json (``step_losses``), for comparing runs."""


class Config(Section):
    """A whole training run: the input schema (top level), then one section per part."""

    format: FormatName = flag("criteo", "--format")
    """Input format: criteo (TSV, no header), csv or tsv (a header line), parquet."""
    label: Column | None = flag(None, "--label")
    """The label column (0/1), by header name or 0-based index; the Criteo layout's is column 0."""
    ignore: list[Column] = []
    """Columns that are not features (ids, timestamps): `dlrm data schema` leaves them out."""
    columns: list[str] | None = None
    """Column names of headerless input (read from the header of CSV / TSV / Parquet files)."""
    header: bool | None = None
    """Delimited text: whether the first line names the columns (default: csv and tsv yes)."""
    delimiter: str | None = None
    """Delimited text: the field separator (default: csv ",", tsv and criteo TAB)."""
    features: list[Feature] | None = None
    """The features, ``[[features]]`` (see dlrm_core/schema.py); default: the Criteo layout,
    I1..I13 (log1p of integer counts) and C1..C26 (hex categoricals)."""
    data: DataConfig = DataConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    model: ModelConfig = ModelConfig()
    optim: DenseOptimizerConfig = DenseOptimizerConfig()
    train: TrainConfig = TrainConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    live: LiveConfig = LiveConfig()
    dist: DistConfig = DistConfig()
    stream: StreamConfig = StreamConfig()

    @model_validator(mode="after")
    def _first_order_fits(self) -> Config:
        """No first-order column with towers (tower modules compress the tables' whole vectors);
        with it, every table needs a column left for the interaction."""
        if self.dist.towers and self.model.first_order:
            self.model.first_order = False
        if self.model.kind == "dlrm" and self.model.first_order:
            dims = [self.embedding.dim, *(t.dim for t in self.embedding.tables if t.dim)]
            dims += [f.dim for f in self.features or [] if getattr(f, "dim", None)]
            if min(dims) < 2:
                raise ValueError(
                    f"model.first_order takes each table's first column: table dims must be at "
                    f"least 2 (one is {min(dims)}; or set model.first_order = false)"
                )
        return self

    def feature_spec(self) -> FeatureSpec:
        """The resolved schema: features, their tables (rows, dims, pooling), the input layout."""
        features = self.features
        if features is None:
            if self.format != "criteo":
                raise ConfigError(
                    f"config: a {self.format} input needs its [[features]] "
                    "(`dlrm data schema FILE --label COL --out CONFIG.toml` writes them)"
                )
            features = criteo_features(self.data.multi_hot_sep)
        if not features:
            raise ConfigError("config: features: the schema has no feature")
        emb = self.embedding
        overrides = {t.name: t.model_dump(exclude={"name"}, exclude_none=True) for t in emb.tables}
        try:
            return build_spec(
                features,
                self.format,
                self.label,
                self.ignore,
                self.columns,
                self.header,
                self.delimiter,
                table_defaults={
                    "dim": emb.dim,
                    "hash_size": emb.hash_size,
                    "pooling": emb.pooling,
                    "ids": emb.ids,
                    "admit_after": emb.admit_after,
                    "evict": emb.evict,
                    "ttl_steps": emb.ttl_steps,
                    "shared_rows": emb.shared_rows,
                    "start_from_shared": emb.start_from_shared,
                },
                table_overrides=overrides,
                force_dim=1 if self.model.kind == "lr" else None,
            )
        except ValueError as exc:
            raise ConfigError(f"config: {exc}") from None


__all__ = ["Config", "DataConfig", "ModelConfig", "TrainConfig", "load_config", "parse_override"]


def load_config(
    path: Path | str | None = None, overrides: list[dict[str, Any]] | None = None
) -> Config:
    """Defaults, then the TOML file, then each override (nested dicts), validated once.

    Raises:
        ConfigError: naming the file (or ``--set``/flag) and the offending setting.
    """
    return core_config.load_config(Config, path, overrides)


def prepare_config(cfg: Config, train_files: list[Path]) -> Config:
    """Fill in what the schema learns from the training data: the input's column names (they go
    with the model, so that serving parses lines in the same layout) and the statistics of
    ``standardize`` features. Idempotent; the Criteo layout needs nothing."""
    from dlrm_core.statistics import dense_statistics, input_columns, needs_statistics

    if cfg.features is None or not train_files:
        return cfg
    spec = cfg.feature_spec()
    update: dict[str, Any] = {}
    if cfg.columns is None and (spec.header or spec.format == "parquet"):
        update["columns"] = input_columns(spec, train_files)
    missing = needs_statistics(cfg.features)
    if missing:
        stats = dense_statistics(spec, train_files, missing)
        update["features"] = [
            f.model_copy(update={"mean": stats[f.name][0], "std": stats[f.name][1]})
            if f.name in stats
            else f
            for f in cfg.features
        ]
    return cfg.model_copy(update=update) if update else cfg
