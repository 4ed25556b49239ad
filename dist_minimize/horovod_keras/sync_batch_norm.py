"""`SyncBatchNormalization`: batch normalisation over the global batch of every Horovod
rank (Keras's `BatchNormalization(synchronized=True)` synchronises only under a
tf.distribute strategy; under horovodrun each rank would normalise its own batch).

In training, the statistics are those of the concatenated batches of all ranks, as one
device on the whole batch computes them: the mean first (one all-reduce of each rank's
count and sum), then the variance from the squared deviations from that mean (a second
all-reduce), so a mean large against the spread costs no precision (the one-pass
E[x^2] - E[x]^2 would); ranks with unequal batches weigh by their counts. The training
normalisation is computed in float64 (cast back to the layer's dtype): with a mean of
1000 and a spread of 1, float32 sums in another order than one device's already move
the outputs by 6e-5 of their size, and so does Keras's own float32 layer on one device
against the exact result. The price: a float64 copy of the layer's input while training. Gradients
flow through Horovod's all-reduce, whose gradient is the all-reduce of the gradients:
each rank's inputs get the gradient of the sum of every rank's loss, as on one device.
Moving statistics, inference, the config and saving are Keras's.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute


@keras.saving.register_keras_serializable(package="dist_minimize")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` whose training statistics span every Horovod
    rank's batch (module docstring); in one process it is `BatchNormalization`.

    Takes `BatchNormalization`'s arguments, except `synchronized` (this layer is the
    synchronised one) and `renorm`.

    Raises:
      ValueError: `synchronized=True` or `renorm=True`; at the first training call, a
        tf.distribute strategy with several replicas (there Keras's
        `BatchNormalization(synchronized=True)` synchronises).
    """

    def __init__(self, **kwargs):
        for name in ("synchronized", "renorm"):
            if kwargs.get(name):
                raise ValueError(
                    f"SyncBatchNormalization takes no `{name}=True`: it synchronises over Horovod's ranks itself"
                    + ("" if name == "synchronized" else ", without batch renormalisation")
                    + f". Received: {name}=True")
        super().__init__(**kwargs)

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if distribute.strategy_replicas() > 1:
            raise ValueError(
                "SyncBatchNormalization synchronises over Horovod's ranks; under a tf.distribute strategy of "
                f"{distribute.strategy_replicas()} replicas use `keras.layers.BatchNormalization("
                "synchronized=True)`.")
        x = tf.cast(inputs, tf.float64)
        mean, variance = self._global_moments(x, mask)
        momentum = tf.constant(self.momentum, tf.float64)
        for moving, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            moving.assign(tf.cast(tf.cast(moving, tf.float64) * momentum + batch * (1.0 - momentum), moving.dtype))
        outputs = keras.ops.batch_normalization(
            x, mean=mean, variance=variance, axis=self.axis,
            offset=tf.cast(self.beta, x.dtype) if self.center else None,
            scale=tf.cast(self.gamma, x.dtype) if self.scale else None, epsilon=self.epsilon)
        return tf.cast(outputs, self.compute_dtype)

    def _global_moments(self, x, mask):
        """Mean and variance of `x` over every rank's batch, per channel of `self.axis`."""
        axis = self.axis % len(x.shape)
        axes = [i for i in range(len(x.shape)) if i != axis]
        shape = [1] * len(x.shape)
        shape[axis] = -1
        if mask is None:
            kept = None
            rows = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
            count = tf.fill(tf.shape(x)[axis:axis + 1], rows)
        else:  # masked places count for nothing, whatever they hold (inf, NaN padding)
            kept = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.bool), tf.shape(x))
            x = tf.where(kept, x, tf.zeros_like(x))
            count = tf.reduce_sum(tf.cast(kept, x.dtype), axes)
        count, total = tf.unstack(_sum_over_ranks(tf.stack([count, tf.reduce_sum(x, axes)])))
        count = tf.maximum(count, 1.0)  # every place masked on every rank: mean and variance 0, not NaN
        mean = total / count
        squares = tf.square(x - tf.reshape(mean, shape))
        if kept is not None:
            squares = tf.where(kept, squares, tf.zeros_like(squares))
        return mean, _sum_over_ranks(tf.reduce_sum(squares, axes)) / count


def _sum_over_ranks(tensor):
    if distribute.horovod_size() == 1:
        return tensor
    hvd = distribute.horovod()
    return hvd.allreduce(tensor, op=hvd.Sum)
