"""Early stopping and the best model, by validation log loss.

After each evaluation on the validation rows (``evaluation.py``) the trainer asks
:class:`BestModel` whether to go on. A log loss better than every earlier one is the new best;
with ``train.keep_best`` its full checkpoint is written at once and named in
``checkpoints/best``, which pruning keeps. After ``train.patience`` evaluations in a row without
a better one, training stops (Keras's ``EarlyStopping``, LightGBM's ``early_stopping_rounds``).

At the end of a run whose best is not its last model, the best comes back (the tables wherever
they live, the dense model, both optimizers), the test set is scored on it, and the checkpoints
after it are removed: the best is the run's last checkpoint, the one ``dlrm publish`` publishes
(CatBoost's ``use_best_model``). Every trainer sees the same figures (``evaluate`` gathers them
all), so every trainer takes the same decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dense_trainer.checkpointing import checkpoint_with, restore_weights
from dense_trainer.evaluation import evaluate_into_history
from embedding_server.checkpoint.files import make_latest, mark_best, step_name

log = logging.getLogger(__name__)


class BestModel:
    """The best validation evaluation of ``trainer``'s run (kept in its ``TrainState``, so that a
    resumed run goes on counting)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.on_evaluation: Callable[[dict[str, float], int], bool] | None = None
        """Called after each validation evaluation with its figures and step; True stops
        training there, the best model kept (``dlrm tune`` prunes a trial so)."""

    def validate(self, steps) -> bool:
        """Evaluate on the validation rows unless there are none or this step's model has been
        evaluated already, and keep the best; True: stop training (early stopping).
        ``steps``: the training ``Steps`` (a best model's checkpoint records their positions)."""
        t = self.trainer
        done = [h for h in t.state.history if "valid_logloss" in h]
        if t.validation is None or t.state.step == 0 or (done and done[-1]["step"] == t.state.step):
            return False
        return self.after_evaluation(evaluate_into_history(t, t.validation, final=False), steps)

    def after_evaluation(self, result: dict[str, float], steps) -> bool:
        """Record a validation ``result`` (a new best is checkpointed with ``steps``' positions).
        Returns True when training should stop (the patience is spent)."""
        t = self.trainer
        s, cfg = t.state, t.cfg.train
        loss = result["valid_logloss"]
        if s.best is None or loss < s.best["valid_logloss"]:
            s.best = {"step": s.step, "samples": s.samples_seen, **result}
            s.evals_since_best = 0
            if cfg.keep_best:
                path = checkpoint_with(t, steps)
                if t.is_master and path is not None:
                    mark_best(t.checkpoint_dir, path)
        else:
            s.evals_since_best += 1
        stop = bool(cfg.patience) and s.evals_since_best >= cfg.patience
        if stop:
            log.info(
                "early stop at step %d: %d evaluations without a better validation log loss "
                "(best %.5f at step %d)",
                s.step,
                s.evals_since_best,
                s.best["valid_logloss"],
                s.best["step"],
            )
        if self.on_evaluation is not None and self.on_evaluation(result, s.step):
            stop = True
        if stop:
            s.stopped_early = s.step
        return stop

    @property
    def restore_due(self) -> bool:
        """Whether the run must end on an earlier model than its current one."""
        s = self.trainer.state
        return self.trainer.cfg.train.keep_best and s.best is not None and s.best["step"] != s.step

    def restore(self) -> None:
        """Every trainer calls this once nothing is being written: the best model back, and its
        checkpoint made the run's last."""
        t = self.trainer
        path = t.checkpoint_dir / step_name(t.state.best["step"])
        restore_weights(t, path)
        if t.is_master:  # the others go on to the test set meanwhile: only the master writes here
            make_latest(t.checkpoint_dir, path)
