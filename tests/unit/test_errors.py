"""Bad input fails where the mistake is made, naming the argument and the value."""

import builtins
import os
import re

import keras
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy


def sgd(**kw):
    return keras.optimizers.SGD(0.1, **kw)


def make_vars():
    return [tf.Variable([1.0, 2.0], name="a"), tf.Variable([[3.0]], name="b")]


def run_stage(stage_fn):
    """Runs apply_gradients with `stage_fn` as transform_gradients."""
    v = make_vars()
    opt = dm.Optimizer(sgd(), transform_gradients=stage_fn)
    opt.apply_gradients([(tf.ones_like(x), x) for x in v])


def minimize_tensor_without_tape():
    v = tf.Variable(1.0)
    dm.Optimizer(sgd()).minimize(v * 2.0, [v])


def lengths_differ():
    v = make_vars()
    opt = dm.Optimizer(sgd())
    opt.build(v)
    opt.apply([tf.ones_like(v[0])], v)


def not_pairs():
    v = make_vars()
    dm.Optimizer(sgd()).apply_gradients([tf.ones_like(v[0])])


def horovod_missing(monkeypatch):
    real_import = builtins.__import__

    def no_horovod(name, *args, **kwargs):
        if name.startswith("horovod"):
            raise ImportError("No module named 'horovod'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_horovod)
    monkeypatch.setattr("importlib.import_module", lambda name: no_horovod(name))
    dm.Optimizer(sgd(), aggregate_gradients="horovod")


CASES = [
    # (id, callable, exception type, substrings the message must contain)
    ("transform not callable", lambda: dm.Optimizer(sgd(), transform_gradients=3),
     TypeError, ["`transform_gradients`", "transform_gradients=3"]),
    ("transform in sequence not callable",
     lambda: dm.Optimizer(sgd(), transform_unaggregated_gradients=[lambda g: g, "clip"]),
     TypeError, ["transform_unaggregated_gradients[1]='clip'"]),
    ("transform_loss not callable", lambda: dm.Optimizer(sgd(), transform_loss=1.5),
     TypeError, ["transform_loss=1.5"]),
    ("stage drops a pair", lambda: run_stage(lambda gv: gv[:1]),
     ValueError, ["`transform_gradients", "returned 1", "2 received"]),
    ("stage swaps variables", lambda: run_stage(lambda gv: gv[::-1]),
     ValueError, ["`transform_gradients", "other variables", "position 0"]),
    ("stage changes a shape", lambda: run_stage(lambda gv: [(tf.zeros([3]), v) for _, v in gv]),
     ValueError, ["`transform_gradients", "shape (3,)"]),
    ("stage returns None", lambda: run_stage(lambda gv: None),
     ValueError, ["`transform_gradients", "returned None"]),
    ("clip_norm zero", lambda: dm.clip_by_global_norm(0.0), ValueError, ["`clip_norm`", "clip_norm=0.0"]),
    ("clip_norm negative", lambda: dm.clip_by_global_norm(-1), ValueError, ["clip_norm=-1"]),
    ("clip_norm nan", lambda: dm.clip_by_global_norm(float("nan")), ValueError, ["clip_norm=nan"]),
    ("clip_norm inf", lambda: dm.clip_by_global_norm(float("inf")), ValueError, ["clip_norm=inf"]),
    ("clip_norm string", lambda: dm.clip_by_global_norm("big"), TypeError, ["clip_norm='big'"]),
    ("clip_norm bool", lambda: dm.clip_by_norm(True), ValueError, ["clip_norm=True"]),
    ("clip_norm numeric string", lambda: dm.clip_by_global_norm("1.0"), TypeError, ["clip_norm='1.0'"]),
    ("clip_value numeric string", lambda: dm.clip_by_value("0.5"), TypeError, ["'0.5'"]),
    ("clip_value zero", lambda: dm.clip_by_value(0), ValueError, ["`clip_value`", "clip_value=0"]),
    ("unknown backend", lambda: dm.Optimizer(sgd(), aggregate_gradients="gloo"),
     ValueError, ["`aggregate_gradients`", "aggregate_gradients='gloo'", "'strategy'"]),
    ("backend not a name or callable", lambda: dm.Optimizer(sgd(), aggregate_gradients=7),
     TypeError, ["aggregate_gradients=7"]),
    ("tensor loss without tape", minimize_tensor_without_tape, ValueError, ["`tape`", "tape=None"]),
    ("grads and vars lengths differ", lengths_differ, ValueError, ["1 gradients and 2 variables"]),
    ("grads_and_vars not pairs", not_pairs, ValueError, ["`grads_and_vars`", "item 0"]),
    ("inner not a Keras optimizer", lambda: dm.Optimizer(object()),
     TypeError, ["`optimizer`", "type object"]),
    ("inner already dist_minimize", lambda: dm.Optimizer(dm.Optimizer(sgd())),
     TypeError, ["OptimizerWrapper", "optimizer=Optimizer"]),
    ("inner is Keras LossScaleOptimizer",
     lambda: dm.Optimizer(keras.optimizers.LossScaleOptimizer(sgd())),
     TypeError, ["LossScaleOptimizer"]),
    # Keras settings on the inner optimizer are translated (tests/unit/test_keras_dropin.py);
    # what has no equivalent is refused.
    ("inner clipnorm next to a dist_minimize clipper",
     lambda: dm.Optimizer(sgd(clipnorm=1.0), transform_gradients=dm.clip_by_global_norm(2.0)),
     ValueError, ["`clipnorm=1.0`", "ClipByGlobalNorm", "Keep one", "optimizer=SGD(clipnorm=1.0)"]),
    ("inner use_ema with gradient_accumulation_steps",
     lambda: dm.Optimizer.from_keras(sgd(use_ema=True, gradient_accumulation_steps=4)),
     ValueError, ["`use_ema` and `gradient_accumulation_steps`", "every micro-step",
                  "GradientAccumulation(dist_minimize.MovingAverage(", "gradient_accumulation_steps=4"]),
    ("inner gradient_accumulation_steps not an integer",
     lambda: dm.Optimizer.from_keras(sgd(gradient_accumulation_steps=2.5)),
     ValueError, ["`gradient_accumulation_steps` must be an integer", "gradient_accumulation_steps=2.5"]),
    ("inner loss_scale_factor not positive", lambda: dm.Optimizer.from_keras(sgd(loss_scale_factor=-1.0)),
     ValueError, ["`loss_scale_factor`", "loss_scale_factor=-1.0"]),
    ("a wrapper setting given to Optimizer, not from_keras",
     lambda: dm.Optimizer(sgd(use_ema=True, loss_scale_factor=8.0)),
     ValueError, ["use_ema=True, loss_scale_factor=8.0", "MovingAverage, LossScaleOptimizer",
                  "dist_minimize.Optimizer.from_keras(optimizer, ...)", "optimizer=SGD(use_ema=True"]),
    ("Keras clipping argument on Optimizer", lambda: dm.Optimizer(sgd(), clipnorm=1.0),
     ValueError, ["['clipnorm']", "clipnorm"]),
    ("skip_nonfinite not a bool", lambda: dm.Optimizer(sgd(), skip_nonfinite="yes"),
     TypeError, ["skip_nonfinite='yes'"]),
    ("wrapper around a Keras optimizer", lambda: dm.OptimizerWrapper(sgd()),
     TypeError, ["`optimizer`", "type SGD"]),
    ("horovod reduction", lambda: dm.aggregation.HorovodAggregator(reduction="max"),
     ValueError, ["reduction='max'"]),
    ("horovod bytes_per_pack negative", lambda: dm.aggregation.HorovodAggregator(bytes_per_pack=-1),
     ValueError, ["`bytes_per_pack` must be an integer >= 0", "bytes_per_pack=-1"]),
    ("horovod bytes_per_pack not an integer", lambda: dm.aggregation.HorovodAggregator(bytes_per_pack=1.5e6),
     ValueError, ["`bytes_per_pack`", "bytes_per_pack=1500000.0"]),
    ("horovod pack_below negative", lambda: dm.aggregation.HorovodAggregator(pack_below=-5),
     ValueError, ["`pack_below` must be an integer >= 0", "pack_below=-5"]),
    ("horovod shard_collective unknown", lambda: dm.aggregation.HorovodAggregator(shard_collective="alltoall"),
     ValueError, ["`shard_collective`", "'reducescatter'", "shard_collective='alltoall'"]),
]


@pytest.mark.parametrize("fn,exc,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(fn, exc, needles):
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_missing_backend_dependency_names_set_up_step(monkeypatch):
    with pytest.raises(dm.MissingDependencyError) as info:
        horovod_missing(monkeypatch)
    assert "ci/setup.sh" in str(info.value)
    assert "Horovod" in str(info.value)


def test_inner_created_outside_strategy_scope_is_refused():
    strategy = mirrored_strategy()
    opt = dm.Optimizer(sgd())  # outside the scope
    with strategy.scope():
        v = tf.Variable(1.0)
        with pytest.raises(ValueError, match="strategy.scope"):
            opt.build([v])


HOROVODRUN_ENV = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}
TF_CONFIG_2 = ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
               '"task": {"type": "worker", "index": 0}}')


