"""Exact resume at step granularity: `Checkpointer` saves the model, the whole optimizer
stack and the input position every `every` batches and when the job is asked to stop
(SIGTERM), and a restarted job continues from the exact batch, ending with the same
weights and optimizer variables as a run never interrupted (bit for bit on CPU).

How exactness is kept, by construction:

* **Saves happen only at update boundaries.** With a `GradientAccumulation` in the
  stack, a save waits for the end of the accumulation window, where every replica-local
  accumulator is zero; so the chief's file holds the whole state, and no sum of
  per-replica values is ever split back into shares. `save` checks the stack's
  micro-step counter and refuses a save inside a window.
* **Every worker takes part in the same save at the same step.** A stop request (a
  signal to any one worker) is agreed at the next update boundary with one tiny
  collective among the workers (none inside a window, none in one process); under
  MultiWorkerMirroredStrategy every worker then writes (TensorFlow's save reads
  replica-local variables with a collective), the chief into the checkpoint directory
  and the others into temporary directories inside it that are removed at once. Under
  Horovod rank 0 writes alone; a sharded state: each its share (`_sharded_checkpoint`).
* **Atomic writes.** A checkpoint is written into `DIR/.tmp-ckpt-N`, synced, and renamed
  to `DIR/ckpt-N`: a crash during a write leaves the previous checkpoint the newest.
* **The input is one stream.** `fit` trains on `dataset.repeat()` with `steps_per_epoch`
  (one iterator across epochs), in the uninterrupted run too, and a resumed run skips
  the batches already trained (`stream.skip(step)`), so it sees exactly the batches the
  uninterrupted run sees next. The dataset must be deterministic (a seeded shuffle).

Usage with `fit`::

    ckpt = dm.Checkpointer("/shared/run1", model, every=100)
    ckpt.fit(train_dataset, epochs=5)          # restores, trains, saves; exits 42 on SIGTERM

and in a custom loop::

    ckpt = dm.Checkpointer(directory, model, optimizer, every=100)
    start = ckpt.restore()                     # batches already trained (0 at first)
    it = iter(stream.skip(start))
    for _ in range(start, total_batches):
        train_step(next(it))
        if ckpt.step_done():                   # a stop was requested and saved
            ckpt.exit()                        # exit status 42: "restart me"
    ckpt.finish()                              # the final save

See docs/fault-tolerance.md.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import sys
from typing import Any

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.sharding import sharded_checkpoint
from dist_minimize.sharding import sharded_state
from dist_minimize.sharding import local
from dist_minimize._stop_watcher import _StopWatcher

PREFIX = "ckpt-"
RESTART_EXIT_CODE = 42  # TensorFlow's and Kubernetes' convention for "preempted, restart me"


def latest(directory: str) -> tuple[int, str] | None:
    """(updates trained, path) of the newest complete checkpoint in `directory`, or None.
    Only renamed, complete checkpoints count (`ckpt-N`, N = updates: the same position on
    any number of workers); a `.tmp-*` left by a crash is ignored."""
    found = _complete(directory)
    return (found[-1][0], os.path.join(directory, found[-1][1])) if found else None


def _complete(directory: str | None) -> list[tuple[int, str]]:
    """The complete checkpoints in `directory` as (updates, name), oldest first: updates
    from `meta.json` (a checkpoint named by batches, as written before names counted
    updates, sorts by its updates too)."""
    if not directory or not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        meta_path = os.path.join(directory, name, "meta.json")
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit() and os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            found.append((meta["step"] // meta.get("micro_steps_per_update", 1), name))
    return sorted(found)


class Checkpointer:
    """Saves and restores a Keras model with its dist_minimize optimizer stack and the
    input position, for exact resumption after a lost or preempted worker. A sharded
    stack (`shard_optimizer_state=True`) is written one file per process and resumes on
    any number of processes (docs/sharding.md).

    Args:
      directory: where checkpoints go (`DIR/ckpt-N`, N = updates trained); one directory
        that every worker reads (this machine, or a shared filesystem). None: train
        through the same input stream and agree on stops, but save nothing.
      model: a built Keras model.
      optimizer: its optimizer (default: `model.optimizer`).
      every: save every `every` batches (micro-batches with accumulation), at the next
        update boundary.
      keep: how many checkpoints to keep (older ones are removed by the chief).
      grace: seconds a process may take, after SIGTERM, to reach a boundary, save and exit
        before it exits anyway (a process blocked on a dead peer). Keep it below the
        launcher's 10 s.
      exit_code: the status `exit` ends the process with after a stop (42: restart me).
    """

    def __init__(self, directory: str | None, model: keras.Model, optimizer: Any = None, every: int = 100,
                 keep: int = 2, grace: float = 8.0, exit_code: int = RESTART_EXIT_CODE):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a Keras model. Received: model={model!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"`every` must be an integer >= 1. Received: every={every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"`keep` must be an integer >= 1. Received: keep={keep!r}")
        self.directory = os.path.abspath(directory) if directory else None
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        if self.optimizer is None:
            raise ValueError("`optimizer` is None and the model has none: compile the model or pass `optimizer`.")
        self._sharded = sharded_state.of(self.optimizer) is not None
        self.every, self.keep, self.exit_code = every, keep, exit_code
        self.step = 0  # batches trained since the job began
        self.stopping = False
        self._saved = 0
        self._micro = _micro_steps(self.optimizer)
        self._strategy = model.distribute_strategy
        self._agree_fn = None
        self._watcher = _StopWatcher(grace)

    # -- the position ---------------------------------------------------------------------

    def restore(self) -> int:
        """Restores the newest complete checkpoint (model, optimizer stack, position) and
        returns the number of batches already trained (0 when there is none)."""
        self._build()
        found = latest(self.directory)
        if self._is_writer() and self.directory and os.path.isdir(self.directory):
            _remove_temporaries(self.directory)
        if found is None:
            return 0
        _, path = found
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        sharded = meta.get("sharded")
        step = self._position(meta, path)
        if sharded is not None:  # written sharded: read back on any number of processes
            self._checkpoint(sharded).read(os.path.join(path, "state")).assert_existing_objects_matched()
            sharded_checkpoint.read(path, sharded, self.optimizer, self.model.trainable_variables)
        elif self._sharded and _worker()[1] > 1:
            raise ValueError(
                f"The checkpoint {path} was written with the optimizer state unsharded; this run shards "
                "it (shard_optimizer_state=True) over several processes. Resume it unsharded (on any "
                "number of processes), then save: checkpoints written sharded resume either way.")
        else:
            self._checkpoint().read(os.path.join(path, "state")).assert_existing_objects_matched()
        own = local.checkpointed(self.model, self.optimizer)
        if own:
            local.read(self.directory, os.path.basename(path), _worker()[0], own)
        if step != meta["step"]:  # another accumulation (workers changed): windows start at the new count
            _set_micro_steps(self.optimizer, step)
            if self._is_writer():
                print(f"[dist_minimize] resumed update {step // self._micro} of {path}: written by "
                      f"{meta.get('workers', '?')} worker(s) making {meta['micro_steps_per_update']} micro-batches "
                      f"per update, now {_worker()[1]} making {self._micro}", flush=True)
        self.step = self._saved = step
        return step

    def _position(self, meta: dict, path: str) -> int:
        """This process's batches trained at the checkpoint `meta` describes: its updates
        times this job's micro-batches per update. Another accumulation is refused unless
        the workers changed with it, keeping the micro-batches of an update (K * N: a
        `dm.elastic` job on another number of workers, whose update t takes the same
        micro-batches on any N)."""
        written_micro = meta.get("micro_steps_per_update", self._micro)
        written_workers, workers = meta.get("workers", _worker()[1]), _worker()[1]
        if written_micro != self._micro and written_micro * written_workers != self._micro * workers:
            raise ValueError(
                f"The checkpoint {path} was written by {written_workers} worker(s) making {written_micro} "
                f"micro-batches per update each; this job's {workers} make {self._micro}, so an update would "
                "take other samples. Resume with the same accumulation, or with micro-batches per update times "
                "workers unchanged (dm.elastic: a fixed global batch and micro-batch; docs/elastic.md).")
        return meta["step"] // written_micro * self._micro

    def step_done(self) -> bool:
        """Call after every batch (micro-batch). Saves when one is due; returns True when a
        stop was requested (on any worker), agreed and saved: leave the loop then."""
        self.step += 1
        if self.step % self._micro:
            return False  # inside an accumulation window: nothing is saved, nothing agreed
        self.stopping = self._any_worker(self._watcher.requested())
        if self.stopping or (self.directory and self.step - self._saved >= self.every):
            self.save()
        return self.stopping

    def save(self) -> str | None:
        """Writes a checkpoint of the current state (every worker calls it). Returns its
        path (None without a directory or on a worker that does not write)."""
        if not self.directory:
            return None
        self._check_boundary()
        name = f"{PREFIX}{self.step // self._micro:09d}"  # updates: the same on any number of workers
        own = local.checkpointed(self.model, self.optimizer)
        if own:  # each process's own, beside the shared files, all written before rank 0 publishes
            local.write(self.directory, name, _worker()[0], own)
        if self._sharded:  # every process writes its share (its barriers follow the local files)
            self._saved = self.step
            return sharded_checkpoint.save(self, name, _worker()[0])
        if own:
            self._any_worker(False)
        for opt in self.optimizer.stack() if distribute.horovod_size() > 1 and hasattr(self.optimizer, "stack") else ():
            getattr(opt, "share_process_state", lambda: None)()  # Horovod, one file for all: state evened out
        writer = self._is_writer()
        tmp = os.path.join(self.directory, f".tmp-{name}" if writer else f".worker-{_worker()[0]}-{name}")
        if not writer and distribute.horovod_size() > 1:
            self._saved = self.step
            return None  # Horovod: rank 0 writes alone
        os.makedirs(self.directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            self.write_files(tmp)
            if writer:
                self._publish(tmp, name)
        finally:
            if not writer:
                shutil.rmtree(tmp, ignore_errors=True)
        self._saved = self.step
        return os.path.join(self.directory, name) if writer else None

    def write_files(self, path: str, sharded: dict | None = None) -> None:
        """Writes the state and `meta.json` into the new directory `path`, synced.
        `sharded`: the manifest of the processes' files, already in `path/shards` (the
        state then holds the model only)."""
        self._checkpoint(sharded).write(os.path.join(path, "state"))
        meta = {"step": self.step, "updates": int(self.optimizer.iterations.numpy()),
                "micro_steps_per_update": self._micro, "workers": _worker()[1]}
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta if sharded is None else {**meta, "sharded": sharded}, f)
        for root, _, files in os.walk(path):
            for name in files:
                _sync(os.path.join(root, name))
            _sync(root)

    def _publish(self, tmp: str, name: str) -> str:
        """Renames the written `tmp` to `DIR/NAME` (atomic), synced; prunes the oldest."""
        final = os.path.join(self.directory, name)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _sync(self.directory)
        self._prune()
        return final

    def exit(self) -> None:
        """Ends this process after a stop, once every worker is here: with `exit_code`
        (restart me) when the state was saved, with 143 (128 + SIGTERM) without a directory."""
        self._any_worker(False)  # a barrier: no worker leaves while another still writes
        self.close()
        code = self.exit_code if self.directory else 128 + signal.SIGTERM
        if _worker()[1] > 1 and distribute.horovod_size() <= 1:
            from dist_minimize import cluster

            cluster.exit_worker(code)
        sys.stdout.flush()
        sys.exit(code)

    def finish(self) -> None:
        """At the end of training: saves the final state (when it is at an update boundary
        and not saved yet; every worker calls it) and puts the signal handling back."""
        if self.step > self._saved and self.step % self._micro == 0:
            self.save()
        self.close()

    def close(self) -> None:
        """Puts the signal handling back as it was."""
        self._watcher.close()

    # -- model.fit ------------------------------------------------------------------------

    def fit(self, x, epochs: int = 1, steps_per_epoch: int | None = None, callbacks: list | None = None,
            **kwargs):
        """`model.fit` with exact resume: restores, skips the batches already trained,
        saves every `every` batches and at the end, and on an agreed stop saves and exits
        with `exit_code`. Returns the last `fit`'s History.

        `x`: a function returning a dataset of one epoch's batches (or, with
        `steps_per_epoch`, an endless stream), or that dataset itself. Give a FUNCTION
        when the dataset shuffles with `reshuffle_each_iteration` (tf.data's default): a
        run resumed mid-epoch calls `model.fit` twice (the rest of the epoch, then the
        following epochs), and two iterators of one dataset object draw different
        shuffles, while two fresh copies repeat the uninterrupted run's.
        """
        make = x if callable(x) and not isinstance(x, tf.data.Dataset) else (lambda: x)
        first = make()
        if not isinstance(first, tf.data.Dataset):
            raise TypeError("`x` must be a tf.data.Dataset or a function returning one. "
                            f"Received: {type(first).__name__}")
        if getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError("Checkpointer.fit needs steps_per_execution=1 (it counts batches in "
                             f"on_train_batch_end). Received: steps_per_execution={self.model.steps_per_execution}")
        per_epoch = steps_per_epoch or int(first.cardinality().numpy())
        if per_epoch <= 0:
            raise ValueError("The dataset's length is unknown or infinite: pass `steps_per_epoch`. "
                             f"Received: cardinality {per_epoch}")
        streams = itertools.chain([first], iter(make, None))  # the first copy, then a fresh one per fit call

        def stream(skip):
            ds = next(streams)
            return (ds if steps_per_epoch else ds.repeat()).skip(skip)
        try:
            history = self._fit(stream, per_epoch, epochs, list(callbacks or []) + [_Callback(self)], kwargs)
        except BaseException:
            self.close()
            raise
        if self.stopping:
            self.exit()
        self.finish()
        return history

    # -- internals ------------------------------------------------------------------------

    def _fit(self, stream, per_epoch: int, epochs: int, callbacks: list, kwargs: dict):
        epoch, batch = divmod(self.restore(), per_epoch)
        history = None
        if batch and epoch < epochs:  # the rest of the interrupted epoch
            history = self.model.fit(stream(self.step), epochs=epoch + 1, initial_epoch=epoch,
                                     steps_per_epoch=per_epoch - batch, callbacks=callbacks, **kwargs)
            epoch += 1
        if not self.stopping and epoch < epochs:
            history = self.model.fit(stream(epoch * per_epoch), epochs=epochs, initial_epoch=epoch,
                                     steps_per_epoch=per_epoch, callbacks=callbacks, **kwargs)
        return history

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


    def _build(self) -> None:
        if not self.model.built:
            raise ValueError("The model must be built before restoring into it (call it once, or give "
                             "it a keras.Input).")
        if not self.optimizer.built:
            with self._strategy.scope():
                self.optimizer.build(self.model.trainable_variables)

    def _checkpoint(self, sharded: dict | None = None) -> tf.train.Checkpoint:
        """The model and the optimizer stack; where each process writes its share of the
        optimizer's state (`sharded`), the model's variables alone (a compiled model also
        tracks its optimizer, whose share here is this process's)."""
        if sharded is not None:
            return tf.train.Checkpoint(model_variables={str(i): v for i, v in enumerate(self.model.variables)})
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer)

    def _check_boundary(self) -> None:
        for opt in sharded_state.stack_of(self.optimizer):
            counter = getattr(opt, "micro_step", None)
            steps = getattr(opt, "micro_steps_per_update", 1)
            if counter is not None and int(counter.numpy()) % steps:
                raise ValueError(
                    f"A checkpoint can only be taken at an update boundary, where {type(opt).__name__}'s "
                    f"replica-local accumulators are empty; its micro_step is {int(counter.numpy())} with "
                    f"steps={steps}. Call step_done() once per batch, from the first batch on.")

    def _is_writer(self) -> bool:
        return _worker()[0] == 0

    def _prune(self) -> None:
        names = [name for _, name in _complete(self.directory)]
        for name in names[:-self.keep]:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        if names:
            local.prune(self.directory, names[-self.keep:][0])

    def _any_worker(self, flag: bool) -> bool:
        """True on every worker when `flag` is True on any (one collective; none in one process)."""
        hvd = distribute.horovod()
        if hvd is not None and hvd.size() > 1:
            return int(hvd.allreduce(tf.constant(int(flag)), op=hvd.Sum, name="dm_checkpoint_agree")) > 0
        if _worker()[1] > 1:
            if self._agree_fn is None:
                strategy = self._strategy

                @tf.function
                def agree(value):
                    per_replica = strategy.run(lambda: tf.identity(value))
                    return strategy.reduce("SUM", per_replica, axis=None)
                self._agree_fn = agree
            return int(self._agree_fn(tf.constant(int(flag)))) > 0
        return flag


class _Callback(keras.callbacks.Callback):
    def __init__(self, checkpointer: Checkpointer):
        super().__init__()
        self.checkpointer = checkpointer

    def on_train_batch_end(self, batch, logs=None):
        if self.checkpointer.step_done():
            self.model.stop_training = True


def _micro_steps(optimizer) -> int:
    n = 1
    for opt in sharded_state.stack_of(optimizer):
        n *= int(getattr(opt, "micro_steps_per_update", 1))
    return n


def _set_micro_steps(optimizer, step: int) -> None:
    """Puts the micro-step counter of the stack's accumulation at `step` (this process's
    micro-batches at the restored update): its windows are counted from it."""
    for opt in sharded_state.stack_of(optimizer):
        counter = opt.__dict__.get("_micro_step")  # GradientAccumulation's (not read through a wrapper)
        if counter is not None:
            counter.assign(step)


def _worker() -> tuple[int, int]:
    """(this process's rank or worker index, how many there are): Horovod's, else
    TF_CONFIG's, else (0, 1)."""
    hvd = distribute.horovod()
    if hvd is not None:
        return hvd.rank(), hvd.size()
    from dist_minimize import cluster

    info = cluster._from_tf_config(os.environ)
    return (info.rank, info.size) if info is not None else (0, 1)


def _remove_temporaries(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith((".tmp-", ".worker-")):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
