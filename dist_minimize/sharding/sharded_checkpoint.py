"""Checkpoints of a sharded optimizer state (`shard_optimizer_state=True`): one file per
process and a manifest, read back on any number of processes. Part of `Checkpointer`.

Why one file per process, not a gathered state written by one: no process ever holds
more than its own share (the gathered alternative would put the whole state in rank 0's
memory at every save, what sharding exists to avoid), and nothing moves between
processes but the names of what each holds.

The layout of `ckpt-N/`:

* `state`: the model (its weights are the same on every process), written by rank 0;
* `shards/process-R`: every variable of the optimizer stack process R holds (its share
  of the slots and per-variable state, and the counters every process holds alike);
* `meta.json`'s `"sharded"`: the number of processes and, per file, the variables it
  holds by their keys (`held_by_key`: `3:0/momentum`, the momentum of the first trained
  variable in the update rule, the stack's fourth optimizer). A key names the variable
  a slot belongs to, not its place in a partition, so it stands for the same state
  whatever the number of processes.

A restore, on M processes (M may differ from N; one process unsharded included),
builds the stack (its partition for M), then fills each variable it holds from the
first file holding its key. A variable found in no file is an error naming it.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil

import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.sharding import sharded_state
from dist_minimize.step.stages import slot_prefix  # how Keras and dist_minimize name a variable's slots

SHARDS = "shards"


def held_by_key(optimizer, trained: list) -> dict:
    """key -> variable, for every variable of the optimizer stack this process holds.

    A key names what a variable is, not what it was called in one process: "OWNER:NAME"
    where OWNER is the position in the stack of the optimizer that created it (the
    update rule last) and NAME its name; a slot's name starts with its trained
    variable's path (`adam/dense_kernel_momentum`), replaced by the variable's index in
    `trained` (`3:0/momentum`). Keras numbers the names of its objects in creation order
    (`adam_2`, `dense_4`), so a name alone would differ between two builds of one model.

    Raises:
      ValueError: two variables get the same key (the checkpoint could not tell them apart).
    """
    owners = [opt.name for opt in _layers(optimizer)]
    prefixes = sorted(((slot_prefix(v) + "_", i) for i, v in enumerate(trained)), key=lambda p: -len(p[0]))
    out: dict = {}
    for variable in sharded_state.held_variables(optimizer):
        creator = variable.path.split("/")[0]
        owner = owners.index(creator) if creator in owners else creator
        name = variable.path.split("/")[-1]
        prefix, index = next(((p, i) for p, i in prefixes if name.startswith(p)), (None, None))
        key = f"{owner}:{name}" if prefix is None else f"{owner}:{index}/{name[len(prefix):]}"
        if key in out:
            raise ValueError(f"Two variables of the optimizer stack ({out[key].path!r}, {variable.path!r}) "
                             f"are both {key!r} to a sharded checkpoint: give the optimizers distinct names.")
        out[key] = variable
    return out


def slot_index(key: str) -> int | None:
    """The index in `trained` of the variable whose slot `key` names (`"OWNER:INDEX/NAME"`,
    `held_by_key`), None for a key of another variable (`"OWNER:NAME"`)."""
    return int(key.split(":", 1)[1].split("/")[0]) if "/" in key else None


def _layers(optimizer) -> list:
    """The optimizers of the stack, outermost first, and its update rule last."""
    stack = sharded_state.stack_of(optimizer)
    return stack + [getattr(stack[-1], "inner_optimizer", stack[-1])]


def _classes(optimizer) -> list:
    return [type(opt).__name__ for opt in _layers(optimizer)]


def write_share(directory: str, rank: int, optimizer, trained: list) -> list:
    """Writes this process's file into `directory/shards`; returns the keys it holds."""
    held = held_by_key(optimizer, trained)
    paths = sorted(held)
    tf.train.Checkpoint(state={str(i): held[p] for i, p in enumerate(paths)}).write(
        os.path.join(directory, SHARDS, f"process-{rank}"))
    return paths


def manifest(held_by_process: list, optimizer) -> dict:
    """`meta.json`'s "sharded" entry from each process's keys (rank order)."""
    return {"processes": len(held_by_process), "stack": _classes(optimizer),
            "files": [f"{SHARDS}/process-{r}" for r in range(len(held_by_process))],
            "held": held_by_process}


def read(directory: str, entry: dict, optimizer, trained: list) -> None:
    """Fills every variable of the stack this process holds from the checkpoint in
    `directory` (its manifest `entry`).

    Raises:
      ValueError: a variable this process holds is in no file of the checkpoint.
    """
    if entry["stack"] != _classes(optimizer):
        raise ValueError(f"The checkpoint in {directory} was written by the optimizer stack {entry['stack']}; "
                         f"this one is {_classes(optimizer)}. Resume with the stack that wrote it.")
    held = held_by_key(optimizer, trained)
    where: dict = {}
    for file, paths in zip(entry["files"], entry["held"]):
        for index, path in enumerate(paths):
            where.setdefault(path, (file, index))
    missing = sorted(p for p in held if p not in where)
    if missing:
        raise ValueError(
            f"The checkpoint in {directory} holds no value for {missing[:5]}"
            f"{' and others' if len(missing) > 5 else ''}: it was written by another optimizer stack "
            f"(it holds {sum(len(p) for p in entry['held'])} values in {entry['processes']} files).")
    by_file: dict = {}
    for path, variable in held.items():
        file, index = where[path]
        by_file.setdefault(file, {})[str(index)] = variable
    for file, state in sorted(by_file.items()):
        status = tf.train.Checkpoint(state=state).read(os.path.join(directory, file))
        status.assert_existing_objects_matched()
        status.expect_partial()  # the rest of that file belongs to other processes


def save(checkpointer, name: str, rank: int) -> str | None:
    """`Checkpointer.save` of a sharded stack: every process writes its share into
    `.tmp-NAME/shards`, then rank 0 the model and the manifest, and renames. Returns the
    checkpoint's path on rank 0."""
    collect = _collector(checkpointer.optimizer, name)
    tmp = os.path.join(checkpointer.directory, f".tmp-{name}")
    if rank == 0:
        os.makedirs(checkpointer.directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    collect(None)  # a barrier: the directory exists before any process writes into it
    paths = write_share(tmp, rank, checkpointer.optimizer, checkpointer.model.trainable_variables)
    held = collect(paths)  # and a barrier: every process's file is written
    if rank != 0:
        return None
    checkpointer.write_files(tmp, manifest(held, checkpointer.optimizer))
    return checkpointer._publish(tmp, name)


def _collector(optimizer, name: str):
    """`collect(x)`: every process's `x` (JSON values), in rank order, on every process;
    also a barrier. Horovod: `allgather_object`; MultiWorkerMirroredStrategy: through
    its coordination service (each process posts under its rank, reads every rank's)."""
    if distribute.horovod_size() > 1:
        hvd = distribute.horovod()
        return lambda x: list(hvd.allgather_object(x))
    sharding = sharded_state.of(optimizer)
    if sharding is None or sharding.size == 1:
        return lambda x: [x]
    client, calls = _compat.coordination_client(), itertools.count()

    def collect(x):
        key = f"dist_minimize/{name}/{next(calls)}"
        client.set_config_key_value(f"{key}/{sharding.rank}", json.dumps(x))
        return [json.loads(client.get_config_key_value(f"{key}/{r}")) for r in range(sharding.size)]

    return collect
