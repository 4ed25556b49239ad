"""The public step protocol for wrapper authors, and each state variable saved once."""

import io
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm


def sgd(lr=0.1):
    return keras.optimizers.SGD(lr)


def small_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])


def optimizer_arrays(path):
    """Every optimizer array a .keras file holds (names in the weights file)."""
    with zipfile.ZipFile(path) as z:
        f = h5py.File(io.BytesIO(z.read("model.weights.h5")), "r")
        names = []
        f.visititems(lambda name, obj: names.append(name)
                     if isinstance(obj, h5py.Dataset) and name.startswith("optimizer") else None)
    return names


# -- each state variable once, no unused variables ------------------------------


def test_keras_file_stores_each_optimizer_variable_once(tmp_path):
    """Defect: each wrapper level saved its children's variables again (67 arrays for 24
    distinct variables for this stack), and every level added an unused `iteration` and
    `learning_rate`."""
    model = small_model()
    opt = dm.LossScaleOptimizer(dm.GradientAccumulation(
        dm.Optimizer(keras.optimizers.Adam(1e-3), transform_gradients=dm.clip_by_global_norm(1.0)), steps=2))
    model.compile(loss="mse", optimizer=opt, auto_scale_loss=False)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=4, verbose=0)

    paths = [v.path for v in opt.variables]
    assert len(paths) == len(set(id(v) for v in opt.variables))
    # Only the inner Keras optimizer has an iteration counter and a learning rate.
    adam = opt.stack()[-1].inner_optimizer
    assert [p for p in paths if p.endswith("iteration")] == [adam.iterations.path]
    assert [p for p in paths if p.endswith("learning_rate")] == [adam.learning_rate.path]
    # 2 (loss scale) + 1 + 4 (accumulation) + 2 + 8 (Adam), the update rule's first (as in
    # Keras: variables[0] is `iterations`); the 2 statistics (guard's skip counter, clipper's
    # statistics) are saved but not listed.
    assert len(paths) == 17 and paths[0] == adam.iterations.path
    statistics = opt.stack()[-1].statistics_variables()
    assert len(statistics) == 2 and not {id(v) for v in statistics} & {id(v) for v in opt.variables}

    path = str(tmp_path / "m.keras")
    model.save(path)
    assert len(optimizer_arrays(path)) == 19
    loaded = keras.saving.load_model(path)
    assert len(loaded.optimizer.variables) == 17
    for a, b in zip(loaded.optimizer.variables + loaded.optimizer.stack()[-1].statistics_variables(),
                    opt.variables + statistics):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_tf_checkpoint_holds_one_iteration_counter(tmp_path):
    v = tf.Variable([1.0, 2.0])
    opt = dm.GradientAccumulation(dm.Optimizer(sgd()), steps=2)
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    names = [n for n, _ in tf.train.list_variables(tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "c")))]
    assert [n for n in names if "_iterations" in n] == ["optimizer/wrapped/inner_optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]
    assert not [n for n in names if "_learning_rate" in n and "inner_optimizer" not in n]


def test_loading_a_file_of_another_stack_is_an_error_not_a_silent_skip(tmp_path):
    model = small_model()
    model.compile(loss="mse", optimizer=dm.LossScaleOptimizer(dm.Optimizer(sgd())), auto_scale_loss=False)
    x = np.ones((4, 4), "float32")
    model.fit(x, x[:, :1], verbose=0)
    store = {"0": np.float32(1.0)}  # one array where the loss-scale level has two
    with pytest.raises(ValueError, match="has 2 state variables and the file holds 1"):
        model.optimizer.load_own_variables(store)


# -- the hooks --------------------------------------------------------------------------


class Recorder(dm.OptimizerWrapper):
    def __init__(self, optimizer, log, tag, name=None):
        super().__init__(optimizer, name=name)
        self.record, self.tag = log.append, tag  # (a list attribute would be copied by TF's tracking)

    def on_applied(self, grads_and_vars):
        self.record(("applied", self.tag))

    def on_skipped(self):
        self.record(("skipped", self.tag))


def test_on_applied_and_on_skipped_reach_every_level_innermost_first():
    log = []
    v = tf.Variable([1.0, 2.0])
    opt = Recorder(Recorder(dm.Optimizer(sgd()), log, "inner"), log, "outer")
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    assert log == [("applied", "inner"), ("applied", "outer")]
    log.clear()
    opt.apply_gradients([(tf.constant([np.nan, 1.0]), v)])
    assert log == [("skipped", "inner"), ("skipped", "outer")]
    assert int(opt.skipped_steps) == 1 and int(opt.iterations) == 1


class EveryOther(dm.OptimizerWrapper):
    """Applies only on odd calls: an added update condition, from a replicated counter."""

    def build_state(self, var_list):
        self.calls = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                       aggregation="only_first_replica", name="calls")

    def update_condition(self, grads_and_vars):
        self.calls.assign_add(1)
        mine = tf.equal(self.calls % 2, 1)
        base = super().update_condition(grads_and_vars)
        return mine if base is None else tf.logical_and(base, mine)


