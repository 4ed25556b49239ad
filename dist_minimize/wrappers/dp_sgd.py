"""DP-SGD (Abadi et al. 2016): per-microbatch clipping, and Gaussian noise added once to
the global sum, after aggregation."""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.step.context import CONTEXT
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms.base import check_nonnegative, check_positive_finite, check_positive_int
from dist_minimize.wrappers.base import OptimizerWrapper

_SEED_LIMIT = 2 ** 63


@keras.saving.register_keras_serializable(package="dist_minimize")
class DifferentialPrivacy(OptimizerWrapper):
    """Differentially private SGD on any update rule, with the noise added once per step.

    The loss given to `minimize` (a tensor with its tape, or a callable) holds the
    per-example losses of this replica's batch, not reduced: shape [batch], or
    [batch, ...] whose trailing axes are reduced by their mean per example, as TF
    Privacy's Keras DP optimizers do (they reshape the loss to [microbatches, -1] and
    take the mean over the second axis), e.g. a per-timestep loss of shape [batch, T]
    (under `model.fit`: compile with a loss whose `reduction=None`, e.g.
    `keras.losses.SparseCategoricalCrossentropy(reduction=None)`, and call
    `dist_minimize.integrate(model)`). One step:

    1. each replica takes each example's loss (the mean over its trailing axes),
       splits its batch into `num_microbatches` microbatches of
       consecutive examples (default: one per example) and takes each microbatch's
       mean loss (`transform_loss`);
    2. the gradient of each microbatch loss, vectorised (`tf.GradientTape.jacobian`,
       which uses `pfor`: one batched computation, not a Python loop), is clipped to L2
       norm `l2_norm_clip` over all variables together, and the clipped gradients are
       summed (`get_gradients`);
    3. the aggregation backend sums these sums across replicas and processes;
    4. Gaussian noise of standard deviation `noise_multiplier * l2_norm_clip` is added
       ONCE to that global sum, and the result is divided by the number of microbatches
       in the global batch (`transform_gradients`; then the wrapped transforms, e.g. a
       global-norm clipper, and the update).

    So the noise does not grow with the number of replicas (each replica adding its
    own noise before aggregation would multiply its standard deviation by the square
    root of their number). Every replica and process draws the same noise without
    communicating: `tf.random.stateless_normal` with the seed `(noise_seed,
    noise_draws)`, folded with the variable's position (`stateless_fold_in`), where
    `noise_seed` and the draw counter `noise_draws` are replicated optimizer
    variables; the counter advances by one per update (applied or skipped). With
    `seed=None` the seed comes from `os.urandom` at construction; under Horovod rank 0's
    seed is broadcast to every process at `build`, and under MultiWorkerMirroredStrategy
    the strategy gives every worker the chief's initial value. Both variables are
    checkpointed, so a resumed run draws the same noise as an uninterrupted one. A
    party that holds the optimizer state and the data can recompute the noise: publish
    the model's weights, not the optimizer's state.

    Scaling: the per-replica result of step 2 is divided by (microbatches on this
    replica x replicas of the strategy), the loss convention of every backend (the
    strategy backend sums, Horovod averages over processes), so after aggregation it is
    the global sum divided by the global number of microbatches. This assumes every
    replica's batch splits into the same number of microbatches (use datasets with
    `drop_remainder=True`, as DP accounting assumes a fixed batch size anyway).

    Stacking: it computes the gradients itself (the wrapped optimizers' `get_gradients`
    must not be overridden) and must be the one that adds the noise once per UPDATE:
    `DifferentialPrivacy(GradientAccumulation(LossScaleOptimizer(Optimizer(...))))`,
    outermost first; with a `LossScaleOptimizer` inside, the clipping norm is measured on
    unscaled gradients; with a `GradientAccumulation` inside, the noise is added once
    per update and divided by the microbatches of all its micro-steps. A
    `GradientAccumulation` or `LossScaleOptimizer` outside it is refused. The weight
    wrappers (averages, Lookahead, weight decay) go anywhere.

    Args:
      optimizer: a dist_minimize optimizer.
      l2_norm_clip: C, the clipping norm of each microbatch's gradient (> 0).
      noise_multiplier: the noise's standard deviation over C (>= 0; 0 turns the noise
        off, leaving per-microbatch clipping).
      num_microbatches: microbatches per replica batch (must divide the batch; checked
        at the first step), or None for one per example.
      seed: an integer in [0, 2**63) for the noise, or None (random).

    Raises:
      TypeError: `optimizer` is not a dist_minimize optimizer, or an argument of the
        wrong type.
      ValueError: `l2_norm_clip` <= 0, `noise_multiplier` < 0, `num_microbatches` < 1,
        a seed out of range, an invalid stack; at the first step, a scalar loss (or one
        of unknown rank) or a batch `num_microbatches` does not divide.
    """

    once_per_stack = True
    # Sharded (docs/sharding.md): the noise of each variable is seeded by its place in the
    # whole step (`StepContext.positions`), so a process draws for its share what the
    # unsharded step draws.
    shards_state = True
    refuses_outside = {name: (
        "{outer} must sit inside DifferentialPrivacy, not around it: DifferentialPrivacy adds "
        "its noise once per update and measures its clipping norm on unscaled gradients only "
        "when it wraps the {outer}. Write DifferentialPrivacy(GradientAccumulation("
        "LossScaleOptimizer(Optimizer(...))), ...). Received: {outer}(DifferentialPrivacy(...))")
        for name in ("GradientAccumulation", "LossScaleOptimizer")}

    def __init__(self, optimizer: StagedOptimizer, l2_norm_clip: float, noise_multiplier: float,
                 num_microbatches: int | None = None, seed: int | None = None, name: str | None = None):
        l2_norm_clip = check_positive_finite("l2_norm_clip", l2_norm_clip)
        noise_multiplier = check_nonnegative("noise_multiplier", noise_multiplier)
        if num_microbatches is not None:
            num_microbatches = check_positive_int("num_microbatches", num_microbatches)
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"`seed` must be an integer in [0, 2**63) or None. Received: seed={seed!r}")
            if not 0 <= seed < _SEED_LIMIT:
                raise ValueError(f"`seed` must be an integer in [0, 2**63) or None. Received: seed={seed!r}")
        super().__init__(optimizer, name=name)
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.num_microbatches = num_microbatches
        self.seed = seed
        self._initial_seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._noise_seed = None
        self._noise_draws = None
        self._step = _Step()

    def check_stack(self):
        """Refuses an inner optimizer that overrides `get_gradients` (this computes them)."""
        super().check_stack()
        for opt in self.wrapped.stack():
            if not getattr(type(opt).get_gradients, "_dm_default_stage", False):
                raise ValueError(
                    f"DifferentialPrivacy computes the per-microbatch gradients itself, so the "
                    f"`get_gradients` override of the wrapped {type(opt).__name__} would never run. "
                    f"Received: a {type(opt).__name__} inside DifferentialPrivacy")

    def build_state(self, var_list):
        """Creates `noise_seed` and `noise_draws` (replicated int64 scalars)."""
        seed = self._initial_seed
        hvd = distribute.horovod()
        if hvd is not None and hvd.size() > 1 and not tf.distribute.has_strategy():
            with tf.init_scope():  # eager, even when the first step is being traced
                seed = int(hvd.broadcast(tf.constant(seed, tf.int64), 0, name="dm_dp_noise_seed").numpy())
        self._noise_seed = self.add_variable(
            shape=(), dtype="int64", initializer=keras.initializers.Constant(seed),
            aggregation="only_first_replica", name="noise_seed")
        self._noise_draws = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="only_first_replica", name="noise_draws")

    @property
    def noise_seed(self):
        """The noise seed (a variable once built)."""
        return self._noise_seed

    @property
    def noise_draws(self):
        """How many updates have drawn noise (a variable once built)."""
        return self._noise_draws

    # -- stages ------------------------------------------------------------------------

    def transform_loss(self, loss):
        """Per-example losses (trailing axes averaged) -> per-microbatch mean losses, then
        the wrapped transforms."""
        loss = tf.convert_to_tensor(loss)
        if loss.shape.rank == 0 or loss.shape.rank is None:
            fix = ("compile with a loss whose reduction=None (e.g. "
                   "keras.losses.MeanSquaredError(reduction=None)) and call dist_minimize.integrate(model)"
                   if loss.shape.rank == 0 else "give it a static rank")
            raise ValueError(
                "DifferentialPrivacy needs the per-example losses of the batch (shape [batch] or "
                f"[batch, ...]), not a reduced loss: {fix}. Received: loss of shape "
                f"{tuple(loss.shape) if loss.shape.rank is not None else None}")
        if loss.shape.rank > 1:
            # TF Privacy's rule: an example's loss is the mean of its trailing axes.
            # (A mean over the axes, not a reshape: the batch axis keeps its static size.)
            loss = tf.reduce_mean(loss, axis=list(range(1, loss.shape.rank)))
        n = self.num_microbatches
        if n is None:
            microbatch_losses = loss
            count = tf.shape(loss)[0] if loss.shape[0] is None else loss.shape[0]
        else:
            batch = loss.shape[0]
            if batch is not None:
                if batch % n:
                    raise ValueError(f"`num_microbatches` must divide the batch on each replica. "
                                     f"Received: num_microbatches={n} for a batch of {batch}")
            else:
                check = tf.debugging.assert_equal(
                    tf.math.floormod(tf.shape(loss)[0], n), 0,
                    message=f"`num_microbatches`={n} must divide the batch on each replica")
                with tf.control_dependencies([check]):
                    loss = tf.identity(loss)
            microbatch_losses = tf.reduce_mean(tf.reshape(loss, [n, -1]), axis=1)
            count = n
        self._step.microbatches = count
        return self.wrapped.transform_loss(microbatch_losses)

    def get_gradients(self, loss, variables, tape):
        """Each microbatch's gradient, clipped to `l2_norm_clip`, summed, scaled (see the class)."""
        if self._step.microbatches is None:
            raise RuntimeError("DifferentialPrivacy.get_gradients needs the per-microbatch losses of "
                               "its `transform_loss`: train with `minimize` (or `dist_minimize.integrate` "
                               "under `model.fit`).")
        variables = list(variables)
        jacobians = tape.jacobian(loss, variables, unconnected_gradients=tf.UnconnectedGradients.NONE,
                                  experimental_use_pfor=True)
        present = [j for j in jacobians if j is not None]
        if not present:
            return [(None, v) for v in variables]
        scale = self._loss_scale()
        squares = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(tf.cast(j, tf.float32)), [tf.shape(j)[0], -1]), axis=1)
                            for j in present])
        norms = tf.sqrt(squares)
        if scale is not None:
            norms = norms / scale
        # min(1, C / norm); a zero norm keeps factor 1, an inf norm gives 0 * inf = NaN
        # (so an overflowed step is skipped by the loss scale), a NaN stays NaN.
        factors = tf.minimum(1.0, self.l2_norm_clip / tf.maximum(norms, 1e-30))
        factors = tf.where(tf.math.is_nan(norms), norms, factors)
        divisor = tf.cast(self._step.microbatches, tf.float32) * float(distribute.strategy_replicas())
        grads = []
        for j, v in zip(jacobians, variables):
            if j is None:
                grads.append((None, v))
                continue
            summed = tf.tensordot(tf.cast(factors, j.dtype), j, axes=1)
            grads.append((summed / tf.cast(divisor, j.dtype), v))
        return grads

    def transform_gradients(self, grads_and_vars):
        """Adds the noise, once, to the aggregated gradients; then the wrapped transforms."""
        count = self._step.microbatches
        if count is None:
            raise RuntimeError(
                "DifferentialPrivacy computes the gradients itself: call `minimize(per_example_losses, "
                "variables, tape=tape)` (or `dist_minimize.integrate(model)` before `model.fit`), not "
                "`apply_gradients` with gradients computed elsewhere.")
        if self.noise_multiplier > 0:
            grads_and_vars = self._add_noise(grads_and_vars, count)
        return super().transform_gradients(grads_and_vars)

    def _add_noise(self, grads_and_vars, count):
        microbatches = tf.cast(count, tf.float32) * float(distribute.num_replicas())
        for opt in self.stack():  # an accumulation averages its micro-steps
            if hasattr(type(opt), "micro_steps_per_update"):
                microbatches = microbatches * float(opt.micro_steps_per_update)
        std = self.noise_multiplier * self.l2_norm_clip / microbatches
        # Read again rather than kept from `get_gradients`: under GradientAccumulation the
        # noise is added in a later call (another micro-step's graph); the scale only
        # changes after an update, so both reads see the same value.
        scale = self._loss_scale()
        if scale is not None:
            std = std * scale  # added before the loss scale's unscaling
        seed = tf.stack([tf.convert_to_tensor(self._noise_seed), tf.convert_to_tensor(self._noise_draws)])
        out = []
        # Each pair's place in the whole step (sharded: among every process's pairs).
        for i, (g, v) in zip(CONTEXT.positions(len(grads_and_vars)), grads_and_vars):
            if g is None:
                out.append((g, v))
                continue
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            noise = tf.random.stateless_normal(tf.shape(g), seed=tf.random.experimental.stateless_fold_in(seed, i),
                                               dtype=tf.float32)
            out.append((g + tf.cast(std * noise, g.dtype), v))
        return out

    def update_condition(self, grads_and_vars):
        """Advances the noise draw counter (every update), then the wrapped condition."""
        distribute.assign_replicated(self._noise_draws, tf.convert_to_tensor(self._noise_draws) + 1)
        return super().update_condition(grads_and_vars)

    def run_update(self, grads_and_vars, *, top, aggregate):
        """The wrapped update; afterwards this step's microbatch count is forgotten."""
        try:
            super().run_update(grads_and_vars, top=top, aggregate=aggregate)
        finally:
            self._step.microbatches = None

    def _loss_scale(self):
        lso = next((opt for opt in self.stack() if hasattr(type(opt), "loss_scale")), None)
        return tf.cast(tf.convert_to_tensor(lso.loss_scale), tf.float32) if lso is not None else None

    def get_config(self):
        """The wrapped optimizer and the privacy settings (`seed` as given: None stays None)."""
        config = super().get_config()
        config.update(l2_norm_clip=self.l2_norm_clip, noise_multiplier=self.noise_multiplier,
                      num_microbatches=self.num_microbatches, seed=self.seed)
        return config


class _Step:
    """This step's microbatch count, from `transform_loss` to the noise (a plain object
    TensorFlow's tracking ignores)."""

    microbatches = None
