"""The collectives of a sharded step (`Optimizer(shard_optimizer_state=True)`), written
once for any backend that provides three primitives: a reduce-scatter of equal-length
flat buffers, an all-gather of equal-length flat buffers, and a sum of a scalar.

Layout: per dtype, one flat buffer of `size * width` elements whose segment `r` holds
the gradients (or, for the gather, the values) of the variables process `r` owns, in
the step's variable order, zero-padded to `width`, the largest process's share. A
reduce-scatter of that buffer leaves each process exactly its segment, reduced; an
all-gather of the segments rebuilds the buffer on every process.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from dist_minimize._shards import elements_of


def _segments(owners: Sequence[int], items: Sequence, size: int) -> dict:
    """{dtype: (segments: [[index, ...] per process], width)} over the indices of
    `items` (gradients or variables, None skipped) with their owners."""
    by_dtype: dict = {}
    for i, (owner, item) in enumerate(zip(owners, items)):
        if item is None:
            continue
        segs = by_dtype.setdefault(tf.as_dtype(item.dtype).base_dtype, [[] for _ in range(size)])
        segs[owner].append(i)
    return {d: (segs, max(sum(elements_of(items[i]) for i in seg) for seg in segs)) for d, segs in by_dtype.items()}


def _flat(parts: list, width: int, dtype) -> tf.Tensor:
    used = sum(int(p.shape[0]) for p in parts)
    if used < width:
        parts = parts + [tf.zeros([width - used], dtype)]
    return tf.concat(parts, 0) if len(parts) > 1 else parts[0]


def _dense(g):
    return tf.convert_to_tensor(g)


def reduce_scatter(grads_and_vars: list, owners: Sequence[int], size: int, rank: int,
                   collective: Callable[[tf.Tensor], tf.Tensor]) -> list:
    """This process's (gradient, variable) pairs, the gradients reduced across processes.

    `collective(buffer)` reduce-scatters one flat buffer of `size * width` elements and
    returns this process's `width` elements. None gradients stay None.
    """
    grads = [g for g, _ in grads_and_vars]
    out = {i: None for i, owner in enumerate(owners) if owner == rank}
    for dtype, (segs, width) in _segments(owners, grads, size).items():
        if width == 0:
            continue
        parts = []
        for seg in segs:
            flat = [tf.reshape(_dense(grads[i]), [-1]) for i in seg]
            parts.append(_flat(flat, width, dtype))
        mine = collective(tf.concat(parts, 0))
        offset = 0
        for i in segs[rank]:
            n = elements_of(grads[i])
            out[i] = tf.reshape(mine[offset:offset + n], grads_and_vars[i][1].shape)
            offset += n
    return [(out[i], grads_and_vars[i][1]) for i in sorted(out)]


def all_gather(variables: Sequence, updated: Sequence[bool], owners: Sequence[int], size: int, rank: int,
               collective: Callable[[tf.Tensor], tf.Tensor]) -> None:
    """Writes into every variable that `updated` marks the value its owner holds.

    `collective(segment)` all-gathers one `width`-element segment per process and
    returns the `size * width` elements, process by process.
    """
    items = [v if u else None for v, u in zip(variables, updated)]
    for dtype, (segs, width) in _segments(owners, items, size).items():
        if width == 0:
            continue
        own = [tf.reshape(tf.convert_to_tensor(variables[i]), [-1]) for i in segs[rank]]
        gathered = collective(_flat(own, width, dtype))
        for r, seg in enumerate(segs):
            if r == rank:
                continue
            offset = r * width
            for i in seg:
                n = elements_of(variables[i])
                variables[i].assign(tf.reshape(gathered[offset:offset + n], variables[i].shape))
                offset += n


def planned(grads: Sequence, owners: Sequence[int], size: int) -> int:
    """The reduce-scatters of a step: one per dtype with gradients."""
    return sum(1 for _, (_, width) in _segments(owners, list(grads), size).items() if width)