@pytest.mark.parametrize("use_function", [False, True])
def test_update_condition_decides_and_skips_are_counted(use_function):
    v = tf.Variable([1.0])
    opt = EveryOther(dm.Optimizer(sgd(1.0)))

    def step():
        opt.apply_gradients([(tf.constant([1.0]), v)])

    step = tf.function(step) if use_function else step
    for _ in range(4):
        step()
    assert float(v.numpy()[0]) == pytest.approx(-1.0)  # two of four applied
    assert int(opt.iterations) == 2 and int(opt.skipped_steps) == 2


class Slotted(dm.OptimizerWrapper):
    def build_state(self, var_list):
        for v in var_list:
            self.add_slot(v, "start", initializer="value")
            self.add_slot(v, "local", replica_local=True)


def test_slots_start_from_the_variable_and_are_found_by_variable():
    a, b = tf.Variable([1.0, 2.0]), tf.Variable([[3.0]])
    opt = Slotted(dm.Optimizer(sgd()))
    opt.build([a, b])
    np.testing.assert_array_equal(opt.slot("start", a).numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(opt.slot("start", b).numpy(), [[3.0]])
    np.testing.assert_array_equal(opt.slot("local", b).numpy(), [[0.0]])
    assert [s.shape for s in opt.slots("start")] == [(2,), (1, 1)]
    assert opt.trained_variables == [a, b]
    with pytest.raises(KeyError, match="no slot 'other'"):
        opt.slot("other", a)


def test_add_slot_errors_name_the_problem():
    a, other = tf.Variable([1.0]), tf.Variable([2.0])
    opt = dm.OptimizerWrapper(dm.Optimizer(sgd()))
    with pytest.raises(ValueError, match="must be called from `build_state`"):
        opt.add_slot(a, "x")
    opt.build([a])
    with pytest.raises(ValueError, match="not a variable this optimizer was built for"):
        opt.add_slot(other, "x")
    opt.add_slot(a, "x")
    with pytest.raises(ValueError, match="already exists"):
        opt.add_slot(a, "x")
    with pytest.raises(ValueError, match="starts at zeros"):
        opt.add_slot(a, "y", initializer="ones", replica_local=True)


def test_state_built_in_build_state_is_checkpointed_and_restored(tmp_path):
    a = tf.Variable([1.0, 2.0])
    opt = Slotted(dm.Optimizer(sgd()))
    opt.build([a])
    opt.slot("start", a).assign([5.0, 6.0])
    path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "c"))
    again = Slotted(dm.Optimizer(sgd()))
    again.build([a])
    tf.train.Checkpoint(optimizer=again).read(path).assert_consumed()
    np.testing.assert_array_equal(again.slot("start", a).numpy(), [5.0, 6.0])


