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
* `planned(n, what)`: an aggregation backend that declares its plan
  (`Aggregator.planned_collectives`) makes exactly that many collectives.
* `step()` / `note_aggregation(what)`: `aggregate_gradients` runs once per step.

Collectives are seen at two places: every `tf.distribute.ReplicaContext.all_reduce`
call (through `_compat.listen_to_all_reduce`; one call is one collective, however many
tensors it batches), and, in graph mode, every Horovod collective op created in the
graph being traced. A one-replica all-reduce reduces nothing and is not counted.
"""

from __future__ import annotations

import collections.abc
import contextlib
import os
import sys
import threading
import types
from typing import Iterator

import keras
import tensorflow as tf

from dist_minimize import _compat

# Horovod's collective ops (op types in a traced graph).
HOROVOD_COLLECTIVES = frozenset((
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodGroupedAllgather",
    "HorovodBroadcast", "HorovodReducescatter", "HorovodGroupedReducescatter", "HorovodAlltoall"))


class AggregationError(RuntimeError):
    """A step would aggregate gradients more (or otherwise) than planned."""

    # Exception's own constructor: AutoGraph then re-raises this class from a traced
    # step (with its message), instead of a generic StagingError.
    __init__ = Exception.__init__


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


class _Zone:
    def __init__(self, what: str, plan: int | None, forbid: bool):
        self.what, self.plan, self.forbid = what, plan, forbid
        self.events: list[str] = []


class _State(threading.local):
    def __init__(self):
        self.zones: list[_Zone] = []
        self.aggregations: list[str] | None = None


_STATE = _State()
_FIX = ("dist_minimize aggregates the gradients once, in `aggregate_gradients`, and switches off "
        "the all-reduce of every Keras optimizer reachable from the one it wraps (attributes, lists, "
        "dicts) when it is built. Hold each sub-optimizer in an attribute or container of the routing "
        "optimizer, created before `build`, and make no collective inside its update (use "
        "`dist_minimize.distribute.sum_across` in a stage, outside the update rule)")


def _caller() -> str:
    """The optimizer method (or else the first frame outside TensorFlow, Keras and this
    module) that made the collective being recorded."""
    frame = sys._getframe(2)
    outside = None
    skip = (os.sep + "tensorflow" + os.sep, os.sep + "keras" + os.sep + "src" + os.sep + "backend",
            __file__, _compat.__file__)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.optimizers.Optimizer) and frame.f_code.co_name != "all_reduce":
            return (f"{type(owner).__name__} {getattr(owner, 'name', '?')!r} "
                    f"(in `{frame.f_code.co_name}`)")
        if outside is None and not any(s in frame.f_code.co_filename for s in skip):
            outside = f"{frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return outside or "an unknown caller"


def _record(event: str) -> None:
    if not _STATE.zones:
        return
    zone = _STATE.zones[-1]
    zone.events.append(event)
    if zone.forbid:
        raise AggregationError(
            f"{zone.what} made a collective: {event}. The gradients were already aggregated by "
            f"`aggregate_gradients`; this would aggregate them again (or make one replica wait for "
            f"the others inside the update). {_FIX}.")


def _on_all_reduce(context, value) -> None:
    if not _STATE.zones or getattr(context, "num_replicas_in_sync", 1) == 1:
        return
    n = len(tf.nest.flatten(value))
    _record(f"a tf.distribute all-reduce of {n} tensor{'s' if n != 1 else ''} by {_caller()}")


_compat.listen_to_all_reduce(_on_all_reduce)


@contextlib.contextmanager
def _zone(what: str, plan: int | None, forbid: bool) -> Iterator[_Zone]:
    zone = _Zone(what, plan, forbid)
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    first = len(graph.get_operations()) if graph is not None else 0
    _STATE.zones.append(zone)
    try:
        yield zone
    finally:
        _STATE.zones.pop()
    if graph is not None and graph is tf.compat.v1.get_default_graph():
        for op in graph.get_operations()[first:]:
            if op.type in HOROVOD_COLLECTIVES:
                _STATE.zones.append(zone)
                try:
                    _record(f"a Horovod {op.type} ({op.name})")
                finally:
                    _STATE.zones.pop()


@contextlib.contextmanager
def update_rule(what: str) -> Iterator[None]:
    """No collective may run inside: raises `AggregationError` naming the one that does."""
    with _zone(what, None, forbid=True):
        yield


@contextlib.contextmanager
def planned(plan: int | None, what: str) -> Iterator[None]:
    """The code inside makes exactly `plan` collectives (None: not checked).

    Raises:
      AggregationError: another number, listing the collectives made.
    """
    with _zone(what, plan, forbid=False) as zone:
        yield
    if plan is not None and len(zone.events) != plan:
        made = "; ".join(zone.events) or "none"
        raise AggregationError(
            f"{what} planned {plan} collective{'s' if plan != 1 else ''} and made {len(zone.events)}: "
            f"{made}. Exactly one aggregation per step is what keeps N replicas equal to one device.")


@contextlib.contextmanager
def step() -> Iterator[None]:
    """One step's stages: `aggregate_gradients` may run once inside (`note_aggregation`)."""
    previous, _STATE.aggregations = _STATE.aggregations, []
    try:
        yield
    finally:
        _STATE.aggregations = previous


def note_aggregation(what: str) -> None:
    """Records that `what` aggregates this step's gradients.

    Raises:
      AggregationError: the step's gradients were aggregated already.
    """
    if _STATE.aggregations is None:
        return
    _STATE.aggregations.append(what)
    if len(_STATE.aggregations) > 1:
        raise AggregationError(
            f"`aggregate_gradients` ran {len(_STATE.aggregations)} times in one step "
            f"({', '.join(_STATE.aggregations)}): the gradients would be aggregated twice. A stage "
            "must not call `aggregate_gradients` again; reduce other values with "
            "`dist_minimize.distribute.sum_across`.")
