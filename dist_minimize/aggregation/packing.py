"""Packing many gradient tensors into a few flat buffers, one collective operand each.

A collective over many small tensors pays a per-tensor cost (bookkeeping, a copy into
and out of a fusion buffer) that one tensor of the same total size does not. Packing
the tensors of one dtype into flat buffers of at most `bytes_per_pack` bytes, reducing
the buffers, and cutting them back into the original shapes gives every element the
same reduction as reducing it alone (sum and mean act element by element), for the
cost of one copy into the buffer (the cut-back outputs are slices of the result).

Only element-wise reductions may be packed: a reduction that looks at a whole tensor
(Horovod's Adasum) would see other tensors' elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import tensorflow as tf


@dataclass(frozen=True)
class PackSpec:
    """How `pack` grouped the tensors: `groups[i]` lists the input positions in buffer i
    (one position: the tensor itself, not copied), with their shapes and sizes."""

    count: int
    groups: tuple
    shapes: tuple
    sizes: tuple


def pack(tensors: Sequence[tf.Tensor], bytes_per_pack: int,
         alone_from: int | None = None) -> tuple[List[tf.Tensor], PackSpec]:
    """Concatenates `tensors` (dense) into flat buffers of one dtype and at most
    `bytes_per_pack` bytes each.

    Tensors keep their order inside a buffer; buffers are made in the order of their
    first tensor, so every process with the same tensor shapes and dtypes builds the
    same buffers. A tensor of `bytes_per_pack` bytes or more (or of `alone_from` bytes
    or more), or whose shape is not fully known, is its own buffer, unchanged.
    `bytes_per_pack=0` packs nothing.

    Args:
      tensors: dense tensors (no `None`, no `IndexedSlices`).
      bytes_per_pack: the largest buffer, in bytes; 0 turns packing off.
      alone_from: if given, a tensor of this many bytes or more is not packed (its
        collective's per-tensor cost is small beside the copy packing would make).

    Returns:
      `(buffers, spec)`; `unpack(reduced_buffers, spec)` gives tensors shaped as the inputs.
    """
    tensors = list(tensors)
    shapes, sizes = [], []
    for t in tensors:
        shape = t.shape
        shapes.append(shape)
        sizes.append(shape.num_elements() if shape.is_fully_defined() else None)
    groups: list[list[int]] = []
    open_group: dict = {}  # dtype -> (group index, bytes so far)
    limit = bytes_per_pack if alone_from is None else min(bytes_per_pack, alone_from)
    for i, t in enumerate(tensors):
        n = sizes[i]
        nbytes = None if n is None else n * t.dtype.size
        if bytes_per_pack <= 0 or nbytes is None or nbytes >= limit:
            groups.append([i])
            continue
        current = open_group.get(t.dtype)
        if current is not None and current[1] + nbytes <= bytes_per_pack:
            groups[current[0]].append(i)
            open_group[t.dtype] = (current[0], current[1] + nbytes)
        else:
            groups.append([i])
            open_group[t.dtype] = (len(groups) - 1, nbytes)
    buffers = []
    for group in groups:
        if len(group) == 1:
            buffers.append(tensors[group[0]])
        else:
            buffers.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in group], axis=0))
    spec = PackSpec(len(tensors), tuple(tuple(g) for g in groups), tuple(shapes), tuple(sizes))
    return buffers, spec


def unpack(buffers: Sequence[tf.Tensor], spec: PackSpec) -> List[tf.Tensor]:
    """The tensors `pack` packed into `buffers` (or into the buffers' reduced copies),
    in their original order and shapes.

    Raises:
      ValueError: `buffers` does not hold one tensor per buffer of `spec`.
    """
    buffers = list(buffers)
    if len(buffers) != len(spec.groups):
        raise ValueError(f"`unpack` expects {len(spec.groups)} buffers (as packed). Received: {len(buffers)}")
    out: list = [None] * spec.count
    for group, buf in zip(spec.groups, buffers):
        if len(group) == 1:
            out[group[0]] = buf
            continue
        pieces = tf.split(buf, [spec.sizes[i] for i in group], axis=0)
        for i, piece in zip(group, pieces):
            out[i] = tf.reshape(piece, spec.shapes[i])
    return out