class Once(dm.OptimizerWrapper):
    once_per_stack = True


def test_once_per_stack_is_refused_when_nested():
    Once(dm.Optimizer(sgd()))
    with pytest.raises(ValueError, match="already holds a Once; one Once per stack"):
        Once(dm.OptimizerWrapper(Once(dm.Optimizer(sgd()))))


def test_stack_and_find():
    base = dm.Optimizer(sgd())
    mid = dm.GradientAccumulation(base, steps=2)
    top = Once(mid)
    assert top.stack() == [top, mid, base]
    assert top.find(dm.GradientAccumulation) is mid and top.find(dm.LossScaleOptimizer) is None


def test_swap_values_swaps_in_and_restores_even_on_error():
    a, b = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
    with dm.swap_values([a, b], [tf.constant([7.0, 8.0]), tf.Variable(9.0)]):
        np.testing.assert_array_equal(a.numpy(), [7.0, 8.0])
        assert float(b.numpy()) == 9.0
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
    with pytest.raises(RuntimeError, match="inside"):
        with dm.swap_values([a], [tf.constant([0.0, 0.0])]):
            raise RuntimeError("inside")
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
    with pytest.raises(ValueError, match="same length. Received: 2 variables and 1 values"):
        with dm.swap_values([a, b], [tf.constant(1.0)]):
            pass
    with pytest.raises(ValueError, match=r"has shape \(2,\), its value \(3,\)"):
        with dm.swap_values([a], [tf.constant([1.0, 2.0, 3.0])]):
            pass


# -- dm.distribute without a strategy ---------------------------------------------------------


def test_distribute_without_strategy_is_one_replica():
    assert dm.distribute.num_replicas() == 1 and dm.distribute.strategy_replicas() == 1
    assert dm.distribute.horovod_size() == 1
    x = tf.constant([1.0, 2.0])
    np.testing.assert_array_equal(dm.distribute.sum_across(x).numpy(), [1.0, 2.0])
    out = dm.distribute.mean_across([x, x * 2])
    np.testing.assert_array_equal(out[1].numpy(), [2.0, 4.0])
    assert dm.distribute.check_agreed(tf.constant(True)) is None
    ran = []
    dm.distribute.run_if(tf.constant(False), lambda: ran.append("fn"), otherwise=lambda: ran.append("otherwise"))
    assert ran == ["otherwise"]


# -- a lean hot path -------------------------------------------------------------------------


def is_finite_ops(opt, n_vars=10) -> int:
    """IsFinite ops in a traced step over `n_vars` variables (main graph: where the
    guard decides)."""
    variables = [tf.Variable(tf.ones([3])) for _ in range(n_vars)]
    opt.build(variables)
    step = tf.function(lambda: opt.apply_gradients([(tf.ones([3]), v) for v in variables]))
    return sum(op.type == "IsFinite" for op in step.get_concrete_function().graph.get_operations())


def test_the_finite_check_is_not_computed_twice():
    """Item 7: without a clipper the guard scans each gradient once, also under loss
    scaling (which used to scan again); after the global-norm clipper it scans nothing
    (the norm's finiteness decides), whatever the number of variables."""
    assert is_finite_ops(dm.Optimizer(sgd())) == 10
    assert is_finite_ops(dm.LossScaleOptimizer(dm.Optimizer(sgd()))) == 10
    clipped = is_finite_ops(dm.Optimizer(sgd(), transform_gradients=dm.clip_by_global_norm(1.0)))
    assert clipped == is_finite_ops(dm.Optimizer(sgd(), transform_gradients=dm.clip_by_global_norm(1.0)), n_vars=40)
    assert clipped == 1  # the clipper's check of the norm
    limited = dm.Optimizer(sgd(), transform_gradients=[dm.limit_nonfinite_steps(3)])
    assert is_finite_ops(limited) == 10  # the limit's scan is the guard's


