"""`Optimizer(shard_optimizer_state=True)`: each process keeps and updates the optimizer
state of its share of the trained variables only (ZeRO stages 1 and 2).

A step: the gradients of every variable are computed and transformed per process as
usual; `aggregate_gradients` reduce-scatters them (or all-reduces and slices them:
the Horovod backend's `shard_collective`), so each process receives the
aggregated gradients of the variables it owns (`dist_minimize.sharding.shards.Partition`) and
the rest of the step (transforms, guard, update rule, hooks) sees only those; values
over all gradients (the clipper's global norm, the guard's finiteness) are summed
across processes (`StepContext.everyones_values`, `StepContext.sum_over_shards`); after the update, every
process's new weights reach every process by an all-gather (`ShardedStep.gather`, run
by `StagedOptimizer.run_update`).
"""

from __future__ import annotations

import contextlib
import logging

import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.sharding import shards
from dist_minimize.step.stages import elements_of
from dist_minimize.step.context import CONTEXT
from dist_minimize.aggregation import exactly_once, sharded
from dist_minimize.aggregation.strategy import one_replica_per_process

logger = logging.getLogger("dist_minimize")


def check_backends(aggregating: list, given) -> None:
    """Raises ValueError unless exactly one backend aggregates, and it can shard."""
    if len(aggregating) != 1:
        raise ValueError(
            "shard_optimizer_state=True needs an aggregation backend (each process then receives its "
            "share of the aggregated gradients); with nothing aggregated there is no state to share. "
            f"Received: aggregate_gradients={given!r}")
    backend = aggregating[0]
    if backend.name not in ("auto", "horovod", "strategy"):
        raise ValueError(
            "shard_optimizer_state=True runs on the Horovod backend (horovodrun, mpirun) and on "
            "MultiWorkerMirroredStrategy's all-reduce: "
            f"the {backend.name!r} backend has no sharded step. Received: aggregate_gradients={given!r}")
    if hasattr(backend, "check_shardable"):
        backend.check_shardable()


def check_transforms(fns: list, setting: str = "shard_optimizer_state=True") -> None:
    """Raises ValueError naming each `transform_gradients` callable that does not declare
    `shards_state = True`: in a sharded step it receives this process's share of the
    pairs only, and with rank-local variables pairs whose gradients differ per process,
    so a quantity it computes over all of them (its own global norm) would be this
    process's part of it: silently wrong, or different per process."""
    refused = [getattr(fn, "__name__", None) or type(fn).__name__
               for fn in fns if getattr(fn, "shards_state", False) is not True]
    if refused:
        raise ValueError(
            f"{setting}: the `transform_gradients` callable(s) {', '.join(refused)} do not "
            "declare `shards_state = True`. In a sharded step each process's `transform_gradients` receives only "
            "the (gradient, variable) pairs of its own share, and with rank-local variables pairs whose gradients "
            "differ per process, so a value computed over all the pairs it is given (a global norm, a count) "
            "would be this process's part of it. Declare `shards_state = True` (a class "
            "attribute of a `GradientTransform`, or an attribute of the function) when it works on each pair "
            "alone or combines per-process values through `dist_minimize.step_context()`; for a global norm use "
            "`dist_minimize.clip_by_global_norm`, which combines them (docs/sharding.md).")


