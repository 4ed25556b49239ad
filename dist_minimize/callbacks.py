"""Keras callbacks for dist_minimize optimizers."""

from __future__ import annotations

from typing import Any

import keras


class GradientStatsLogger(keras.callbacks.Callback):
    """Adds the epoch's gradient statistics to `model.fit`'s logs (and TensorBoard).

    For a model compiled with a dist_minimize optimizer, each epoch's logs gain:

    * `grad_norm`: mean pre-clip global norm over the epoch's finite steps, and
      `clipped_share`: share of those steps that were clipped (with a
      `clip_by_global_norm` clipper in `transform_gradients`);
    * `skipped_steps`: steps skipped by the non-finite guard during the epoch;
    * `loss_scale`: the scale at the end of the epoch (with `LossScaleOptimizer`).

    The statistics are read from optimizer state once per epoch (no per-batch host
    synchronisation). Under Horovod, give it only to rank 0 for TensorBoard
    (`dm.horovod_keras.root_only`); the values are the same on every rank.

    Args:
      verbose: also print one line of statistics after each epoch (they are in the
        logs, so Keras's own progress line shows them already).
      log_dir: if given, also write the statistics there as TensorBoard scalars
        (`gradients/<name>`, one point per epoch).
    """

    def __init__(self, verbose: bool = False, log_dir: str | None = None):
        super().__init__()
        if log_dir is not None:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError(
                    "`log_dir` needs TensorBoard (tf.summary writes through it), which is not "
                    f"installed: pip install tensorboard. Received: log_dir={log_dir!r}")
        self.verbose = verbose
        self.log_dir = log_dir
        self._writer = None
        self._start: dict = {}

    def _read(self) -> dict:
        stats = getattr(self.model.optimizer, "gradient_stats", None)
        if stats is None:
            raise TypeError(
                "GradientStatsLogger needs a model compiled with a dist_minimize optimizer. "
                f"Received: optimizer={type(self.model.optimizer).__name__}")
        return {k: float(v) for k, v in stats().items()}

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._read() if self.model.optimizer.built else {}

    def on_epoch_end(self, epoch, logs=None):
        now = self._read()
        start = self._start or {k: 0.0 for k in now}
        delta = {k: now[k] - start.get(k, 0.0) for k in ("norm_sum", "steps", "clipped_steps", "skipped_steps") if k in now}
        epoch_stats = {}
        if delta.get("steps"):
            epoch_stats["grad_norm"] = delta["norm_sum"] / delta["steps"]
            epoch_stats["clipped_share"] = delta["clipped_steps"] / delta["steps"]
        if "skipped_steps" in delta:
            epoch_stats["skipped_steps"] = delta["skipped_steps"]
        if "loss_scale" in now:
            epoch_stats["loss_scale"] = now["loss_scale"]
        if logs is not None:
            logs.update(epoch_stats)
        if self.log_dir and epoch_stats:
            import tensorflow as tf

            if self._writer is None:
                self._writer = tf.summary.create_file_writer(self.log_dir)
            with self._writer.as_default(step=epoch):
                for k, v in epoch_stats.items():
                    tf.summary.scalar(f"gradients/{k}", v)
            self._writer.flush()
        if self.verbose and epoch_stats:
            print(f"epoch {epoch + 1}: " + ", ".join(
                f"{k}={int(v)}" if k == "skipped_steps" else f"{k}={v:.4g}"
                for k, v in epoch_stats.items()), flush=True)


class AveragedWeights(keras.callbacks.Callback):
    """Evaluates and/or saves with a `MovingAverage` or `SWA` optimizer's averages.

    At the end of every `every_n_epochs`-th epoch it swaps the averages into the model,
    evaluates on `validation_data` (adding `averaged_<metric>` to the epoch's logs)
    and/or saves the model to `filepath` (formatted with `epoch`, 1-based), then puts
    the training weights back, so training continues unchanged. Under Horovod, save on
    rank 0 only (`dm.horovod_keras.root_only`), but evaluate on every rank.

    Args:
      validation_data: what `model.evaluate` takes as `x` (a dataset, or `(x, y)`).
      filepath: where to save, e.g. `"averaged-{epoch:02d}.keras"`.
      every_n_epochs: how often (>= 1).

    Raises:
      ValueError: neither `validation_data` nor `filepath`, or `every_n_epochs` < 1.
    """

    def __init__(self, validation_data: Any = None, filepath: str | None = None, every_n_epochs: int = 1):
        super().__init__()
        if validation_data is None and filepath is None:
            raise ValueError("`AveragedWeights` needs `validation_data`, `filepath` or both. "
                             "Received: validation_data=None, filepath=None")
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"`every_n_epochs` must be an integer >= 1. Received: every_n_epochs={every_n_epochs!r}")
        self.validation_data = validation_data
        self.filepath = filepath
        self.every_n_epochs = every_n_epochs

    def _averaging(self):
        from dist_minimize.wrappers.averaging import AveragingWrapper

        opt = getattr(self.model, "optimizer", None)
        found = opt.find(AveragingWrapper) if hasattr(opt, "find") else None
        if found is None:
            raise ValueError("`AveragedWeights` needs a model compiled with a `dist_minimize.MovingAverage` or "
                             f"`dist_minimize.SWA` in its optimizer stack. Received: {type(opt).__name__}")
        return found

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every_n_epochs:
            return
        with self._averaging().averaged_weights():
            if self.validation_data is not None:
                data = self.validation_data
                if isinstance(data, tuple):
                    results = self.model.evaluate(*data, verbose=0, return_dict=True)
                else:
                    results = self.model.evaluate(data, verbose=0, return_dict=True)
                if logs is not None:
                    logs.update({f"averaged_{k}": float(v) for k, v in results.items()})
            if self.filepath is not None:
                self.model.save(self.filepath.format(epoch=epoch + 1))
