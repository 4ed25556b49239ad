"""What the two averaging wrappers share: the `average` slots, swapping them in, writing them out."""

from __future__ import annotations

import contextlib
import logging

import tensorflow as tf

from dist_minimize.sharding import sharded_state
from dist_minimize.step.stages import variable_name
from dist_minimize.wrappers.base import OptimizerWrapper, swap_values

logger = logging.getLogger("dist_minimize")


class AveragingWrapper(OptimizerWrapper):
    """Base of `MovingAverage` and `SWA`: one replicated `average` slot per variable.

    The averages start as the variables' values at `build` and are updated after each
    applied update (`on_applied`), from the weights every replica holds alike, so they
    are identical on every replica and process and cost one synchronisation per update
    under merge-call strategies. They are optimizer state: checkpointed and saved with
    the optimizer.
    """

    once_per_stack = True
    # Sharded (docs/sharding.md): each process averages its share; `averaged_weights` and
    # `assign_average_vars` then gather every process's averages (collectives).
    shards_state = True

    def build_state(self, var_list):
        """Creates one `average` slot per variable, starting at its value."""
        for v in var_list:
            self.add_slot(v, "average", initializer="value")

    def average_of(self, variable):
        """The average of `variable` (a variable, after `build`)."""
        return self.slot("average", variable)

    def averaged_weights(self):
        """A context manager: the averages in the trained variables, the weights back after.

        `with opt.averaged_weights(): model.evaluate(...)` (or `model.save(...)`).
        Outside the training step (in the cross-replica context under a strategy). With
        the state sharded, every process's averages are gathered in, and the weights
        after: every process enters and leaves the block.
        """
        self._check_built("averaged_weights")
        mine = [v for v in self.trained_variables if not sharded_state.held_elsewhere(self, v)]
        return _gathered(swap_values(mine, [self.average_of(v) for v in mine]), self)

    def assign_average_vars(self, var_list=None):
        """Writes the averages into `var_list` (default: every trained variable), for good.

        TF Addons' name for it; the usual last step of training before saving the final
        model. Outside the training step. As in TF Addons, a variable of `var_list` that
        this optimizer does not average (e.g. a BatchNormalization layer's moving mean
        and variance when `var_list` is `model.variables`) is left as it is: the call
        logs ONE warning (logger "dist_minimize") naming every variable it skipped
        (TF Addons warns once per variable).

        Args:
          var_list: the variables to overwrite with their averages; None: every
            variable this optimizer trains.

        Returns:
          The variables skipped (a list, empty when every one was averaged).

        Raises:
          ValueError: before `build`.
        """
        self._check_built("assign_average_vars")
        skipped = []
        for v in (self.trained_variables if var_list is None else list(var_list)):
            try:
                average = self.slot("average", v)
            except KeyError:
                if not sharded_state.held_elsewhere(self, v):  # sharded: another process averages it
                    skipped.append(v)
                continue
            v.assign(tf.convert_to_tensor(average))
        sharded_state.gather_shares(self)  # sharded: every process's averages, everywhere
        if skipped:
            logger.warning("%s.assign_average_vars: skipped %d variable(s) it does not average (left as they "
                           "are): %s", type(self).__name__, len(skipped),
                           ", ".join(variable_name(v) for v in skipped))
        return skipped

    def _check_built(self, what):
        if not self.built:
            raise ValueError(f"`{what}` needs the optimizer built (it has no averages yet): train a step, or "
                             "call `optimizer.build(model.trainable_variables)`.")


@contextlib.contextmanager
def _gathered(swap, optimizer):
    """`swap` with every process's share gathered after it begins and after it ends."""
    try:
        with swap:
            sharded_state.gather_shares(optimizer)
            yield
    finally:
        sharded_state.gather_shares(optimizer)
