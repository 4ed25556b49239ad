"""Optimizer state sharded across data-parallel processes (ZeRO stages 1 and 2): the
partition of the trained variables, and the step's sharding context.

`Partition.balanced` gives each process whole variables, balanced by size (the largest
first, each to the least loaded process; the same on every process). Whole variables,
not slices of a flat buffer: every update rule sees the tensors it updates whole (Lamb's
per-layer trust ratio, Adafactor's factored moments, Muon's matrices), and every
per-variable state of the stack (slots, averages, slow weights) is built only for the
variables a process owns. The price is balance: a process holds at most the average
share plus the largest variable (`Partition.loads`).

Within a sharded step, the aggregation hands each process only its own variables'
aggregated gradients (a reduce-scatter), so a value over all gradients is a sum over
the processes' shares: `sum_over_shards` adds a scalar (the clipper's squared norm, the
guard's count of non-finite elements) across processes, one collective, and does
nothing outside a sharded step. The step ends with the new weights of every process's
share gathered by all (`ShardedStep.gather`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which process updates each trained variable.

    Attributes:
      owner: the owning process of each variable, in the order of the variable list.
      elements: each variable's number of elements.
      size: the number of processes.
      rank: this process.
    """

    owner: tuple
    elements: tuple
    size: int
    rank: int

    @classmethod
    def balanced(cls, elements: Sequence[int], size: int, rank: int) -> "Partition":
        """Whole variables, the largest first, each to the least loaded process (the
        lowest rank on a tie): at most the average load plus the largest variable."""
        loads = [0] * size
        owner = [0] * len(elements)
        for i in sorted(range(len(elements)), key=lambda i: (-int(elements[i]), i)):
            r = min(range(size), key=lambda r: (loads[r], r))
            owner[i] = r
            loads[r] += int(elements[i])
        return cls(tuple(owner), tuple(int(e) for e in elements), int(size), int(rank))

    def owned_by(self, rank: int) -> list[int]:
        """Indices of the variables `rank` owns, in variable order."""
        return [i for i, r in enumerate(self.owner) if r == rank]

    @property
    def mine(self) -> list[int]:
        return self.owned_by(self.rank)

    def loads(self) -> list[int]:
        """Elements owned by each process."""
        out = [0] * self.size
        for r, e in zip(self.owner, self.elements):
            out[r] += e
        return out


def elements_of(variable) -> int:
    return int(np.prod(variable.shape)) if len(variable.shape) else 1


class ShardedStep:
    """What a sharded step's aggregation registers: how to add a scalar across processes
    (`sum`), and how to gather the updated variables after the update (`gather`)."""

    def __init__(self):
        self.sum: Callable | None = None
        self.gather: Callable[[], None] | None = None
        self.owns: Callable | None = None  # variable -> whether this process owns it
        self.everyones: Callable | None = None  # see `everyones_values`
        self.positions: list | None = None  # see `positions`


class _Current(threading.local):
    step: ShardedStep | None = None


_CURRENT = _Current()


@contextlib.contextmanager
def step() -> Iterator[ShardedStep]:
    """One step's sharding context (empty until a sharding aggregation fills it)."""
    previous, _CURRENT.step = _CURRENT.step, ShardedStep()
    try:
        yield _CURRENT.step
    finally:
        _CURRENT.step = previous


def current() -> ShardedStep | None:
    return _CURRENT.step


def share(grads_and_vars: list) -> list:
    """The pairs of `grads_and_vars` this process owns in a sharded step; else all."""
    sharded = _CURRENT.step
    if sharded is None or sharded.owns is None:
        return list(grads_and_vars)
    return [(g, v) for g, v in grads_and_vars if sharded.owns(v)]


def everyones_values(values: list) -> list | None:
    """In a sharded step: `values` (one scalar per pair of this process's share, in the
    order the aggregation returned them; None where a pair has no gradient) completed
    with every other process's, one per pair of the whole step that has a gradient, in
    the step's order: what the unsharded step computes, element for element (one
    collective: a sum where every other process adds an exact zero). None elsewhere."""
    sharded = _CURRENT.step
    if sharded is None or sharded.everyones is None:
        return None
    return sharded.everyones(values)


def positions(count: int) -> list:
    """Where each of the `count` pairs a stage received sits in the whole step: in a
    sharded step, the places of this process's share among every pair (what a transform
    that numbers its pairs, such as the privacy noise's seeds, must use to draw what the
    unsharded step draws); else 0 .. count - 1."""
    sharded = _CURRENT.step
    if sharded is None or sharded.positions is None:
        return list(range(count))
    return list(sharded.positions)


def sum_over_shards(value):
    """`value` added across the processes' shares inside a sharded step; else `value`."""
    sharded = _CURRENT.step
    if sharded is None or sharded.sum is None:
        return value
    return sharded.sum(value)


def share_of(optimizer, var_list: list) -> list:
    """The variables of `var_list` whose state `optimizer` (a stack) builds: all, or with
    `shard_optimizer_state=True` at the bottom of the stack this process's share.

    Raises:
      ValueError: an optimizer of the stack does not declare `shards_state = True`.
    """
    stack = optimizer.stack()
    if not getattr(stack[-1], "shard_optimizer_state", False):
        return var_list
    refused = [type(opt).__name__ for opt in stack[:-1] if not opt.shards_state]
    if refused:
        raise ValueError(
            f"shard_optimizer_state=True: {', '.join(refused)} does not declare `shards_state = True` "
            "(its state or hooks may need every variable on every process). Every built-in wrapper "
            "declares it; a wrapper of your own may, on the terms of docs/sharding.md.")
    return stack[-1].shard(var_list)