class Sharding:
    """The partition of one optimizer stack's variables and the backend that shards them."""

    def __init__(self, backend):
        self._given = backend
        self._owners: dict | None = None  # id(variable) -> owning process; this one for a rank-local
        self._local: set = set()
        self._strategy = None  # the strategy the partition was made under
        self.size, self.rank = 1, 0

    def _chosen(self):
        """The backend this step uses ("auto" chooses from the context: the partition's)."""
        with self._scope():
            return self._given.select() if hasattr(self._given, "select") else self._given

    def _scope(self):
        """The partition's strategy's scope, where it is not the current one (a stack's
        averages are gathered after training, often outside it)."""
        if self._strategy is None or tf.distribute.get_strategy() is self._strategy:
            return contextlib.nullcontext()
        return self._strategy.scope()

    def backend(self):
        backend = self._chosen()
        if not hasattr(backend, "reduce_scatter"):
            raise ValueError(
                "shard_optimizer_state=True runs on the Horovod backend (horovodrun, mpirun) and on "
                f"MultiWorkerMirroredStrategy; here the aggregation is {backend.name!r}. Launch with horovodrun "
                "or mpirun, or train under MultiWorkerMirroredStrategy, or pass shard_optimizer_state=False.")
        return backend

    def mine(self, var_list: list, is_local=lambda v: False) -> list:
        """This process's share of `var_list` (partitioned at the first call): its part of
        the shared variables, and every rank-local one (`is_local`: each process holds
        and updates its own, outside the partition)."""
        if self._owners is None:
            if distribute.strategy_replicas() > 1 and not one_replica_per_process():
                raise ValueError(
                    "shard_optimizer_state=True shares the state among processes, one replica each: under "
                    f"{type(tf.distribute.get_strategy()).__name__} with {distribute.strategy_replicas()} replicas "
                    f"on {len(tf.distribute.get_strategy().extended.worker_devices)} devices of this process, "
                    "tf.distribute mirrors every variable made in its scope on each of them, and gives no way "
                    "to keep one device's state on that device alone. Run one process per device: "
                    "MultiWorkerMirroredStrategy with one device per worker, or horovodrun/mpirun.")
            backend = self.backend() if distribute.strategy_replicas() > 1 else self._chosen()
            # One process and no job ("auto" chose no aggregation): the switch does nothing.
            self.size, self.rank = backend.processes() if hasattr(backend, "processes") else (1, 0)
            self._strategy = tf.distribute.get_strategy()
            self._local = {id(v) for v in var_list if is_local(v)}
            if self._local and distribute.strategy_replicas() > 1:
                raise ValueError("shard_optimizer_state=True with rank-local variables runs under Horovod only: "
                                 "a tf.distribute strategy mirrors every variable.")
            self._variables = [v for v in var_list if id(v) not in self._local]
            partition = shards.Partition.balanced([elements_of(v) for v in self._variables], self.size, self.rank)
            self._owners = {id(v): r for v, r in zip(self._variables, partition.owner)}
            self._owners.update((i, self.rank) for i in self._local)
            loads = partition.loads()
            if self.size == 1:
                logger.info("shard_optimizer_state=True with one process: nothing to share, the whole state "
                            "stays here")
            else:
                logger.info("shard_optimizer_state=True: %d variables over %d processes, elements per process "
                            "%s (this is process %d; %d rank-local variables besides)", len(self._variables),
                            self.size, loads, self.rank, len(self._local))
        return [v for v in var_list if self.owner(v) == self.rank]

    def owner(self, variable) -> int:
        try:
            return self._owners[id(variable)]
        except KeyError:
            raise ValueError(
                "A sharded optimizer updates only the variables it was built with (its state is "
                f"partitioned among them). Received: variable {getattr(variable, 'path', variable.name)!r}, "
                "not among them") from None

    def local_state(self):
        """The scope in which this process's per-variable state is made: under a strategy
        its own variables (`_compat.local_variables`: the processes hold different ones),
        else the usual scope."""
        if self._owners is not None and self.size > 1 and distribute.strategy_replicas() > 1:
            return _compat.local_variables()
        return contextlib.nullcontext()

    def gather(self) -> None:
        """Outside a step: every process's share of the shared trained variables written
        on every process (an all-gather; every process calls it)."""
        if self._owners is not None and self.size > 1:
            variables = self._variables
            with self._scope():
                self.backend().all_gather(variables, [True] * len(variables), [self.owner(v) for v in variables])

    def is_local(self, variable) -> bool:
        return id(variable) in self._local

    def held_elsewhere(self, variable) -> bool:
        """Whether `variable` is one of the stack's, its state held by another process."""
        return self._owners is not None and id(variable) in self._owners and self.owner(variable) != self.rank

    def active(self) -> bool:
        """Whether this step is sharded: inside a step's update, with several processes."""
        return self._owners is not None and self.size > 1 and CONTEXT.sharded is not None

    def reduce_scatter(self, grads_and_vars: list, scale_local=lambda pairs: pairs) -> list:
        """This process's share of the aggregated gradients, and its rank-local pairs as
        `scale_local` gives them (never aggregated); registers the step's scalar sum and
        its all-gather (`shards.ShardedStep`)."""
        backend = self.backend()
        grads_and_vars = list(grads_and_vars)
        local = [self.is_local(v) for _, v in grads_and_vars]
        owners = [self.owner(v) for _, v in grads_and_vars]  # a rank-local variable's: this process
        shared = [(p, o) for p, o, is_local in zip(grads_and_vars, owners, local) if not is_local]
        plan = backend.planned_reduce_scatters([p for p, _ in shared], [o for _, o in shared])
        with exactly_once.planned(plan, f"`aggregate_gradients ({backend.name}, sharded)`"):
            mine = iter(backend.reduce_scatter([p for p, _ in shared], [o for _, o in shared]))
        scaled = iter(scale_local([p for p, is_local in zip(grads_and_vars, local) if is_local]))
        out = [next(scaled) if is_local else next(mine)
               for o, is_local in zip(owners, local) if o == self.rank]
        self._register(backend, grads_and_vars, owners)
        return out

    def take_share(self, grads_and_vars: list) -> list:
        """This process's share of pairs aggregated already (a process's own values stand
        for every process's there; another's are never read), registering the step as
        `reduce_scatter` does, with no collective: the update of a window accumulated by
        shares (`GradientAccumulation(shard_accumulators=True)`)."""
        grads_and_vars = list(grads_and_vars)
        owners = [self.owner(v) for _, v in grads_and_vars]
        self._register(self.backend(), grads_and_vars, owners)
        return [p for p, o in zip(grads_and_vars, owners) if o == self.rank]

    def _register(self, backend, grads_and_vars: list, owners: list) -> None:
        step = CONTEXT.sharded
        variables = [v for _, v in grads_and_vars if not self.is_local(v)]
        updated = [g is not None for g, v in grads_and_vars if not self.is_local(v)]
        step.sum = lambda value: sharded.in_order(backend.sum_scalar, value)
        step.owns = lambda v: self.owner(v) == self.rank
        step.positions = [i for i, owner in enumerate(owners) if owner == self.rank]
        step.everyones = lambda values: _everyones(backend, grads_and_vars, owners, self.rank, values)
        step.gather = lambda: backend.all_gather(variables, updated, [self.owner(v) for v in variables])


