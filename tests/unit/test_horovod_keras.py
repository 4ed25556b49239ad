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
