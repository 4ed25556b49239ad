"""dm.Checkpointer in one process: a run interrupted at any batch and resumed from its
directory ends with the same weights and optimizer variables, bit for bit, as the run
never interrupted, on one device and under MirroredStrategy (2 logical CPUs), in `fit`
and in a custom loop, with an accumulating, averaging stack. Saves are atomic, taken at
update boundaries only, and a SIGTERM saves and exits with 42.

The multi-process kill tests (SIGKILL / SIGTERM to one worker under the launcher's
--max-restarts) are tests/distributed/test_restarts.py."""

import os
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy
from dist_minimize import checkpoint

BATCH, PER_EPOCH, EPOCHS = 8, 6, 2
TOTAL = PER_EPOCH * EPOCHS


def data(reshuffle=True):
    """One epoch's batches; a function, as Checkpointer.fit wants for a reshuffling dataset."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH * PER_EPOCH, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 3)) * 3.0).astype("float32")
    # A seeded shuffle, reshuffled every epoch: the resumed run must find the same order.
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        len(x), seed=1, reshuffle_each_iteration=reshuffle).batch(BATCH)


def make_model(strategy=None, seed=0):
    """The same model every time; `seed` != 0 shifts its initial weights (a resumed run
    must take every value from the checkpoint). The global seed stays 0: it also seeds
    the dataset's shuffle, which a resumed job repeats as it was."""
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3)])
        if seed:
            model.set_weights([w + seed for w in model.get_weights()])
        inner = dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(1.0))
        opt = dm.MovingAverage(dm.GradientAccumulation(inner, steps=2), average_decay=0.9)
        model.compile(optimizer=opt, loss="mse")
    dm.integrate(model)
    return model


def state(model) -> list:
    return [np.array(w) for w in model.get_weights()] + [np.array(v.numpy()) for v in model.optimizer.variables]


