"""An optimizer's slot table: the variables `build` received and one slot variable per
trained variable and purpose, held by the optimizer (`StagedOptimizer.add_slot`, `slot`,
`slots` ask it), and building a stack on its first step."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.sharding import sharded_state
from dist_minimize.step import stages


class SlotTable:
    """What `build` records for one optimizer: the variables it trains, in order, and its
    slots by name and variable.

    A plain object, so that TensorFlow's tracking neither wraps nor checkpoints its
    containers; the slot variables themselves are the owner's (`add_variable`), tracked
    and saved with it.
    """

    def __init__(self, owner, trained: list):
        self._owner = owner
        self.trained = tuple(trained)
        self._by_name: dict = {}
        self._keys = {_compat.variable_key(owner, v) for v in self.trained}

    def add(self, variable, name: str, initializer: Any, replica_local: bool):
        """Creates slot `name` of `variable` on the owner (see `StagedOptimizer.add_slot`)."""
        key = _compat.variable_key(self._owner, variable)
        if key not in self._keys:
            raise ValueError(f"`add_slot`: {stages.variable_name(variable)} is not a variable this optimizer "
                             f"was built for. Received: name={name!r}")
        table = self._by_name.setdefault(name, {})
        if key in table:
            raise ValueError(f"Slot {name!r} already exists for {stages.variable_name(variable)}.")
        slot_name = f"{stages.slot_prefix(variable)}_{name}"
        if replica_local:
            if initializer != "zeros":
                raise ValueError("A replica-local slot starts at zeros (each replica's share of a "
                                 f"sum). Received: initializer={initializer!r}")
            slot = _compat.add_replica_local_variable(self._owner, variable, name=slot_name)
        else:
            with sharded_state.local_state(self._owner):  # a sharded stack's: this process's own
                slot = _compat.add_replicated_variable(self._owner, variable, name=slot_name,
                                                       initializer=initializer)
        table[key] = slot
        return slot

    def get(self, name: str, variable):
        """Slot `name` of `variable`, or KeyError naming both."""
        try:
            return self._by_name[name][_compat.variable_key(self._owner, variable)]
        except KeyError:
            raise KeyError(f"{type(self._owner).__name__} has no slot {name!r} for "
                           f"{stages.variable_name(variable)}") from None


def build_on_first_use(optimizer, variables: list) -> None:
    """Builds `optimizer`'s stack from its first `minimize`/`apply_gradients` when `build`
    was not called.

    As an explicit `build` under the strategy scope would: once, in the cross-replica
    context (a `merge_call` from the replicas), outside any function being traced
    (`tf.init_scope`), under the strategy in use. Built in the replica context of a traced
    step instead, a variable whose initial value the graph computes (a replica's copy of
    the first replica's value, a slot that starts from the weights) cannot be lifted out
    of the function: under MirroredStrategy TensorFlow then fails with "You must feed a
    value for placeholder tensor 'cond/else/_1/cond/Placeholder'".

    Where the variables were themselves created in the function being traced (a model
    built by its first traced step, as Keras's `fit` does without a strategy), their
    values exist only inside it: the stack is then built there, as Keras builds.
    """
    stages.check_variables_in_strategy(variables)
    if not _compat.initialized_outside_functions(variables):
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        return
    strategy = tf.distribute.get_strategy()

    def build(*_):
        if optimizer.built:
            return
        with tf.init_scope(), strategy.scope(), keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)

    context = tf.distribute.get_replica_context()
    if context is None:
        build()
    else:
        context.merge_call(build)
