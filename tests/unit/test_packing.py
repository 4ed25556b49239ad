"""dist_minimize/aggregation/packing.py: gradients packed into flat buffers, reduced, and
cut back give exactly what reducing each gradient alone gives."""

import numpy as np
import pytest
import tensorflow as tf

from dist_minimize.aggregation import packing


def grads(seed):
    rng = np.random.default_rng(seed)
    shapes_dtypes = [((3, 4), "float32"), ((4,), "float32"), ((), "float32"), ((3, 4), "float32"),
                     ((2, 2, 2), "float16"), ((5,), "float64"), ((4,), "float32"), ((7, 3), "float16")]
    return [tf.constant(rng.normal(size=s).astype(d)) for s, d in shapes_dtypes]


@pytest.mark.parametrize("bytes_per_pack", [0, 1, 24, 64, 100, 1 << 20])
def test_sum_of_packed_buffers_is_the_sum_of_each_tensor(bytes_per_pack):
    """A stand-in for the collective: the element-wise sum of two processes' buffers.
    Same shapes (3x4 twice, 4 twice) with different values catch any misplaced piece."""
    a, b = grads(0), grads(1)
    pa, spec = packing.pack(a, bytes_per_pack)
    pb, spec_b = packing.pack(b, bytes_per_pack)
    assert spec == spec_b  # same shapes and dtypes: the same buffers on every process
    out = packing.unpack([x + y for x, y in zip(pa, pb)], spec)
    assert len(out) == len(a)
    for got, x, y in zip(out, a, b):
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_array_equal(got.numpy(), (x + y).numpy())  # bitwise: no other arithmetic


def test_buffers_are_per_dtype_bounded_and_ordered():
    g = grads(0)
    buffers, spec = packing.pack(g, 1 << 20)
    # one buffer per dtype, in the order of each dtype's first tensor
    assert [b.dtype for b in buffers] == [tf.float32, tf.float16, tf.float64]
    assert spec.groups == ((0, 1, 2, 3, 6), (4, 7), (5,))
    assert buffers[0].shape == (12 + 4 + 1 + 12 + 4,)
    # 24 bytes: the float32 3x4 (48 bytes) go alone, the small ones fill buffers up to 24
    buffers, spec = packing.pack(g, 24)
    assert all(b.shape.num_elements() * b.dtype.size <= 24 or len(grp) == 1
               for b, grp in zip(buffers, spec.groups))
    assert (0,) in spec.groups and (3,) in spec.groups


def test_a_lone_tensor_is_not_copied_and_zero_packs_nothing():
    g = grads(0)
    buffers, spec = packing.pack(g, 0)
    assert len(buffers) == len(g) and all(b is t for b, t in zip(buffers, g))
    assert all(o is t for o, t in zip(packing.unpack(buffers, spec), g))
    big = tf.zeros([1000])
    buffers, spec = packing.pack([big, tf.ones([2])], 4000)  # 4000 bytes: the big one alone
    assert buffers[0] is big


def test_a_tensor_of_alone_from_bytes_or_more_is_not_packed():
    """The aggregator's `pack_below`: large tensors go as they are (no copy), the small
    ones around them are packed; the reduced values are the same either way."""
    g = grads(0)  # float32: 48, 16, 4, 48, 16 bytes; float16: 16, 42; float64: 40
    buffers, spec = packing.pack(g, 1 << 20, alone_from=48)
    assert spec.groups == ((0,), (1, 2, 6), (3,), (4, 7), (5,))
    assert buffers[0] is g[0] and buffers[2] is g[3]
    b = grads(1)
    out = packing.unpack([x + y for x, y in zip(buffers, packing.pack(b, 1 << 20, alone_from=48)[0])], spec)
    for got, x, y in zip(out, g, b):
        np.testing.assert_array_equal(got.numpy(), (x + y).numpy())
    # the smaller of the two bounds holds: a 100-byte alone_from under 24-byte buffers
    assert packing.pack(g, 24, alone_from=100)[1] == packing.pack(g, 24)[1]
    assert packing.pack(g, 1 << 20, alone_from=0)[1].groups == tuple((i,) for i in range(len(g)))


def test_an_unknown_shape_travels_alone():
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([3], tf.float32)])
    def f(x, y):
        buffers, spec = packing.pack([x, y, y * 2.0], 1 << 20)
        seen["groups"] = spec.groups
        return packing.unpack(buffers, spec)

    out = f(tf.constant([1.0, 2.0]), tf.constant([1.0, 2.0, 3.0]))
    assert seen["groups"] == ((0,), (1, 2))
    np.testing.assert_array_equal(out[0].numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(out[2].numpy(), [2.0, 4.0, 6.0])


def test_unpack_refuses_a_wrong_number_of_buffers():
    buffers, spec = packing.pack(grads(0), 1 << 20)
    with pytest.raises(ValueError, match="expects 3 buffers.*Received: 2"):
        packing.unpack(buffers[:2], spec)
