"""Compressed aggregation with error feedback: each replica sends its gradients in 16 bits
and keeps what the rounding dropped, to send it with the next step's."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.staged import StagedOptimizer
from dist_minimize.step import stages
from dist_minimize.wrappers.base import OptimizerWrapper

# The 16-bit formats a gradient can be sent in, by the name `compression=` takes.
CODECS = {"fp16": tf.float16, "bf16": tf.bfloat16}
_FP16_MAX = 65504.0


@keras.saving.register_keras_serializable(package="dist_minimize")
class CompressedAggregation(OptimizerWrapper):
    """Aggregates 16-bit gradients, with error feedback: half the bytes per step, nothing
    lost over time.

    At each update, each replica adds its residual (what compression dropped at its
    previous update) to its gradient, `x = g + r`, sends `c = 16-bit(x)` to the wrapped
    optimizer's aggregation, and keeps `r = x - c` for the next. So the applied gradient
    plus the new residuals equal the exact aggregated gradient plus the old residuals:
    `aggregate(c) + aggregate(r_new) = aggregate(g) + aggregate(r_old)` (aggregation is
    linear), up to the rounding of the 16-bit sum itself. Everything after aggregation
    (the clip, the guard, the update rule) sees the aggregated gradient in the
    variable's own dtype.

    * `"bf16"`: bfloat16, float32's range with 8 bits of mantissa. Horovod 0.28.1's
      allreduce has no bfloat16 kernel: refused under Horovod, naming `"fp16"`.
    * `"fp16"`: float16, 11 bits of mantissa and a range of +-65504. Each replica's
      values are clipped to +-65504 / replicas, so that no sum of them can overflow; what
      the clip removes goes to the residual too (sent over the next steps). A gradient
      below float16's smallest subnormal (6e-8) is sent as 0 and stays in the residual
      until it adds up.

    Non-finite gradients are sent as they are, so the aggregated gradient holds them and
    the guard skips the step; a step whose aggregated gradient is non-finite leaves the
    residuals as they were (a skipped step changes nothing). Sparse gradients
    (`IndexedSlices`), gradients already in 16 bits and non-float ones are aggregated as
    they are.

    The residuals are replica-local slots ("residual", one per trained variable). Under
    tf.distribute a checkpoint holds their SUM and a restore splits it evenly, which the
    strategy's SUM aggregation sends on unchanged, on any number of replicas. Under
    Horovod (which averages) `dist_minimize.Checkpointer` first replaces every process's
    residuals by their mean over the processes (`share_process_state`), which the
    average leaves unchanged, so rank 0's file restores on any number of processes; a
    checkpoint written another way keeps rank 0's residuals.

    Stacking: once per stack. Inside a `GradientAccumulation` or outside it, the
    accumulated gradient is compressed once per update. Refused with a
    `LossScaleOptimizer` in the stack (the residual would be kept in units of a scale that
    changes) and with `shard_optimizer_state=True` (each process sends its gradient in
    full precision to the owner of each share: there is no all-reduce to compress).

    Args:
      optimizer: a dist_minimize optimizer.
      compression: `"fp16"`, `"bf16"` or `"powersgd:R"` (R >= 1, the rank).

    Raises:
      ValueError: an unknown `compression`, or a stack it cannot sit on (see above).
    """

    once_per_stack = True
    refuses_outside = {"LossScaleOptimizer": (
        "{outer} cannot wrap a stack holding CompressedAggregation: the residuals would be kept in units "
        "of a loss scale that changes between steps. Leave out loss scaling, or the compression.")}

    def __init__(self, optimizer: StagedOptimizer, compression: str = "fp16", name: str | None = None):
        rank = _low_rank(compression)
        super().__init__(optimizer, name=name)
        self.compression = compression
        self._rank = rank
        # The low-rank exchange aggregates twice per update (P, then Q), on purpose.
        self.extra_aggregations = 1 if rank else 0

    def check_stack(self) -> None:
        super().check_stack()
        held = [type(o).__name__ for o in self.wrapped.stack() if type(o).__name__ == "LossScaleOptimizer"]
        if held:
            raise ValueError("CompressedAggregation cannot wrap a LossScaleOptimizer: the residuals would be kept "
                             "in units of a loss scale that changes between steps. Leave out loss scaling, or the "
                             "compression. Received: a stack holding LossScaleOptimizer")
        if getattr(self.wrapped.stack()[-1], "shard_optimizer_state", False):
            raise ValueError("CompressedAggregation with shard_optimizer_state=True: a sharded step reduce-scatters "
                             "full-precision gradients to the owner of each share; there is no all-reduce to "
                             "compress. Received: shard_optimizer_state=True")

    def build_state(self, var_list):
        """One replica-local residual per trained variable; with a rank, the factors P
        (rows x rank) and Q (columns x rank) of each matrix it pays to send as two."""
        self._factors = {}  # (set in `build`: a plain dict, untracked; the variables are tracked)
        for i, v in enumerate(self.trained_variables):
            self.add_slot(v, "residual", replica_local=True)
            shape = _matrix(v.shape)
            if self._rank and shape is not None and self._rank * sum(shape) < shape[0] * shape[1]:
                factors = [self.add_variable(shape=(n, self._rank), dtype=v.dtype, aggregation="only_first_replica",
                                             initializer=keras.initializers.RandomNormal(seed=2 * i + j),
                                             name=f"{stages.slot_prefix(v)}_{part}")
                           for j, (n, part) in enumerate(zip(shape, ("p", "q")))]
                self._factors[_compat.variable_key(self, v)] = tuple(factors)

    def aggregate_gradients(self, grads_and_vars):
        """Sends `16-bit(g + r)` (or its low-rank factors) to the wrapped aggregation;
        keeps the rest as `r`."""
        if self._rank:
            return self._aggregate_low_rank(list(grads_and_vars))
        codec = CODECS[self.compression]
        if codec == tf.bfloat16 and distribute.horovod() is not None and distribute.strategy_replicas() == 1:
            raise ValueError("compression='bf16' under Horovod: Horovod 0.28.1's allreduce has no bfloat16 "
                             "kernel. Use compression='fp16'. Received: compression='bf16'")
        bound = _FP16_MAX / distribute.num_replicas() * (1.0 - 2.0 ** -10)
        pairs, kept = list(grads_and_vars), {}
        for i, (g, v) in enumerate(pairs):
            if not _compressible(g):
                continue  # aggregated as it is
            residual = self.slot("residual", v)
            x = g + tf.cast(residual, g.dtype)
            sent = x
            if codec == tf.float16:  # finite values within +-bound; inf and NaN sent as they are
                sent = tf.where(tf.math.is_finite(x), tf.clip_by_value(x, -bound, bound), x)
            c = tf.cast(sent, codec)
            pairs[i] = (c, v)
            kept[i] = (residual, x - tf.cast(c, x.dtype))
        pairs = super().aggregate_gradients(pairs)
        for i in kept:
            g, v = pairs[i]
            pairs[i] = (tf.cast(g, v.dtype), v)
        if kept:  # a non-finite aggregate: the step is skipped, the residuals stay
            finite = _all_finite(pairs)
            for residual, new in kept.values():
                residual.assign(tf.where(finite, tf.cast(new, residual.dtype), residual))
        return pairs

    def _aggregate_low_rank(self, pairs):
        # Per matrix M = g + r (rows x columns): P = M Q aggregated, orthonormalised (the
        # same on every replica: made from aggregated values), then Q = M^T P aggregated;
        # applied P Q^T, which is the aggregate of each replica's P P^T M, so the residual
        # M - P P^T M keeps exactly what was not sent. Q is kept for the next update.
        low = {}
        for i, (g, v) in enumerate(pairs):
            factors = self._factors.get(_compat.variable_key(self, v)) if _compressible(g) else None
            if factors is not None:
                residual = self.slot("residual", v)
                low[i] = (tf.reshape(g + tf.cast(residual, g.dtype), factors[0].shape[:1] + factors[1].shape[:1]),
                          residual, *factors)
        if not low:
            return super().aggregate_gradients(pairs)
        first = super().aggregate_gradients(
            [pair for i, pair in enumerate(pairs) if i not in low]
            + [(tf.matmul(m, tf.cast(q, m.dtype)), p) for m, _, p, q in low.values()])
        plain, ps = first[:len(pairs) - len(low)], first[len(pairs) - len(low):]
        bases = [tf.linalg.qr(p_sum).q for p_sum, _ in ps]
        second = super().aggregate_gradients(
            [(tf.matmul(m, basis, transpose_a=True), q) for (m, _, _, q), basis in zip(low.values(), bases)])
        applied = iter(tf.matmul(basis, q_sum, transpose_b=True) for basis, (q_sum, _) in zip(bases, second))
        plain = iter(plain)
        out = [(tf.reshape(next(applied), v.shape), v) if i in low else next(plain) for i, (_, v) in enumerate(pairs)]
        finite = _all_finite(out)
        for (m, residual, p, q), basis, (q_sum, _) in zip(low.values(), bases, second):
            kept = m - tf.matmul(basis, tf.matmul(basis, m, transpose_a=True))
            residual.assign(tf.where(finite, tf.reshape(kept, residual.shape), residual))
            distribute.assign_replicated(q, tf.where(finite, q_sum, q))  # warm start of the next update
            distribute.assign_replicated(p, tf.where(finite, basis, p))
        return out

    def share_process_state(self) -> None:
        """Under Horovod: every process's residuals become their mean over the processes.

        What Horovod's average sends of them is unchanged, so training continues as it
        would have, and a checkpoint written by rank 0 alone restores on any number of
        processes. A collective: every process calls it, outside a step
        (`dist_minimize.Checkpointer` does before it saves). Nothing to do in one process
        or under a tf.distribute strategy.
        """
        if not self.built or distribute.strategy_replicas() > 1 or distribute.horovod_size() == 1:
            return
        residuals = self.slots("residual")
        means = distribute.mean_across([tf.convert_to_tensor(r) for r in residuals], name="dm_share_residuals")
        for residual, mean in zip(residuals, means):
            residual.assign(mean)

    def get_config(self):
        """The wrapped optimizer and `compression`."""
        config = super().get_config()
        config["compression"] = self.compression
        return config


def _low_rank(compression) -> int:
    """The rank of `"powersgd:R"` (0 for a 16-bit codec); ValueError for anything else."""
    if isinstance(compression, str) and compression in CODECS:
        return 0
    head, _, rank = compression.partition(":") if isinstance(compression, str) else ("", "", "")
    if head == "powersgd" and rank.isdigit() and int(rank) >= 1:
        return int(rank)
    raise ValueError(f"`compression` must be one of {sorted(CODECS)} or 'powersgd:R' with a rank R >= 1. "
                     f"Received: compression={compression!r}")


def _matrix(shape) -> tuple | None:
    """A variable's shape as (rows, columns): its last dimension is the columns; None for
    a scalar or a vector."""
    if len(shape) < 2 or any(d is None for d in shape):
        return None
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, int(shape[-1])


def _all_finite(pairs) -> tf.Tensor:
    """Whether every aggregated gradient is finite (identical on every replica), so that a
    step the guard skips leaves the residuals as they were."""
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in pairs if g is not None]
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(tf.cast(g, tf.float32))) for g in values])


def _compressible(g) -> bool:
    """A dense gradient of more than 16 bits a float."""
    return isinstance(g, tf.Tensor) and g.dtype.is_floating and g.dtype.size > 2
