"""Exactly one aggregation per step: made so by construction, and checked where it can break.

Construction: the Keras optimizer inside `dist_minimize.Optimizer` provides only an
update rule. Keras's TensorFlow optimizer all-reduces gradients itself inside `apply`
(`_all_reduce_sum_gradients`); `neutralise(optimizer)` switches that off in EVERY Keras
optimizer reachable from the wrapped one (its attributes, lists, dicts and mappings,
followed recursively), so an optimizer that routes variables to other optimizers
(`keras.optimizers.MultiOptimizer`, or a router of your own) has none of its
sub-optimizers reduce again.

Check: what construction cannot see (a sub-optimizer created during the update, an
update rule that calls a collective itself) is caught the first time the step is traced
(and on every eager step), with an error naming it:

* `update_rule(name)`: no collective may run inside the update rule. A
  `tf.distribute` replica-context all-reduce raises at once; a Horovod collective op
  made in the traced graph raises when the update rule returns.
* `step_hook(optimizer, name)`: the same for every step hook (`apply_updates`,
  `on_applied`, `on_skipped`), whatever its class: the update contract that lets every
  stack be updated device by device (`dist_minimize.distribute.sum_across` called in a
  hook raises too).
* `planned(n, what)`: an aggregation backend that declares its plan
  (`Aggregator.planned_collectives`) makes exactly that many collectives.
* `step()` / `note_aggregation(what)`: `aggregate_gradients` runs once per step.

Collectives are seen at two places: every `tf.distribute.ReplicaContext.all_reduce`
call made inside a zone (`_compat.hearing_all_reduce`, entered by each zone and left
with it: outside dist_minimize's own step TensorFlow is unchanged; one call is one
collective, however many tensors it batches), and, in graph mode, every Horovod collective op created in the
graph being traced. A one-replica all-reduce reduces nothing and is not counted.
"""

from __future__ import annotations

import collections.abc
import contextlib
import os
import sys
import types
from typing import Iterator

import keras
import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.step import zones
from dist_minimize.step.zones import AggregationError  # noqa: F401  (re-exported)
from dist_minimize.step.context import CONTEXT

# -- construction ---------------------------------------------------------------------

_NOT_FOLLOWED = (tf.Variable, tf.Tensor, keras.Variable, keras.layers.Layer, tf.distribute.Strategy,
                 types.ModuleType, types.FunctionType, types.MethodType, type)


def keras_optimizers(root: keras.optimizers.Optimizer) -> list:
    """Every Keras optimizer reachable from `root` (itself first): through instance
    attributes, lists, tuples, sets, dicts and mappings, recursively.

    Not followed: variables, tensors, layers, strategies, modules, functions and classes
    (an update rule holds its sub-optimizers as plain attributes or containers).
    """
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _NOT_FOLLOWED) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, keras.optimizers.Optimizer):
            found.append(obj)
        if isinstance(obj, (str, bytes, int, float, bool)):
            continue
        if isinstance(obj, collections.abc.Mapping):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)
        else:
            children = []
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            children += list(state.values())
        todo.extend(reversed(children))
    return found


def neutralise(root: keras.optimizers.Optimizer) -> list:
    """Switches off Keras's own gradient all-reduce in every Keras optimizer reachable
    from `root` (see `keras_optimizers`); returns them."""
    found = keras_optimizers(root)
    for opt in found:
        _compat.disable_keras_all_reduce(opt)
    return found


# -- the check ------------------------------------------------------------------------


_RULE_FIX = (
    "The gradients were already aggregated by `aggregate_gradients`; this would aggregate them again (or make "
    "one replica wait for the others inside the update). dist_minimize aggregates the gradients once, in "
    "`aggregate_gradients`, and switches off the all-reduce of every Keras optimizer reachable from the one it "
    "wraps (attributes, lists, dicts) when it is built. Hold each sub-optimizer in an attribute or container of "
    "the routing optimizer, created before `build`, and make no collective inside its update (use "
    "`dist_minimize.distribute.sum_across` in a stage, outside the update rule)")