@pytest.mark.parametrize("env,needles", [
    (HOROVODRUN_ENV, ["rank 1 of 2", "horovod started 2 processes", "dist_minimize.horovod_keras.init()",
                      "BroadcastVariablesCallback", "aggregate_gradients='none'"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, ["rank 0 of 3", "openmpi started 3 processes"]),
    ({"TF_CONFIG": TF_CONFIG_2}, ["TF_CONFIG names 2 workers", "MultiWorkerMirroredStrategy().scope()"]),
])
@pytest.mark.parametrize("backend", ["auto", "strategy", "nccl"])
def test_auto_refuses_a_multiprocess_job_with_nothing_to_aggregate(monkeypatch, env, needles, backend):
    """Defect: under horovodrun without hvd.init(), "auto" trained N independent models
    (and "strategy" or "nccl" outside a strategy did the same)."""
    for k in list(os.environ):
        if k.startswith(("HOROVOD_", "OMPI_COMM_WORLD_", "PMI_", "SLURM_")) or k == "TF_CONFIG":
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    v = tf.Variable([1.0])
    opt = dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients=backend)
    with pytest.raises(RuntimeError) as info:
        opt.apply_gradients([(tf.constant([1.0]), v)])
    assert f"aggregate_gradients={backend!r} found nothing to aggregate with" in str(info.value)
    for needle in needles:
        assert needle in str(info.value)
    assert float(v.numpy()[0]) == 1.0  # nothing applied
    # "none" is the caller's explicit statement that it aggregates elsewhere.
    explicit = dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="none")
    explicit.apply_gradients([(tf.constant([1.0]), v)])
    assert float(v.numpy()[0]) == pytest.approx(0.9)


