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
the processes' shares: `StepContext.sum_over_shards` adds a scalar (the guard's count
of non-finite elements) across processes, one collective, and does nothing outside a
sharded step. The step ends with the new weights of every process's share gathered by
all (`ShardedStep.gather`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence


from dist_minimize.step.context import CONTEXT, ShardedStep


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


@contextlib.contextmanager
def step() -> Iterator[ShardedStep]:
    """One update's sharding context, `StepContext.sharded` (empty until a sharding
    aggregation fills it)."""
    previous, CONTEXT.sharded = CONTEXT.sharded, ShardedStep()
    try:
        yield CONTEXT.sharded
    finally:
        CONTEXT.sharded = previous


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
