"""`dist_minimize.elastic`: a fixed global batch of fixed micro-batches on any number of
workers. Which samples form micro-batch j of update t, and in what order, does not
depend on the worker count; each worker takes j = rank, rank + N, ...; a global batch
the workers cannot share in whole micro-batches is refused naming the admissible counts."""

import numpy as np
import pytest
import tensorflow as tf

from dist_minimize import elastic


def taken(samples, global_batch, micro_batch, workers):
    """Per worker, its micro-batches' sample ids in order."""
    ds = tf.data.Dataset.range(samples)
    return [[list(b.numpy()) for b in elastic.micro_batches(ds, global_batch, micro_batch, workers, r)]
            for r in range(workers)]


def per_update(workers_batches, workers, k):
    """update t -> {j: sample ids} rebuilt from the workers' streams."""
    out = {}
    for r, batches in enumerate(workers_batches):
        for n, batch in enumerate(batches):
            t, i = divmod(n, k)
            out.setdefault(t, {})[r + i * workers] = batch
    return out


@pytest.mark.parametrize("workers", [1, 2, 3, 6])
def test_micro_batch_j_of_update_t_is_the_same_samples_whatever_the_worker_count(workers):
    g, b, samples = 24, 4, 100  # 6 micro-batches per update; 4 whole updates (4 samples dropped)
    k = elastic.accumulation_steps(g, b, workers)
    assert k * workers * b == g
    got = per_update(taken(samples, g, b, workers), workers, k)
    want = {t: {j: list(range(t * g + j * b, t * g + (j + 1) * b)) for j in range(g // b)} for t in range(4)}
    assert got == want
    for r, batches in enumerate(taken(samples, g, b, workers)):
        assert len(batches) == 4 * k  # every worker the same number of micro-batches


def test_a_global_batch_the_workers_cannot_share_is_refused_naming_the_admissible_counts():
    assert elastic.admissible_sizes(24, 4) == [1, 2, 3, 6]
    assert elastic.admissible_sizes(24, 4, max_workers=4) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"Admissible worker counts: \[1, 2, 3, 6\]. Received: workers=4"):
        elastic.accumulation_steps(24, 4, 4)
    with pytest.raises(ValueError, match="global_batch=24, micro_batch=5"):
        elastic.accumulation_steps(24, 5, 1)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="workers="):
            elastic.accumulation_steps(24, 4, bad)
    with pytest.raises(ValueError, match="micro_batch=0"):
        elastic.admissible_sizes(24, 0)
    with pytest.raises(ValueError, match=r"rank=2"):
        elastic.micro_batches(tf.data.Dataset.range(10), 4, 2, 2, 2)
    with pytest.raises(ValueError, match="samples="):
        elastic.micro_batches(tf.data.Dataset.range(10).filter(lambda x: x > 0), 4, 2, 2, 0)
