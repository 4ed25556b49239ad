"""The collectives of a sharded step (`Optimizer(shard_optimizer_state=True)`), written
once for any backend that provides three primitives: a reduce-scatter of equal-length
flat buffers, an all-gather of equal-length flat buffers, and a sum of a scalar.

Every process issues the step's collectives in one order, the order they are traced in:
reduce-scatter buckets, then the sums over the shares (`in_order`), then the gather's
buckets. Horovod's ops here wait for the other processes' matching op in the order each
process issues them, so two processes that issue two collectives in opposite orders wait
for each other forever; and a process that owns nothing in a bucket (more processes than
variables, or its variables rank-local) has nothing whose data would order them. So each
collective's input is computed from the previous one's result (`_after_value`: exact
bits, a data dependency TensorFlow keeps; a control dependency on a constant buffer does
not order anything), and a result this process does not read is kept in the graph
(`_keep`: a Horovod op is not stateful, and TensorFlow drops one nothing reads).

Layout: per bucket of variables of one dtype (`_buckets`: at most about BUCKET_BYTES),
one flat buffer of `size * width` elements whose segment `r` holds the gradients (or, for
the gather, the values) of the bucket's variables process `r` owns, zero-padded to
`width`, the largest segment. A reduce-scatter of that buffer leaves each process exactly
its segment, reduced; an all-gather of the segments rebuilds the buffer on every process.

The buckets go one after another: bucket k's buffer is built once bucket k - 1's
collective has returned (the gather's, once its writes are done). Without an order
TensorFlow may build every bucket's buffer (a copy of all the gradients) before the first
collective runs, and the bounded buckets would bound nothing; with two in flight the peak
RSS of a step was 180-250 MiB higher at N = 4 (docs/sharding.md), and no faster.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.step.context import CONTEXT
from dist_minimize.step.stages import elements_of


# A collective's buffer holds at most about this many bytes (a larger variable, alone):
# one buffer for every gradient would be a copy of them all at once, on top of the
# collective's own, and measured a peak RSS higher than the unsharded step's.
BUCKET_BYTES = 32 * 2 ** 20


def _buckets(owners: Sequence[int], items: Sequence, size: int, bucket_bytes: int | None = None) -> list:
    """[(dtype, segments: [[index, ...] per process], width)] over the indices of `items`
    (gradients or variables, None skipped) with their owners: one collective each.

    Per dtype, each process's variables are taken largest first, and a bucket takes from
    every process's list at once, each up to the same length: `bucket_bytes` over the
    processes, or the bucket's largest variable where one alone is longer. So the
    segments of a bucket come out nearly equal (little zero padding travels), a
    buffer passes the bound only by a variable that alone does, and the same layout is
    computed on every process (it depends on shapes and owners only).
    """
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    by_dtype: dict = {}
    for i, item in enumerate(items):
        if item is not None:
            by_dtype.setdefault(tf.as_dtype(item.dtype).base_dtype, []).append(i)
    out = []
    for dtype, indices in by_dtype.items():
        queues = [[i for i in sorted(indices, key=lambda i: (-elements_of(items[i]), i)) if owners[i] == r]
                  for r in range(size)]
        limit = max(1, bucket_bytes // (dtype.size * size))  # elements per segment
        while any(queues):
            length = max([limit] + [elements_of(items[q[0]]) for q in queues if q])
            segs, loads = [[] for _ in range(size)], [0] * size
            for r, queue in enumerate(queues):
                while queue and loads[r] + elements_of(items[queue[0]]) <= length:
                    loads[r] += elements_of(items[queue[0]])
                    segs[r].append(queue.pop(0))
            out.append((dtype, segs, max(loads)))
    return out


def _padded(parts: list, width: int, dtype) -> list:
    """`parts` (flat tensors) and the zeros that bring them to `width` elements."""
    used = sum(int(p.shape[0]) for p in parts)
    return parts + [tf.zeros([width - used], dtype)] if used < width else parts


def _flat(parts: list, width: int, dtype) -> tf.Tensor:
    parts = _padded(parts, width, dtype)
    return tf.concat(parts, 0) if len(parts) > 1 else parts[0]


def _dense(g):
    return tf.convert_to_tensor(g)


_BITS = {2: tf.int16, 4: tf.int32, 8: tf.int64}


def _after_value(value: tf.Tensor, previous) -> tf.Tensor:
    """`value`, bit for bit, computed from `previous` (its first element's bits ANDed with
    0, ORed into `value`'s): it runs once `previous` exists."""
    if previous is None or tf.executing_eagerly():
        return value
    value = tf.convert_to_tensor(value)
    bits = _BITS[value.dtype.size]
    first = tf.pad(tf.reshape(previous, [-1])[:1], [[0, 1]])[0]  # (0 where `previous` is empty)
    zero = tf.cast(tf.bitwise.bitwise_and(tf.bitcast(first, _BITS[first.dtype.size]), 0), bits)
    return tf.bitcast(tf.bitwise.bitwise_or(tf.bitcast(value, bits), zero), value.dtype)


def in_order(collective: Callable[[tf.Tensor], tf.Tensor], value: tf.Tensor) -> tf.Tensor:
    """`collective(value)` as the step's next collective: after this process's previous
    one (`ShardedStep.last`), and the one the next waits for. Outside a step: as it is."""
    step = CONTEXT.sharded
    if step is None:
        return collective(value)
    step.last = collective(_after_value(value, step.last))
    return step.last


def _keep(result: tf.Tensor) -> None:
    """Keeps a collective whose result this process does not read in the graph: an
    `Assert` that always holds (stateful, so TensorFlow runs it) reads it."""
    if not tf.executing_eagerly():
        tf.raw_ops.Assert(condition=tf.constant(True), data=[tf.reshape(result, [-1])[:1]], summarize=0)


def _after(done: list):
    """The ordering of the next bucket: after the last bucket's collective (none before)."""
    return tf.control_dependencies(done[-1:])


def reduce_scatter(grads_and_vars: list, owners: Sequence[int], size: int, rank: int,
                   collective: Callable[[tf.Tensor, int], tf.Tensor]) -> list:
    """This process's (gradient, variable) pairs, the gradients reduced across processes.

    `collective(buffer, k)` reduce-scatters bucket k's flat buffer of `size * width`
    elements and returns this process's `width` elements. None gradients stay None.
    """
    grads = [g for g, _ in grads_and_vars]
    out = {i: None for i, owner in enumerate(owners) if owner == rank}
    done = []
    for k, (dtype, segs, width) in enumerate(_buckets(owners, grads, size)):
        with _after(done):
            parts = []  # concatenated once: the buffer is the only copy of these gradients made
            for seg in segs:
                parts += _padded([tf.reshape(_dense(grads[i]), [-1]) for i in seg], width, dtype)
            buffer = tf.concat(parts, 0)
        mine = collective(buffer, k)
        done.append(mine)
        if not segs[rank]:
            _keep(mine)
        if CONTEXT.sharded is not None:
            CONTEXT.sharded.last = mine
        offset = 0
        for i in segs[rank]:
            n = elements_of(grads[i])
            out[i] = tf.reshape(mine[offset:offset + n], grads_and_vars[i][1].shape)
            offset += n
    return [(out[i], grads_and_vars[i][1]) for i in sorted(out)]


def all_gather(variables: Sequence, updated: Sequence[bool], owners: Sequence[int], size: int, rank: int,
               collective: Callable[[tf.Tensor, int], tf.Tensor], write: Callable | None = None) -> None:
    """Writes into every variable that `updated` marks the value its owner holds.

    `collective(segment, k)` all-gathers bucket k's `width`-element segment of each
    process and returns the `size * width` elements, process by process. `write(pairs)`
    writes a bucket's (variable, value) pairs and returns what the next buckets wait
    for (default: each variable's `assign`).
    """
    items = [v if u else None for v, u in zip(variables, updated)]
    done = []
    previous = CONTEXT.sharded.last if CONTEXT.sharded is not None else None
    for k, (dtype, segs, width) in enumerate(_buckets(owners, items, size)):
        with _after(done):
            own = _flat([tf.reshape(tf.convert_to_tensor(variables[i]), [-1]) for i in segs[rank]], width, dtype)
        if k == 0 or not segs[rank]:  # after the step's last collective; later buckets after their writes
            own = _after_value(own, previous)
        gathered = previous = collective(own, k)
        pairs = []
        for r, seg in enumerate(segs):
            if r == rank:
                continue
            offset = r * width
            for i in seg:
                n = elements_of(variables[i])
                pairs.append((variables[i], tf.reshape(gathered[offset:offset + n], variables[i].shape)))
                offset += n
        if not pairs:
            _keep(gathered)
        # The next buffers wait for this bucket's writes: its gathered copy is then freed.
        written = (write or _assign)(pairs) if pairs else None
        done.append(written if written is not None and not tf.executing_eagerly() else gathered)


def _assign(pairs: list):
    return tf.group([variable.assign(value) for variable, value in pairs])


def own_segment(reduced: tf.Tensor, size: int, rank: int) -> tf.Tensor:
    """Process `rank`'s segment of a bucket's buffer reduced whole (by an all-reduce):
    what a reduce-scatter of that buffer would have left it.

    A copy, not a slice: TensorFlow's slice of a leading dimension shares the tensor's
    memory, so each kept segment would hold its whole reduced buffer until the update has
    run, and the step would hold the whole aggregated gradient as an unsharded step does
    (measured at N = 4: 90 MiB more peak RSS per process). `DeepCopy` always copies
    (`Snapshot` may hand the slice on: measured, the peak stayed); it has CPU and GPU
    kernels and none for XLA, whose compiler places buffers itself: there, the slice.
    """
    width = reduced.shape[0] // size
    segment = reduced[rank * width:(rank + 1) * width]
    return segment if distribute.in_xla() else tf.raw_ops.DeepCopy(x=segment)


def planned(grads: Sequence, owners: Sequence[int], size: int) -> int:
    """The reduce-scatters of a step: one per bucket (`_buckets`)."""
    return len(_buckets(owners, list(grads), size))
