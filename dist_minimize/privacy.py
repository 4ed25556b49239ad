"""Privacy accounting for `dist_minimize.DifferentialPrivacy` (DP-SGD).

`epsilon` asks the RDP accountant of Google's `dp-accounting` package (the accountant
TensorFlow Privacy uses) for the epsilon of a DP-SGD run; nothing here is a hand-written
bound. Each update is a Poisson-subsampled Gaussian mechanism (sampling rate q, noise
multiplier sigma), composed `steps` times, for neighbouring datasets that differ by
adding or removing one example.

Microbatches: with one example per microbatch (`num_microbatches=None`) the sensitivity
is the clipping norm. With several examples per microbatch, adding or removing one example
can change a microbatch's clipped gradient by up to twice the clipping norm, so pass
`noise_multiplier / 2` here (TensorFlow Privacy's `used_microbatching` convention; "How to
DP-fy ML", Ponomareva et al. 2023, section 5.6).
"""

from __future__ import annotations

from dist_minimize import _compat
from dist_minimize.transforms.base import _check_number, check_positive_finite, check_positive_int

__all__ = ["epsilon", "sampling_rate"]


def sampling_rate(global_batch_size: int, dataset_size: int) -> float:
    """q = global batch size / number of training examples, checked.

    Raises:
      ValueError: a size < 1, or a batch larger than the dataset.
    """
    global_batch_size = check_positive_int("global_batch_size", global_batch_size)
    dataset_size = check_positive_int("dataset_size", dataset_size)
    if global_batch_size > dataset_size:
        raise ValueError(f"`global_batch_size` must not exceed `dataset_size`. Received: "
                         f"global_batch_size={global_batch_size}, dataset_size={dataset_size}")
    return global_batch_size / dataset_size


def epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float:
    """The epsilon of (epsilon, delta)-DP after `steps` DP-SGD updates.

    Args:
      noise_multiplier: sigma, the noise's standard deviation over the clipping norm
        (`DifferentialPrivacy`'s `noise_multiplier`), > 0.
      sampling_rate: q in (0, 1], the probability that an example is in a batch (the
        global batch size over the dataset size: `sampling_rate(batch, n)`).
      steps: the number of updates (>= 0; 0 gives 0).
      delta: the target delta, in (0, 1) (usually below 1 / dataset size).

    Returns:
      epsilon, a float (inf when the mechanism gives no finite bound).

    Raises:
      ValueError / TypeError: an argument out of range, naming it.
      MissingDependencyError: dp-accounting is not installed.
    """
    noise_multiplier = check_positive_finite("noise_multiplier", noise_multiplier)
    q = _check_number("sampling_rate", sampling_rate, "a number in (0, 1]")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"`sampling_rate` must be a number in (0, 1]. Received: sampling_rate={sampling_rate!r}")
    steps = check_positive_int("steps", steps, minimum=0)
    d = _check_number("delta", delta, "a number in (0, 1)")
    if not 0.0 < d < 1.0:
        raise ValueError(f"`delta` must be a number in (0, 1). Received: delta={delta!r}")
    if steps == 0:
        return 0.0
    dpa = _compat.import_dp_accounting()
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(noise_multiplier))
    accountant.compose(dpa.SelfComposedDpEvent(event, steps))
    return float(accountant.get_epsilon(d))
