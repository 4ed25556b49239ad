"""The same training on any number of workers: a fixed global batch G made of
micro-batches of a fixed size b, the number of micro-batches each worker accumulates per
update adapting to the worker count N (K = G / (N * b)).

The samples, their order and the sum over the global batch then do not depend on N, and
neither does a worker's memory (it holds one micro-batch at a time):

* the sample stream (the dataset as given, e.g. shuffled with a fixed seed) is cut into
  micro-batches of b; update t takes global micro-batches t * M ... t * M + M - 1
  (M = G / b), and a partial last update is dropped;
* worker r takes micro-batches j = r, r + N, r + 2N, ... of each update, in that order
  (`micro_batches`), accumulates their mean gradient over its K
  (`dist_minimize.GradientAccumulation(steps=K)`), and the aggregation averages the
  workers' means: (1/N) sum_r (1/K) sum_i g[r + i N], the mean of the M micro-batch
  gradients.

With two workers or one accumulating both micro-batches the sums have the same two
operands and the scalings by 1/2 are exact, so the weights are the same bits; with more
operands the summation order differs (4 workers against 2 accumulating 2 each: (g0 + g2)
+ (g1 + g3) against (g0 + g1) + (g2 + g3), and 1/4 = 1/2 * 1/2), within float rounding.
"""

from __future__ import annotations

from typing import Any


def admissible_sizes(global_batch: int, micro_batch: int, max_workers: int | None = None) -> list[int]:
    """The worker counts N for which every worker gets whole micro-batches: the divisors
    of G / b (up to `max_workers`)."""
    per_update = _micro_batches_per_update(global_batch, micro_batch)
    top = per_update if max_workers is None else min(per_update, max_workers)
    return [n for n in range(1, top + 1) if per_update % n == 0]


def accumulation_steps(global_batch: int, micro_batch: int, workers: int) -> int:
    """K = G / (N * b): the micro-batches each of `workers` accumulates per update.

    Raises:
      ValueError: G is not a whole number of micro-batches, or they do not share evenly
        among the workers (the admissible counts are named).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"`workers` must be an integer >= 1. Received: workers={workers!r}")
    per_update = _micro_batches_per_update(global_batch, micro_batch)
    if per_update % workers:
        raise ValueError(
            f"A global batch of {global_batch} in micro-batches of {micro_batch} is {per_update} micro-batches per "
            f"update, which {workers} workers cannot share evenly. Admissible worker counts: "
            f"{admissible_sizes(global_batch, micro_batch)}. Received: workers={workers}")
    return per_update // workers


def micro_batches(dataset: Any, global_batch: int, micro_batch: int, workers: int, rank: int,
                  samples: int | None = None) -> Any:
    """This worker's micro-batches, in training order: `dataset` (unbatched samples)
    batched by `micro_batch`, whole updates only, and of each update the micro-batches
    j = rank, rank + workers, ... (`samples`: the dataset's length, when TensorFlow
    cannot tell it)."""
    import tensorflow as tf

    accumulation_steps(global_batch, micro_batch, workers)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < workers:
        raise ValueError(f"`rank` must be an integer in [0, {workers}). Received: rank={rank!r}")
    if samples is None:
        samples = int(dataset.cardinality())
        if samples < 0:
            raise ValueError("The dataset's length is unknown to TensorFlow: pass `samples=`.")
    per_update = global_batch // micro_batch
    updates = samples // global_batch
    stream = dataset.batch(micro_batch, drop_remainder=True).take(updates * per_update)
    return stream.shard(workers, rank) if workers > 1 else stream.prefetch(tf.data.AUTOTUNE)


def _micro_batches_per_update(global_batch: int, micro_batch: int) -> int:
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    if global_batch % micro_batch:
        raise ValueError(f"The global batch must be a whole number of micro-batches. Received: "
                         f"global_batch={global_batch}, micro_batch={micro_batch}")
    return global_batch // micro_batch
