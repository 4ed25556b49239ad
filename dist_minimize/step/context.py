"""The step context: what the parts of one training step tell each other.

A dist_minimize step passes `grads_and_vars` from stage to stage. What else one part of
the step tells a later one (how many aggregations it made, which variables this process
updates when the state is sharded, what the clipper found, which device's copies the
update being traced writes) lives in one place, this thread's `StepContext`, returned by
`dist_minimize.step_context()`. It is per thread because each replica of a
MirroredStrategy step is traced in a thread of its own, as tf.distribute's replica
context is; its fields are set for the extent of the part of the step that fills them and
put back after, so outside a dist_minimize step every field reads as its default.

A stage or a hook reads it; dist_minimize's own step writes it, through the helpers of
`dist_minimize.distribute` (`note_all_finite`, `note_scaled`, `assign_replicated`) and
the methods below.
"""

from __future__ import annotations

import threading
from typing import Any, Callable



class ShardedStep:
    """What a sharded step's aggregation registers for the rest of the step: whether this
    process updates a variable (`owns`), the places of its pairs among the step's
    (`positions`), how to complete per-pair values with every process's (`everyones`)
    and to add a scalar across processes (`sum`), and how to gather the updated
    variables after the update (`gather`); `last`: the result of this process's latest
    collective of the step, which the next one is computed after
    (`dist_minimize.aggregation.sharded.in_order`)."""

    def __init__(self):
        self.last: Any = None
        self.sum: Callable | None = None
        self.gather: Callable[[], None] | None = None
        self.owns: Callable | None = None
        self.everyones: Callable | None = None
        self.positions: list | None = None


class StepContext(threading.local):
    """This thread's view of the dist_minimize step being run or traced.

    Attributes:
      aggregations: None outside a step; inside, a description of each aggregation of
        this step's gradients so far (`aggregate_gradients` may run `allowed_aggregations`
        times: once, plus what the stack's optimizers declare in `extra_aggregations`).
      allowed_aggregations: see `aggregations`.
      zones: the watched parts of the step being run (`dist_minimize.aggregation.exactly_once`:
        the update rule, each step hook, each backend's planned collectives), innermost
        last; a collective made inside one is recorded there, or refused.
      writes: None, or the replicated writes (`dist_minimize.distribute.assign_replicated`)
        deferred to the update's one cross-replica call, as (variable, value) pairs.
      sharded: None, or the sharded view of the update being made
        (`Optimizer(shard_optimizer_state=True)`): see `share`, `positions`,
        `everyones_values` and `sum_over_shards`.
      device: None, or the index of the device whose copies the update being traced
        writes (the guarded update made device by device); `rule_inputs` then holds the
        update rule's step counter and learning rate, read before the guard's branch.
    """

    def __init__(self):
        self.aggregations: list | None = None
        self.allowed_aggregations: int = 1
        self.zones: list = []
        self.writes: list | None = None
        self.memos: dict | None = None  # what `note_all_finite` and `note_scaled` recorded, with `writes`
        self.sharded: ShardedStep | None = None
        self.device: int | None = None
        self.rule_inputs: tuple | None = None

    # -- what the transforms found (within the update's deferred section) -----------------

    def note_all_finite(self, grads, value) -> None:
        """Records that every element of `grads` is finite exactly when `value` holds."""
        if self.memos is not None:
            grads = [g for g in grads if g is not None]
            self.memos[_key(grads)] = (value, grads)  # (the tensors stay alive: ids stay unique)

    def known_all_finite(self, grads) -> Any:
        """What `note_all_finite` recorded for exactly these gradient tensors, or None."""
        entry = None if self.memos is None else self.memos.get(_key(grads))
        return entry[0] if entry is not None else None

    def note_scaled(self, outputs, inputs, factor) -> None:
        """Records that each tensor of `outputs` is `inputs[i]` scaled by `factor`."""
        if self.memos is not None:
            self.memos[("scaled", *_key(outputs))] = (list(inputs), factor, list(outputs))

    def known_scaled(self, grads) -> tuple | None:
        """`(inputs, factor)` that `note_scaled` recorded for exactly these tensors, or None."""
        entry = None if self.memos is None else self.memos.get(("scaled", *_key(grads)))
        return entry[:2] if entry is not None else None

    # -- the sharded view ---------------------------------------------------------------

    def _sharded_field(self, name: str) -> Callable | Any | None:
        return None if self.sharded is None else getattr(self.sharded, name)

    def share(self, grads_and_vars: list) -> list:
        """The pairs this process updates in a sharded step; else all of them."""
        owns = self._sharded_field("owns")
        return list(grads_and_vars) if owns is None else [(g, v) for g, v in grads_and_vars if owns(v)]

    def positions(self, count: int) -> list:
        """Where each of the `count` pairs a stage received sits among every pair of the
        step: in a sharded step, the places of this process's share (what a transform that
        numbers its pairs, such as the privacy noise's seeds, must use to draw what the
        unsharded step draws); else 0 .. count - 1."""
        positions = self._sharded_field("positions")
        return list(range(count)) if positions is None else list(positions)

    def everyones_values(self, values: list) -> list | None:
        """In a sharded step: `values` (one scalar per pair of this process's share, None
        where a pair has no gradient) completed with every other process's, one per pair
        of the whole step that has a gradient, in the step's order (one collective: a sum
        where every other process adds an exact zero). None elsewhere."""
        everyones = self._sharded_field("everyones")
        return None if everyones is None else everyones(values)

    def sum_over_shards(self, value):
        """`value` added across the processes' shares in a sharded step; else `value`."""
        total = self._sharded_field("sum")
        return value if total is None else total(value)


def _key(grads) -> tuple:
    return tuple(id(g) for g in grads if g is not None)


CONTEXT = StepContext()


def step_context() -> StepContext:
    """The calling thread's `StepContext`: what the dist_minimize step being run or
    traced has told its later parts so far (every field at its default outside a step).

    Example:
      >>> import dist_minimize as dm
      >>> dm.step_context().sharded is None  # outside a step
      True
    """
    return CONTEXT
