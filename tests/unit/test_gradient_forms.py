"""Gradients in every form Keras's `apply_gradients` accepts are converted:
Python lists and numbers, NumPy arrays; tensors, IndexedSlices and None are kept."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm

G1 = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])  # float64, for a float32 variable
G2 = [3.0, -2.0]
G3 = 4  # a Python int for a scalar variable


def _setup():
    v1 = tf.Variable(np.ones((2, 3), "float32"), name="v1")
    v2 = tf.Variable([1.0, 2.0], name="v2")
    v3 = tf.Variable(3.0, name="v3")
    opt = dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=dm.clip_by_global_norm(100.0))
    return opt, [v1, v2, v3]


def _run(forms: str, call: str, traced: bool) -> list:
    opt, variables = _setup()
    if forms == "tensors":
        grads = [tf.constant(G1, tf.float32), tf.constant(G2), tf.constant(float(G3))]
    else:
        grads = [G1, G2, G3]

    def step():
        if call == "apply_gradients":
            opt.apply_gradients(list(zip(grads, variables)))
        elif call == "apply_gradients_zip":
            opt.apply_gradients(zip(grads, variables))
        else:
            opt.apply(grads, variables)

    if traced:
        step = tf.function(step)
    for _ in range(2):
        step()
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("call", ["apply_gradients", "apply_gradients_zip", "apply"])
def test_lists_arrays_and_numbers_give_the_same_result_as_tensors(call, traced):
    got = _run("python", call, traced)
    want = _run("tensors", call, traced)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)  # bitwise: the same float32 tensors reach the rule
    assert not np.array_equal(got[0], np.ones((2, 3)))  # and the step was made


def test_tensors_indexed_slices_and_none_are_kept():
    _, (v1, v2, v3) = _setup()
    slices = tf.IndexedSlices(tf.constant([[1.0, 1.0, 1.0]]), tf.constant([1]), tf.constant([2, 3]))
    seen = []

    def record(grads_and_vars):
        seen.extend(g for g, _ in grads_and_vars)
        return grads_and_vars

    opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_unaggregated_gradients=record)
    tensor = tf.constant([1.0, 1.0])
    opt.apply_gradients([(slices, v1), (tensor, v2), (None, v3)])
    assert seen[0] is slices and seen[1] is tensor and seen[2] is None
    np.testing.assert_allclose(v1.numpy(), [[1, 1, 1], [0.9, 0.9, 0.9]])
    np.testing.assert_allclose(v3.numpy(), 3.0)


def test_a_converted_gradient_of_the_wrong_shape_keeps_the_stage_contract_error():
    opt, (v1, v2, v3) = _setup()
    with pytest.raises(ValueError, match=r"returned a gradient of shape \(3,\) for variable `v2.*` of shape \(2,\)"):
        opt.apply_gradients([(G1, v1), ([1.0, 2.0, 3.0], v2), (G3, v3)])


def test_a_gradient_that_does_not_convert_names_its_variable():
    opt, (v1, v2, v3) = _setup()
    with pytest.raises(TypeError, match=r"The gradient of variable `v2.*` must be a tensor.*float32.*Received: a str"):
        opt.apply_gradients([(G1, v1), ("nope", v2), (G3, v3)])