def _everyones(backend, grads_and_vars: list, owners: list, rank: int, values: list) -> list:
    """Per-pair values summed over the processes: a shared pair's from its owner, a
    rank-local pair's (owned by every process) every process's added."""
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    if len(values) != len(mine):
        raise ValueError(f"A sharded step's per-pair values must be one per pair of this process's share "
                         f"({len(mine)}). Received: {len(values)} values")
    given = dict(zip(mine, values))
    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    if not present:
        return []
    dtype = next((v.dtype for v in values if v is not None), tf.float32)
    zero = tf.zeros([], dtype)
    vector = tf.stack([given[i] if given.get(i) is not None else zero for i in present])
    return tf.unstack(sharded.in_order(backend.sum_scalar, vector))


def stack_of(optimizer) -> list:
    """The optimizers of a stack, outermost first (a Keras optimizer alone: itself)."""
    return optimizer.stack() if hasattr(optimizer, "stack") else [optimizer]


def of(optimizer) -> Sharding | None:
    """The `Sharding` of a stack (its bottom's), or None where its state is not sharded."""
    return getattr(stack_of(optimizer)[-1], "_sharding", None)


def take_share(optimizer, grads_and_vars: list) -> list:
    """Pairs aggregated already, in a step of `optimizer`'s stack: this process's share
    where the stack's state is sharded (`Sharding.take_share`), else all of them."""
    sharding = of(optimizer)
    return sharding.take_share(grads_and_vars) if sharding is not None and sharding.active() else grads_and_vars


def gather_shares(optimizer) -> None:
    """For a wrapper that wrote its share of the trained variables outside a step (the
    averages, by `assign_average_vars`): every process's share on every process; every
    process calls it. Nothing where the stack's state is not sharded."""
    sharding = of(optimizer)
    if sharding is not None:
        sharding.gather()


def local_state(optimizer):
    """The scope in which an optimizer of a stack makes per-variable state for its share
    (`Sharding.local_state`; the usual scope where the stack's state is not sharded)."""
    sharding = of(optimizer)
    return sharding.local_state() if sharding is not None else contextlib.nullcontext()


def held_elsewhere(optimizer, variable) -> bool:
    """Whether `variable` is trained by the stack, its state held by another process."""
    sharding = of(optimizer)
    return sharding is not None and sharding.held_elsewhere(variable)


def held_variables(optimizer) -> list:
    """Every variable of the optimizer stack this process holds, once each (every
    optimizer of the stack: the update rule's slots and counters, the wrappers' state,
    statistics)."""
    seen, out = set(), []
    for opt in stack_of(optimizer):
        own = list(opt.variables) + list(getattr(opt, "statistics_variables", lambda: [])())
        rule = getattr(opt, "inner_optimizer", None)
        for v in own + (list(rule.variables) if rule is not None else []):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer stack's variables held by this process (`held_variables`)."""
    return sum(elements_of(v) * tf.as_dtype(v.dtype).size for v in held_variables(optimizer))