def _caller() -> str:
    """The optimizer method (or else the first frame outside TensorFlow, Keras and this
    module) that made the collective being recorded."""
    frame = sys._getframe(2)
    outside = None
    skip = (os.sep + "tensorflow" + os.sep, os.sep + "keras" + os.sep + "src" + os.sep + "backend",
            __file__, os.path.dirname(_compat.__file__))
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.optimizers.Optimizer) and frame.f_code.co_name != "all_reduce":
            return (f"{type(owner).__name__} {getattr(owner, 'name', '?')!r} "
                    f"(in `{frame.f_code.co_name}`)")
        if outside is None and not any(s in frame.f_code.co_filename for s in skip):
            outside = f"{frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return outside or "an unknown caller"


def _on_all_reduce(context, value) -> None:
    if not zones.active() or getattr(context, "num_replicas_in_sync", 1) == 1:
        return
    n = len(tf.nest.flatten(value))
    zones.record(f"a tf.distribute all-reduce of {n} tensor{'s' if n != 1 else ''} by {_caller()}")


_compat.listen_to_all_reduce(_on_all_reduce)


@contextlib.contextmanager
def update_rule(what: str) -> Iterator[None]:
    """No collective may run inside: raises `AggregationError` naming the one that does."""
    with zones.zone(what, None, forbid=True, fix=_RULE_FIX):
        yield


_HOOK_FIX = (
    "A step hook runs inside the update, device by device under MirroredStrategy and "
    "MultiWorkerMirroredStrategy: it may read and write variables, and use "
    "`dist_minimize.distribute.run_if` and `flush_updates`, but make no collective and wait for no "
    "other replica. Reduce values across replicas in a stage before the update "
    "(`transform_gradients`, or `update_condition` for a decision) with "
    "`dist_minimize.distribute.sum_across`, and keep the result in a variable the hook reads")


@contextlib.contextmanager
def step_hook(optimizer, name: str) -> Iterator[None]:
    """The step hook `name` of `optimizer` runs inside: no collective may (the update
    contract, docs/writing-a-wrapper.md); raises `AggregationError` naming the hook."""
    with zones.zone(f"The step hook `{type(optimizer).__name__}.{name}`", None, forbid=True, fix=_HOOK_FIX):
        yield


@contextlib.contextmanager
def planned(plan: int | None, what: str) -> Iterator[None]:
    """The code inside makes exactly `plan` collectives (None: not checked).

    Raises:
      AggregationError: another number, listing the collectives made.
    """
    with zones.zone(what, plan, forbid=False) as zone:
        yield
    if plan is not None and len(zone.events) != plan:
        made = "; ".join(zone.events) or "none"
        raise AggregationError(
            f"{what} planned {plan} collective{'s' if plan != 1 else ''} and made {len(zone.events)}: "
            f"{made}. Exactly one aggregation per step is what keeps N replicas equal to one device.")


@contextlib.contextmanager
def step(allowed: int = 1) -> Iterator[None]:
    """One step: `aggregate_gradients` may run `allowed` times inside (`note_aggregation`):
    once, plus the extra aggregations the stack's optimizers declare
    (`StagedOptimizer.extra_aggregations`). A step opened inside another is part of it."""
    if CONTEXT.aggregations is not None:
        yield
        return
    CONTEXT.aggregations, CONTEXT.allowed_aggregations = [], allowed
    try:
        yield
    finally:
        CONTEXT.aggregations, CONTEXT.allowed_aggregations = None, 1


def in_step() -> bool:
    """Whether this thread is inside a step's stages (`step`)."""
    return CONTEXT.aggregations is not None


def note_aggregation(what: str) -> None:
    """Records that `what` aggregates this step's gradients.

    Raises:
      AggregationError: the step's gradients were aggregated as many times as declared.
    """
    if CONTEXT.aggregations is None:
        return
    CONTEXT.aggregations.append(what)
    allowed = CONTEXT.allowed_aggregations
    if len(CONTEXT.aggregations) > allowed:
        raise AggregationError(
            f"`aggregate_gradients` ran {len(CONTEXT.aggregations)} times in one step "
            f"({', '.join(CONTEXT.aggregations)}), {allowed} declared: the gradients would be aggregated "
            "again. A stage that aggregates other gradients on purpose (SAM aggregates the gradient it "
            "perturbs the weights along) declares it: `extra_aggregations = 1` on its class (docs/"
            "writing-a-wrapper.md, the wrapper contract); reduce other values with "
            "`dist_minimize.distribute.sum_across`.")