def test_keras_settings_on_a_dist_minimize_optimizer_reach_the_rule_or_raise():
    """Defect: Keras optimizer attributes set on a dist_minimize optimizer (the object
    model.compile received) changed nothing without a word."""
    import tensorflow as tf

    opt = dm.LossScaleOptimizer(dm.Optimizer(keras.optimizers.SGD(0.1, weight_decay=0.2)), initial_scale=1.0)
    assert opt.weight_decay == 0.2  # read from the update rule
    opt.weight_decay = 0.5
    assert opt.stack()[-1].inner_optimizer.weight_decay == 0.5
    v = tf.Variable([2.0])
    opt.apply_gradients([(tf.constant([0.0]), v)])
    assert float(v.numpy()[0]) == pytest.approx(2.0 * (1 - 0.5 * 0.1))  # decayed with the new value
    for name, value, instead in [("clipnorm", 1.0, "clip_by_norm(1.0)"), ("global_clipnorm", 2.0, "clip_by_global_norm(2.0)"),
                                 ("clipvalue", 0.5, "clip_by_value(0.5)"),
                                 ("use_ema", True, "dist_minimize.MovingAverage(optimizer"),
                                 ("gradient_accumulation_steps", 4, "dist_minimize.GradientAccumulation(optimizer, steps=4)")]:
        pattern = f"Setting `{name}`.*{re.escape(instead)}.*Received: {name}={re.escape(repr(value))}"
        with pytest.raises(TypeError, match=pattern):
            setattr(opt, name, value)
    # `update_step` is Keras's: the update rule on one variable, nothing around it
    # (weight decay is applied by Keras's `apply`, not by `update_step`).
    before = float(v.numpy()[0])
    opt.update_step(tf.constant([1.0]), v, 0.1)
    assert float(v.numpy()[0]) == pytest.approx(before - 0.1)
    assert int(opt.iterations.numpy()) == 1  # no counter moved
    # Attributes of the update rule read through, and setting one here is refused.
    assert opt.momentum == 0.0 and opt.nesterov is False
    with pytest.raises(TypeError, match=r"`momentum` belongs to the wrapped Keras optimizer's update rule \(SGD\)"):
        opt.momentum = 0.9
    with pytest.raises(AttributeError, match="no attribute '_momentums'"):
        opt._momentums  # private names never read through


def test_two_aggregating_backends_are_refused():
    with pytest.raises(ValueError, match=r"holds 2 aggregating backends \('strategy', 'nccl'\).*aggregated 2 times"):
        dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients=["strategy", "nccl"])
    with pytest.raises(ValueError, match="holds 2 aggregating backends"):
        dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients=["auto", dm.aggregation.StrategyAggregator()])
    dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients=["none", "strategy", lambda gv: gv])  # one backend


def test_clip_by_norm_skips_an_overflowing_norm():
    """As for the global norm: finite elements whose norm overflows must give a
    skipped step, not a zero step that advances `iterations`."""
    v = tf.Variable([1.0, 1.0])
    opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=dm.clip_by_norm(1.0))
    opt.apply_gradients([(tf.constant([3e38, 3e38]), v)])
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 0
    assert v.numpy().tolist() == [1.0, 1.0]


def test_gradient_predivide_factor_refuses_strings():
    with pytest.raises(TypeError, match="gradient_predivide_factor='2'"):
        dm.aggregation.HorovodAggregator(gradient_predivide_factor="2")
