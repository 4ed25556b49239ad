"""SAM (Foret et al., ICLR 2021) and ASAM (Kwon et al., ICML 2021): the gradient taken at
weights perturbed toward higher loss, written with the public `get_gradients(...,
loss_fn=...)` only."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms.base import check_positive_finite
from dist_minimize.wrappers.base import OptimizerWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class SAM(OptimizerWrapper):
    """Sharpness-Aware Minimization around any update rule.

    Each step, on every replica, in `get_gradients`:

    1. g = the gradient of this replica's loss at the weights w;
    2. by default g is aggregated across replicas (`aggregate_gradients`, declared as
       this wrapper's extra aggregation), so that every replica perturbs along the
       global batch's gradient and N replicas match one device on the same batch.
       `per_replica=True` keeps each replica's own g (the paper's m-sharpness, m = the
       per-replica batch: under MirroredStrategy each device's batch, under
       MultiWorkerMirroredStrategy each device of each worker, under horovodrun each
       process's batch); the result then depends on the number of replicas;
    3. e = rho * g / ||g|| (SAM), or, with `adaptive=True`, e = rho * w^2 * g / ||w * g||
       element-wise (ASAM); ||.|| is the norm over all variables together;
    4. g' = the gradient of the loss evaluated again at w + e (`loss_fn`, this replica's
       batch, transformed as the first: a loss scale cancels in e);
    5. w is restored bit for bit (from a copy, not by subtracting e), and g' goes on
       through the pipeline like any gradient: aggregated once, transformed (clipping),
       applied, skipped if not finite.

    Where the loss comes from: `minimize(loss_fn, variables)` with a callable, or
    `minimize(loss, variables, tape=tape, loss_fn=loss_fn)`; under `fit`, call
    `dist_minimize.integrate(model)` after `compile` (it passes the model's compiled
    loss as `loss_fn`). With gradient accumulation, the perturbation is made at every
    micro-step, from that micro-batch's gradient. Costs a second forward and backward
    pass per step, one extra aggregation (none with `per_replica=True`), and a copy of
    the perturbed weights. A layer whose statistics move in a forward pass (batch
    normalisation) moves them in both passes.

    Args:
      optimizer: a dist_minimize optimizer.
      rho: the neighbourhood size (> 0).
      adaptive: ASAM's element-wise scaling by |w|.
      per_replica: perturb along each replica's own gradient (m-sharpness), without the
        extra aggregation.
      epsilon: added to the norm (> 0).

    Raises:
      ValueError: a non-positive `rho` or `epsilon`, or a second SAM in the stack; at
        the first step, a loss given only as a tensor (no `loss_fn`).
    """

    shards_state = True  # per-variable work on the pairs it is given (docs/sharding.md)

    once_per_stack = True
    # SAM's own, not the update rule's (Adam has an `epsilon` too: see `KerasSurface.__setattr__`).
    epsilon: float = 1e-12

    def __init__(self, optimizer: StagedOptimizer, rho: float = 0.05, adaptive: bool = False,
                 per_replica: bool = False, epsilon: float = 1e-12, name: str | None = None):
        super().__init__(optimizer, name=name)
        self.rho = check_positive_finite("rho", rho)
        self.epsilon = check_positive_finite("epsilon", epsilon)
        self.adaptive = bool(adaptive)
        self.per_replica = bool(per_replica)

    @property
    def extra_aggregations(self) -> int:
        """1: the gradient the weights are perturbed along is aggregated (0 per replica)."""
        return 0 if self.per_replica else 1

    def get_gradients(self, loss, variables, tape, loss_fn=None):
        """The gradient at the perturbed weights (see the class docstring)."""
        if loss_fn is None:
            raise ValueError(
                "SAM evaluates the loss a second time, so it needs the loss as a function: call "
                "`optimizer.minimize(lambda: loss_of(batch), variables)`, or `minimize(loss, variables, "
                "tape=tape, loss_fn=...)`; under `model.fit`, call `dist_minimize.integrate(model)` after "
                "`model.compile` (it passes the compiled loss). Received: a tensor loss and no loss_fn")
        first = [(g, v) for g, v in super().get_gradients(loss, variables, tape, loss_fn=loss_fn) if g is not None]
        if not self.per_replica and first:
            first = self.aggregate_gradients(first)
        # One read of each weight: the copy that is put back, and ASAM's |w|.
        saved = [tf.identity(tf.convert_to_tensor(v)) for _, v in first]
        perturbed = [(v, w, e) for (_, v), w, e in zip(first, saved, self._perturbation(first, saved))]
        distribute.assign_local([(v, w + e) for v, w, e in perturbed])
        with tf.GradientTape() as again:
            value = loss_fn()
        grads = again.gradient(value, list(variables))
        with tf.control_dependencies([g for g in grads if g is not None and tf.is_tensor(g)]):
            distribute.assign_local([(v, w) for v, w, _ in perturbed])
        return list(zip(grads, variables))

    def _perturbation(self, grads_and_vars: list, weights: list) -> list:
        """e for every (gradient, variable) pair, `weights` holding the variables' values."""
        scaled = []
        for (g, _), w in zip(grads_and_vars, weights):
            g = tf.cast(tf.convert_to_tensor(g), tf.float32)
            w = tf.cast(w, tf.float32)
            scaled.append((g, w, g * tf.abs(w) if self.adaptive else g))
        # l2_loss (sum(x**2) / 2) is one fused kernel per tensor; doubling is exact.
        norm = tf.sqrt(2.0 * tf.add_n([tf.nn.l2_loss(t) for _, _, t in scaled])) if scaled else None
        out = []
        for (g, w, _), (_, v) in zip(scaled, grads_and_vars):
            e = self.rho * (tf.square(w) * g if self.adaptive else g) / (norm + self.epsilon)
            out.append(tf.cast(e, v.dtype))
        return out

    def get_config(self):
        """The wrapped optimizer and the SAM settings."""
        config = super().get_config()
        config.update(rho=self.rho, adaptive=self.adaptive, per_replica=self.per_replica, epsilon=self.epsilon)
        return config
