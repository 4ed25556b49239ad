"""Keras callbacks for dist_minimize optimizers."""

from __future__ import annotations

import keras


class GradientStatsLogger(keras.callbacks.Callback):
    """Adds the epoch's gradient statistics to `model.fit`'s logs and prints them.

    For a model compiled with a dist_minimize optimizer whose `transform_gradients`
    holds a `clip_by_global_norm` clipper, each epoch's logs gain:

    * `grad_norm`: mean pre-clip global norm over the epoch's finite steps;
    * `clipped_share`: share of the epoch's steps that were clipped;
    * `skipped_steps`: steps skipped by the non-finite guard during the epoch.

    The statistics are read from optimizer state once per epoch (no per-batch host
    synchronisation). Keras's progress bar has already printed when `on_epoch_end`
    runs, so with `verbose=True` the callback prints one line of its own.

    Args:
      verbose: also print one line of statistics after each epoch (they are in the
        logs, so Keras's own progress line shows them already).
    """

    def __init__(self, verbose: bool = False):
        super().__init__()
        self.verbose = verbose
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
        if logs is not None:
            logs.update(epoch_stats)
        if self.verbose and epoch_stats:
            print(f"epoch {epoch + 1}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) and k != "skipped_steps" else f"{k}={int(v)}"
                for k, v in epoch_stats.items()), flush=True)