def assert_identical(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype and np.array_equal(u, v), f"value {i} differs by {np.max(np.abs(u - v))}"


class Crash(Exception):
    pass


class CrashAfter(keras.callbacks.Callback):
    """A process lost after `at` batches, before any save of that batch."""

    def __init__(self, ckpt, at):
        super().__init__()
        self.ckpt, self.at = ckpt, at

    def on_train_batch_end(self, batch, logs=None):
        if self.ckpt.step + 1 == self.at:
            raise Crash()


class Count(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def fit(directory, strategy=None, seed=0, crash_at=None, every=4, reshuffle=True):
    model = make_model(strategy, seed)
    ckpt = dm.Checkpointer(directory, model, every=every)
    count = Count()
    callbacks = [count] + ([CrashAfter(ckpt, crash_at)] if crash_at else [])
    try:
        ckpt.fit(lambda: data(reshuffle), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    except Crash:
        return None, count.batches
    return model, count.batches


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model, batches = fit(None)
    assert batches == TOTAL
    return state(model)


@pytest.mark.parametrize("crash_at", [3, 5, 8, 9])
def test_fit_resumes_exactly_after_a_lost_process(tmp_path, uninterrupted, crash_at):
    """Lost after batch 3 (inside an accumulation window), 5 (after the save of batch 4),
    8 (an epoch boundary, its save not yet taken) or 9 (mid-epoch, mid-window): the
    resumed run trains only the batches after the newest checkpoint, and ends identical."""
    assert fit(tmp_path, crash_at=crash_at)[0] is None
    saved = checkpoint.latest(str(tmp_path))
    expected = (crash_at - 1) // 4 * 4  # every=4: saves after batches 4, 8, ...
    assert (saved[0] if saved else 0) == expected // 2  # named by updates (2 batches each)
    # Other initial weights when a checkpoint exists (everything must come from the file);
    # without one, the job starts again as it first did.
    model, batches = fit(tmp_path, seed=7 if expected else 0)
    assert batches == TOTAL - expected  # the batches already trained are skipped, not retrained
    assert_identical(uninterrupted, state(model))


def test_the_same_stream_with_or_without_a_directory(tmp_path, uninterrupted):
    model, _ = fit(tmp_path)
    assert_identical(uninterrupted, state(model))
    assert checkpoint.latest(str(tmp_path))[0] == TOTAL // 2  # the final save (updates)
    # Resumed once more from the end: nothing left to train, nothing changes.
    again, batches = fit(tmp_path, seed=9)
    assert batches == 0
    assert_identical(uninterrupted, state(again))


def test_mirrored_fit_resumes_exactly(tmp_path):
    """Under MirroredStrategy Keras's fit distributes the dataset through a copy of its
    graph, and a shuffle reshuffled each epoch does not repeat its orders after a skip
    (measured: 2e-2 off); a shuffle drawn once (reshuffle_each_iteration=False) does.
    docs/fault-tolerance.md says so."""
    s = mirrored_strategy()
    full, _ = fit(None, strategy=s, reshuffle=False)
    assert fit(tmp_path, strategy=s, crash_at=7, reshuffle=False)[0] is None
    resumed, batches = fit(tmp_path, strategy=s, seed=4, reshuffle=False)
    assert batches == TOTAL - 4
    assert_identical(state(full), state(resumed))


def custom_loop(directory, crash_at=None, seed=0):
    """MirroredStrategy, a custom loop over one stream: the docstring's recipe."""
    s = mirrored_strategy()
    model = make_model(s, seed)
    opt = model.optimizer
    ckpt = dm.Checkpointer(directory, model, opt, every=4)
    start = ckpt.restore()
    stream = s.experimental_distribute_dataset(data().repeat().skip(start))

    @tf.function
    def step(xb, yb):
        def replica(xb, yb):
            def loss():
                return tf.nn.compute_average_loss(tf.reduce_mean(tf.square(model(xb) - yb), axis=-1),
                                                  global_batch_size=BATCH)
            opt.minimize(loss, model.trainable_variables)
        s.run(replica, args=(xb, yb))

    it = iter(stream)
    with ckpt:
        for i in range(start, TOTAL):
            step(*next(it))
            if crash_at == i + 1:
                return None
            assert not ckpt.step_done()
        ckpt.finish()
    return model


def test_custom_loop_resumes_exactly(tmp_path):
    full = custom_loop(None)
    assert custom_loop(tmp_path, crash_at=10) is None
    assert checkpoint.latest(str(tmp_path))[0] == 4  # after batch 8: 4 updates
    assert_identical(state(full), state(custom_loop(tmp_path, seed=5)))


def test_sigterm_saves_at_the_next_boundary_and_exits_42(tmp_path, uninterrupted):
    """SIGTERM after batch 5 (inside a window): the save waits for the window's end
    (batch 6), then the process exits with 42; the resumed run ends identical."""
    handler = signal.getsignal(signal.SIGTERM)
    model = make_model()
    # grace: the watchdog ends a process that has not exited this long after SIGTERM
    # (os._exit, the test process itself); the default 8 s was exceeded once under CI load.
    ckpt = dm.Checkpointer(str(tmp_path), model, every=100, grace=300)

    class Term(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if ckpt.step + 1 == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as e:
        ckpt.fit(data, epochs=EPOCHS, verbose=0, callbacks=[Term()])
    assert e.value.code == 42
    assert signal.getsignal(signal.SIGTERM) is handler  # put back
    assert checkpoint.latest(str(tmp_path))[0] == 3  # after batch 6: 3 updates
    resumed, batches = fit(tmp_path, seed=2, every=100)
    assert batches == TOTAL - 6
    assert_identical(uninterrupted, state(resumed))


def test_a_crash_during_a_write_leaves_the_previous_checkpoint(tmp_path, uninterrupted):
    model = make_model()
    ckpt = dm.Checkpointer(str(tmp_path), model, every=4)
    write = ckpt.write_files

    def write_then_crash(path):
        write(path)
        if ckpt.step == 8:
            raise Crash()  # the files are written, the rename never happens
    ckpt.write_files = write_then_crash
    with pytest.raises(Crash):
        ckpt.fit(data, epochs=EPOCHS, verbose=0)
    assert sorted(os.listdir(tmp_path)) == [".tmp-ckpt-000000004", "ckpt-000000002"]  # updates
    assert checkpoint.latest(str(tmp_path))[0] == 2
    resumed, batches = fit(tmp_path, seed=3)
    assert batches == TOTAL - 4
    assert_identical(uninterrupted, state(resumed))
    assert ".tmp-ckpt-000000004" not in os.listdir(tmp_path)  # removed at the restore
    assert len([n for n in os.listdir(tmp_path) if n.startswith("ckpt-")]) == 2  # keep=2


def test_a_save_inside_an_accumulation_window_is_refused(tmp_path):
    model = make_model()
    ckpt = dm.Checkpointer(str(tmp_path), model)
    with ckpt:
        ckpt.restore()
        x, y = next(iter(data()))
        model.train_on_batch(x, y)  # one micro-step: the accumulators hold it
        ckpt.step = 1
        with pytest.raises(ValueError, match=r"update boundary.*micro_step is 1 with steps=2"):
            ckpt.save()
    assert checkpoint.latest(str(tmp_path)) is None


def test_a_position_moves_to_another_number_of_workers_by_updates(tmp_path):
    """A checkpoint written by 2 workers making 1 micro-batch per update each (update 3
    after 3 batches) is 6 batches into this 1-worker job making 2 per update: the same
    3 updates, the same micro-batches (dm.elastic). Another product K * N is refused."""
    ckpt = dm.Checkpointer(str(tmp_path), make_model())  # GradientAccumulation(steps=2), 1 worker
    assert ckpt._position({"step": 3, "micro_steps_per_update": 1, "workers": 2}, "ckpt-3") == 6
    assert ckpt._position({"step": 4, "micro_steps_per_update": 2}, "ckpt-2") == 4  # written before "workers"
    with pytest.raises(ValueError, match=r"written by 3 worker\(s\) making 1 micro-batches per update each; "
                                         r"this job's 1 make 2"):
        ckpt._position({"step": 3, "micro_steps_per_update": 1, "workers": 3}, "ckpt-3")
    ckpt.close()


def test_the_newest_checkpoint_is_the_one_of_most_updates_whatever_its_name(tmp_path):
    """A checkpoint named by batches (40 batches of 2: 20 updates) is older than one of
    22 updates: checkpoints are ordered by the updates their meta.json records."""
    for name, step in (("ckpt-000000040", 40), ("ckpt-000000022", 44)):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "meta.json").write_text(f'{{"step": {step}, "micro_steps_per_update": 2}}')
    assert checkpoint.latest(str(tmp_path)) == (22, str(tmp_path / "ckpt-000000022"))


def test_a_checkpoint_of_another_accumulation_is_refused(tmp_path):
    model = make_model()  # GradientAccumulation(steps=2)
    ckpt = dm.Checkpointer(str(tmp_path), model)
    with ckpt:
        ckpt.restore()
        batches = iter(data())
        for _ in range(2):
            model.train_on_batch(*next(batches))
        ckpt.step = 2
        ckpt.save()
    keras.utils.set_random_seed(0)
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    inner = dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(1.0))
    other.compile(optimizer=dm.MovingAverage(dm.GradientAccumulation(inner, steps=4), average_decay=0.9),
                  loss="mse")
    dm.integrate(other)
    with pytest.raises(ValueError, match=r"written by 1 worker\(s\) making 2 micro-batches per update each; "
                                         r"this job's 1 make 4, so an update would take other samples"):
        dm.Checkpointer(str(tmp_path), other).restore()


@pytest.mark.parametrize("kwargs, match", [
    ({"every": 0}, r"`every` must be an integer >= 1. Received: every=0"),
    ({"keep": 0}, r"`keep` must be an integer >= 1. Received: keep=0"),
    ({"model": "m"}, r"`model` must be a Keras model. Received: model='m'"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, match):
    args = {"directory": str(tmp_path), "model": make_model(), **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        dm.Checkpointer(**args)


def test_fit_needs_a_dataset_of_known_length(tmp_path):
    model = make_model()
    with dm.Checkpointer(str(tmp_path), model) as ckpt:
        with pytest.raises(TypeError, match="must be a tf.data.Dataset or a function returning one. Received: ndarray"):
            ckpt.fit(np.zeros((4, 5)), epochs=1)
        endless = data().repeat()
        with pytest.raises(ValueError, match="unknown or infinite: pass `steps_per_epoch`"):
            ckpt.fit(endless, epochs=1)


def _sharded_pair(shard: bool, seed: int = 0, rule: str = "adam"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    if seed:
        model.set_weights([w + seed for w in model.get_weights()])
    rule = {"adam": lambda: keras.optimizers.Adam(0.01), "amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
            "sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9)}[rule]()
    opt = dm.LossScaleOptimizer(dm.Optimizer(rule, transform_gradients=dm.clip_by_global_norm(1.0),
                                             shard_optimizer_state=shard), initial_scale=8.0)
    model.compile(optimizer=opt, loss="mse")
    return model


def test_a_sharded_checkpoint_resumes_unsharded_in_one_process(tmp_path):
    """With shard_optimizer_state=True every process writes its share into a file of its
    own (one process here: all of it), named by what each variable is, not by the names
    Keras numbered in this process (a second model here is `sequential_1`): restored
    into an unsharded stack and trained on, it ends where the uninterrupted run ends,
    bit for bit. Another optimizer stack is refused, naming what the file lacks."""
    def run(model, directory, batches):
        ckpt = dm.Checkpointer(directory, model, every=PER_EPOCH // 2)
        ds = data(reshuffle=False)
        for x, y in ds.skip(ckpt.restore()).take(batches):
            model.train_on_batch(x, y)
            ckpt.step_done()
        ckpt.close()
        return ckpt

    full = _sharded_pair(True)
    run(full, None, PER_EPOCH)
    half = _sharded_pair(True)
    run(half, str(tmp_path), PER_EPOCH // 2)
    found = checkpoint.latest(str(tmp_path))
    assert found[0] == PER_EPOCH // 2
    with open(os.path.join(found[1], "meta.json")) as f:
        manifest = __import__("json").load(f)["sharded"]
    assert manifest["processes"] == 1 and os.path.exists(os.path.join(found[1], "shards", "process-0.index"))
    with pytest.raises(ValueError, match=r"written by the optimizer stack \['LossScaleOptimizer', 'Optimizer', "
                                         r"'Adam'\]; this one is \[.*'SGD'\]"):
        dm.Checkpointer(str(tmp_path), _sharded_pair(False, rule="sgd")).restore()
    with pytest.raises(ValueError, match=r"holds no value for \['1:0/velocity_hat', '1:1/velocity_hat', .*another "
                                         "optimizer stack"):
        dm.Checkpointer(str(tmp_path), _sharded_pair(False, rule="amsgrad")).restore()
    resumed = _sharded_pair(False, seed=5)  # other weights: everything must come from the files
    run(resumed, str(tmp_path), PER_EPOCH)
    assert_identical(state(full), state(resumed))


def test_a_checkpoint_of_a_loaded_model_restores_into_a_freshly_built_one(tmp_path):
    """Keras names a loaded model's variables `dense/kernel` and a fresh one's
    `sequential/dense/kernel` (and their slots after them): the checkpoint matches by
    structure, so either restores into the other, optimizer state included."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=dm.Optimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.variables[0].path != model.variables[0].path  # the names do differ
    dm.Checkpointer(str(tmp_path / "ckpt"), loaded).save()
    keras.utils.set_random_seed(1)
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    fresh.compile(optimizer=dm.Optimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    dm.Checkpointer(str(tmp_path / "ckpt"), fresh).restore()
    for a, b in zip(loaded.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(loaded.optimizer.variables, fresh.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(fresh.optimizer.iterations.numpy()) == 2
    assert max(float(np.max(np.abs(v.numpy()))) for v in fresh.optimizer.inner_optimizer.variables[2:]) > 0
