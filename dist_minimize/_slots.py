"""Slot storage of a dist_minimize optimizer: one variable per trained variable and
purpose (`add_slot`, `slot`, `slots`), saving and restoring an optimizer's own state, and
building the stack on first use. A mixin of `StagedOptimizer`."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.sharding import sharded_state
from dist_minimize.step import stages


class SlotStorage:
    """`add_slot`/`slot`/`slots` and the optimizer's own saved state (see the module docstring)."""

    @property
    def trained_variables(self) -> list:
        """The variables this optimizer was built for, in order (empty before `build`)."""
        state = getattr(self, "_dm_state", None)
        return list(state.trained) if state is not None else []

    def add_slot(self, variable, name: str, initializer: Any = "zeros", replica_local: bool = False):
        """Creates this optimizer's slot `name` for `variable` (in `build_state`) and returns it.

        Args:
          variable: a trainable variable of `build`'s `var_list`.
          name: the slot's name (one per purpose: "average", "slow", ...).
          initializer: a Keras initializer (or its name), or `"value"`: start from the
            variable's current value.
          replica_local: False (default): ONE replicated value, identical on every
            replica (mirrored, written from the first replica, which holds the same
            value as the others by contract): for state every replica computes alike
            from aggregated values (averages, slow weights). True: each replica keeps
            its own copy and updates it without communication (accumulators of
            per-replica gradients); read outside the replica context, and so in
            checkpoints and `.keras` files, it is the SUM of the copies, and a
            restored value is split evenly among the replicas (TensorFlow's sync-on-read
            SUM variable).

        Returns:
          The slot variable (also returned later by `slot(name, variable)`).

        Raises:
          ValueError: called before `build_state`, twice for the same slot, or for a
            variable `build` did not receive.
        """
        state = getattr(self, "_dm_state", None)
        if state is None:
            raise ValueError(f"`add_slot` must be called from `build_state`. Received: name={name!r}")
        key = _compat.variable_key(self, variable)
        if key not in {_compat.variable_key(self, v) for v in self.trained_variables}:
            raise ValueError(f"`add_slot`: {stages.variable_name(variable)} is not a variable this optimizer "
                             f"was built for. Received: name={name!r}")
        table = state.slots.setdefault(name, {})
        if key in table:
            raise ValueError(f"Slot {name!r} already exists for {stages.variable_name(variable)}.")
        if replica_local:
            if initializer != "zeros":
                raise ValueError("A replica-local slot starts at zeros (each replica's share of a "
                                 f"sum). Received: initializer={initializer!r}")
            slot = _compat.add_replica_local_variable(self, variable, name=f"{stages.slot_prefix(variable)}_{name}")
        else:
            with sharded_state.local_state(self):  # a sharded stack's: this process's own
                slot = _compat.add_replicated_variable(self, variable, name=f"{stages.slot_prefix(variable)}_{name}",
                                                       initializer=initializer)
        table[key] = slot
        return slot

    def slot(self, name: str, variable):
        """This optimizer's slot `name` of `variable` (see `add_slot`).

        Raises:
          KeyError: no such slot (naming the slot and the variable).
        """
        try:
            return self._dm_state.slots[name][_compat.variable_key(self, variable)]
        except (KeyError, TypeError, AttributeError):
            raise KeyError(f"{type(self).__name__} has no slot {name!r} for "
                           f"{stages.variable_name(variable)}") from None

    def slots(self, name: str) -> list:
        """Slot `name` of every variable this optimizer was built for, in order."""
        return [self.slot(name, v) for v in self.trained_variables]

    def save_own_variables(self, store):
        """Saves this optimizer's own state (Keras saves each wrapped optimizer, and the
        inner Keras optimizer, under its own path: every variable is written once)."""
        for i, variable in enumerate(_compat.own_variables(self)):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Restores what `save_own_variables` wrote.

        Raises:
          ValueError: the file holds a different number of arrays for this optimizer.
        """
        own = _compat.own_variables(self)
        if len(store.keys()) != len(own):
            raise ValueError(
                f"Cannot restore optimizer {self.name!r} ({type(self).__name__}): it has {len(own)} "
                f"state variables and the file holds {len(store.keys())} (built for another model, "
                "or saved with another optimizer stack).")
        for i, variable in enumerate(own):
            variable.assign(store[str(i)])

    def _build_on_first_use(self, variables: list) -> None:
        """Builds the stack from `minimize`/`apply_gradients` when `build` was not called.

        As an explicit `build` under the strategy scope would: once, in the cross-replica
        context (a `merge_call` from the replicas), outside any function being traced
        (`tf.init_scope`), under the strategy in use. Built in the replica context of a
        traced step instead, a variable whose initial value the graph computes (a
        replica's copy of the first replica's value, a slot that starts from the weights)
        cannot be lifted out of the function: under MirroredStrategy TensorFlow then
        fails with "You must feed a value for placeholder tensor
        'cond/else/_1/cond/Placeholder'".

        Where the variables were themselves created in the function being traced (a model
        built by its first traced step, as Keras's `fit` does without a strategy), their
        values exist only inside it: the stack is then built there, as Keras builds.

        Args:
          variables: the variables to build for (the first step's).
        """
        stages.check_variables_in_strategy(variables)
        if not _compat.initialized_outside_functions(variables):
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            return
        strategy = tf.distribute.get_strategy()

        def build(*_):
            if self.built:
                return
            with tf.init_scope(), strategy.scope(), keras.name_scope(self.name, caller=self):
                self.build(variables)

        context = tf.distribute.get_replica_context()
        if context is None:
            build()
        else:
            context.merge_call(build)


class _BuiltState:
    """What `build` records: the trained variables and the slots (a plain object, so that
    TensorFlow's tracking neither wraps nor checkpoints these containers; the slot
    variables themselves are tracked by `add_variable`)."""

    def __init__(self, trained: list):
        self.trained = tuple(trained)
        self.slots: dict = {}