class BranchesInPython(dm.OptimizerWrapper):
    """Stages that branch on a tensor with a Python `if` (what AutoGraph would convert):
    `transform_loss` (run by `minimize` only) and `transform_gradients`."""

    def __init__(self, inner, stage):
        super().__init__(inner)
        self.stage = stage

    def transform_loss(self, loss):
        if self.stage == "transform_loss" and loss > 0:
            loss = 2.0 * loss
        return super().transform_loss(loss)

    def transform_gradients(self, grads_and_vars):
        if self.stage == "transform_gradients" and tf.reduce_sum(grads_and_vars[0][0]) > 0:
            grads_and_vars = [(2.0 * g, v) for g, v in grads_and_vars]
        return super().transform_gradients(grads_and_vars)


@pytest.mark.parametrize("driver, stage", [("minimize", "transform_loss"), ("apply_gradients", "transform_gradients")])
def test_the_stages_run_as_python_while_traced_without_autograph(driver, stage):
    """The step's drivers run their stages unconverted, as Keras's `fit` runs its train
    step: a Python `if` on a tensor in a stage is TensorFlow's graph-mode error (use
    `tf.cond`), and the same stage runs eagerly."""
    w = tf.Variable([1.0, 2.0])
    opt = BranchesInPython(dm.Optimizer(keras.optimizers.SGD(0.1)), stage)

    def step():
        if driver == "minimize":
            opt.minimize(lambda: tf.reduce_sum(w * w), [w])
        else:
            opt.apply_gradients([(2.0 * tf.convert_to_tensor(w), w)])

    step()  # eagerly: the `if` is a Python bool of a concrete tensor
    np.testing.assert_allclose(w.numpy(), [1.0 - 0.4, 2.0 - 0.8])
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError, match="AutoGraph"):
        tf.function(step)()


class ReadsTheStepContext(dm.OptimizerWrapper):
    """Records what `dm.step_context()` says in its stages."""

    def __init__(self, inner):
        super().__init__(inner)
        self.seen = {}

    def transform_loss(self, loss):
        self.seen["loss"] = list(dm.step_context().aggregations)
        return super().transform_loss(loss)

    def transform_gradients(self, grads_and_vars):
        context = dm.step_context()
        self.seen["gradients"] = (list(context.aggregations), context.writes is not None,
                                  context.share(grads_and_vars) == grads_and_vars,
                                  context.positions(len(grads_and_vars)))
        out = super().transform_gradients(grads_and_vars)
        self.seen["clipped_known_finite"] = context.known_all_finite([g for g, _ in out]) is not None
        return out

    def on_applied(self, grads_and_vars):
        self.seen["device"] = dm.step_context().device


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_a_stage_reads_the_step_context_and_it_is_empty_outside_the_step(strategy):
    """`dm.step_context()`: the aggregation made before `transform_gradients`, the deferred
    writes and the clipper's finding within the update, every pair this process's (not
    sharded), the device whose copies a per-device update writes; defaults outside."""
    from conftest import mirrored_strategy

    scope = mirrored_strategy() if strategy == "mirrored" else tf.distribute.get_strategy()
    with scope.scope():
        w = tf.Variable([1.0, 2.0])
        opt = ReadsTheStepContext(dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=dm.clip_by_global_norm(1.0)))

    @tf.function
    def step():
        scope.run(lambda: opt.minimize(lambda: tf.reduce_sum(w * w), [w]))

    step()
    assert opt.seen["loss"] == []
    aggregations, deferring, all_mine, positions = opt.seen["gradients"]
    assert len(aggregations) == 1 and deferring and all_mine and positions == [0]
    assert opt.seen["clipped_known_finite"]
    assert opt.seen["device"] in (0, 1)
    context = dm.step_context()
    assert (context.aggregations, context.writes, context.sharded, context.device, context.zones) == (
        None, None, None, None, [])
