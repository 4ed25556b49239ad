"""`dm.horovod_keras.load_model` (Horovod's `hvd.load_model`) and `SyncBatchNormalization`'s saving, in one process:
Keras optimizer in the file becomes a dist_minimize stack aggregating through Horovod,
with the file's optimizer state and compile arguments; a saved dist_minimize stack is
kept. (Under horovodrun the loaded model trains identically on every rank:
tests/distributed/test_broadcast.py.)"""

import keras
import numpy as np
import pytest

import dist_minimize as dm
from conftest import requires_horovod


def saved(tmp_path, optimizer, name="model.keras"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    model.fit(np.ones((8, 3), "float32"), np.zeros((8, 2), "float32"), batch_size=4, verbose=0)
    path = str(tmp_path / name)
    model.save(path)
    return path, model


@requires_horovod
def test_a_plain_keras_optimizer_is_wrapped_with_the_horovod_backend_and_its_state_kept(tmp_path):
    path, model = saved(tmp_path, keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=1.0))
    loaded = dm.horovod_keras.load_model(path, compression="fp16")
    opt = loaded.optimizer
    assert isinstance(opt, dm.Optimizer)
    (backend,) = [t for t in opt.transforms if isinstance(t, dm.aggregation.Aggregator)]
    assert isinstance(backend, dm.aggregation.HorovodAggregator) and backend.compression == "fp16"
    assert [type(t).__name__ for t in opt.transforms if isinstance(t, dm.GradientTransform)] == ["ClipByGlobalNorm"]
    assert int(opt.iterations.numpy()) == 2
    # (Keras names the loaded variables `dense/...`, the saved ones `sequential/dense/...`)
    assert len(opt.inner_optimizer.variables) == len(model.optimizer.variables) == 4
    for mine, theirs in zip(opt.inner_optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    assert np.max(np.abs(opt.inner_optimizer.variables[-1].numpy())) > 0  # a momentum, not zeros
    assert loaded.get_compile_config()["loss"] == "mse" and loaded.get_compile_config()["metrics"] == ["mae"]


@requires_horovod
def test_a_saved_dist_minimize_stack_is_kept_and_options_for_it_are_refused(tmp_path):
    path, _ = saved(tmp_path, dm.Lookahead(dm.Optimizer(keras.optimizers.Adam(0.01))))
    assert isinstance(dm.horovod_keras.load_model(path).optimizer, dm.Lookahead)
    with pytest.raises(ValueError, match="compression='fp16'"):
        dm.horovod_keras.load_model(path, compression="fp16")


@requires_horovod
def test_a_loss_known_only_through_custom_objects_is_found_when_recompiling(tmp_path):
    @keras.saving.register_keras_serializable(package="test_hk_loss")
    def my_loss(y, p):
        return keras.ops.mean(keras.ops.abs(y - p))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=my_loss)
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), verbose=0)
    model.save(tmp_path / "m.keras")
    keras.saving.get_custom_objects().pop("test_hk_loss>my_loss")  # known only through custom_objects now
    loaded = dm.horovod_keras.load_model(str(tmp_path / "m.keras"), custom_objects={"test_hk_loss>my_loss": my_loss})
    assert isinstance(loaded.optimizer, dm.Optimizer) and loaded.loss is my_loss


def test_custom_optimizers_are_found_by_class_name(tmp_path):
    @keras.saving.register_keras_serializable(package="test_hk")
    class MySGD(keras.optimizers.SGD):
        pass

    path, _ = saved(tmp_path, dm.Optimizer(MySGD(0.1)))
    loaded = dm.horovod_keras.load_model(path, custom_optimizers=[MySGD])
    assert type(loaded.optimizer.inner_optimizer) is MySGD


def test_a_saved_sync_batch_norm_loads_as_itself_and_refuses_what_it_is_not(tmp_path):
    model = keras.Sequential([keras.Input((3,)), dm.horovod_keras.SyncBatchNormalization(momentum=0.7)])
    model(np.ones((2, 3), "float32"), training=True)
    model.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras")
    assert type(again.layers[0]) is dm.horovod_keras.SyncBatchNormalization
    np.testing.assert_array_equal(again.layers[0].moving_mean.numpy(), model.layers[0].moving_mean.numpy())
    with pytest.raises(ValueError, match="synchronized=True"):
        dm.horovod_keras.SyncBatchNormalization(synchronized=True)


@requires_horovod
def test_distributed_optimizer_takes_horovods_arguments():
    import horovod.tensorflow as hvd

    opt = dm.horovod_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0), compression=hvd.Compression.fp16,
                                                op=hvd.Sum, backward_passes_per_step=4,
                                                average_aggregated_gradients=False)
    assert isinstance(opt, dm.GradientAccumulation) and opt.steps == 4 and opt.average is False
    (backend,) = [t for t in opt.stack()[-1].transforms if isinstance(t, dm.aggregation.Aggregator)]
    assert backend.compression == "fp16" and backend.reduction == "sum"
    assert opt.clipnorm == 1.0
    with pytest.raises(ValueError, match="op='max'"):
        dm.horovod_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), op="max")


@requires_horovod
def test_partial_distributed_optimizer_registers_the_layers_weights_and_refuses_unbuilt_ones():
    head = keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), head])
    opt = dm.horovod_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[head])
    assert [opt.stack()[-1].is_local(v) for v in model.trainable_variables] == [False, False, True, True]
    with pytest.raises(ValueError, match="not built"):
        dm.horovod_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[keras.layers.Dense(1)])


def test_local_variables_are_refused_where_they_cannot_be_sound():
    from conftest import mirrored_strategy

    v = keras.Variable([1.0])
    with pytest.raises(ValueError, match=r"rank-local variables: the `transform_gradients` callable\(s\) my_clip"):
        def my_clip(grads_and_vars):
            return grads_and_vars
        dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=my_clip).register_local_var(v)
    built = dm.Optimizer(keras.optimizers.SGD(0.1))
    built.build([v])
    with pytest.raises(ValueError, match="after the optimizer is built"):
        built.register_local_var(v)
    strategy = mirrored_strategy()
    with strategy.scope():
        mirrored = keras.Variable([1.0])
        opt = dm.Optimizer(keras.optimizers.SGD(0.1))
        with pytest.raises(ValueError, match="mirrored"):
            opt.register_local_var(mirrored)


def test_sync_batch_norm_in_one_process_is_batch_norm_and_masked_places_count_for_nothing():
    x = np.random.default_rng(0).normal(loc=3.0, size=(4, 5, 3)).astype("float32")
    mask = np.array([[1, 1, 1, 0, 0]] * 4, bool)
    sync, plain = dm.horovod_keras.SyncBatchNormalization(momentum=0.0), keras.layers.BatchNormalization(momentum=0.0)
    for layer in (sync, plain):
        layer.build(x.shape)
    np.testing.assert_allclose(sync(x, training=True), plain(x, training=True), rtol=1e-5, atol=1e-5)
    poisoned = np.where(mask[..., None], x, np.float32("nan"))  # padding may hold anything
    sync(poisoned, training=True, mask=mask)
    kept = x[:, :3].reshape(-1, 3).astype(np.float64)
    np.testing.assert_allclose(sync.moving_mean.numpy(), kept.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(sync.moving_variance.numpy(), kept.var(axis=0), rtol=1e-5)
    sync(x, training=True, mask=np.zeros((4, 5), bool))  # nothing kept anywhere: 0, not NaN
    assert np.all(np.isfinite(sync.moving_mean.numpy())) and np.all(np.isfinite(sync.moving_variance.numpy()))
