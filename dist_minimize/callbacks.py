"""Keras callbacks for dist_minimize optimizers."""

from __future__ import annotations

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
