"""dist_minimize.privacy.epsilon: dp-accounting's RDP accountant, checked against bounds
derived here independently for the Gaussian mechanism without subsampling."""

import math

import pytest
from scipy.stats import norm

import dist_minimize as dm
from dist_minimize import privacy


def exact_gaussian_delta(eps, mu):
    """The tight delta(eps) of a Gaussian mechanism of sensitivity/sigma = mu (Balle & Wang 2018)."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (2.0, 10), (4.0, 100)])
def test_full_batch_gaussian_lies_between_the_tight_value_and_the_classic_rdp_bound(sigma, steps):
    delta = 1e-5
    got = privacy.epsilon(sigma, 1.0, steps, delta)
    # Classic RDP -> (eps, delta) conversion over integer and fractional orders: an upper bound.
    rdp = lambda a: a * steps / (2 * sigma ** 2)  # noqa: E731 (T-fold composition of the Gaussian)
    classic = min(rdp(a) + math.log(1 / delta) / (a - 1) for a in [1 + k / 100 for k in range(1, 20000)])
    # The tight epsilon of the composed mechanism (mu = sqrt(T) / sigma): a lower bound.
    mu = math.sqrt(steps) / sigma
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if exact_gaussian_delta(mid, mu) <= delta else (mid, hi)
    tight = hi
    assert tight * 0.999 <= got <= classic * 1.001
    assert got < 1.5 * tight  # and not loose


def test_subsampling_and_steps_move_epsilon_the_right_way():
    base = privacy.epsilon(1.1, 256 / 60000, 1000, 1e-5)
    assert 0 < base < privacy.epsilon(1.1, 256 / 60000, 4000, 1e-5)
    assert privacy.epsilon(1.1, 512 / 60000, 1000, 1e-5) > base
    assert privacy.epsilon(2.2, 256 / 60000, 1000, 1e-5) < base
    assert privacy.epsilon(1.1, 256 / 60000, 1000, 1e-7) > base
    # A published figure of the same accountant's family: sigma 1.3, q = 256/60000, 20
    # epochs, delta 1e-5: 1.34 with Abadi et al.'s moments accountant; RDP is tighter.
    assert 0.9 < privacy.epsilon(1.3, 256 / 60000, 4688, 1e-5) < 1.34


def test_no_steps_no_loss():
    assert privacy.epsilon(1.0, 0.01, 0, 1e-5) == 0.0


def test_sampling_rate():
    assert privacy.sampling_rate(256, 60000) == 256 / 60000
    with pytest.raises(ValueError, match="`global_batch_size` must not exceed `dataset_size`"):
        privacy.sampling_rate(100, 10)
    with pytest.raises(ValueError, match="dataset_size=0"):
        privacy.sampling_rate(1, 0)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"noise_multiplier": 0.0}, ValueError, "noise_multiplier=0.0"),
    ({"noise_multiplier": "1"}, TypeError, "noise_multiplier='1'"),
    ({"sampling_rate": 0.0}, ValueError, r"`sampling_rate` must be a number in \(0, 1\]. Received: sampling_rate=0.0"),
    ({"sampling_rate": 1.5}, ValueError, "sampling_rate=1.5"),
    ({"steps": -1}, ValueError, "`steps` must be an integer >= 0. Received: steps=-1"),
    ({"steps": 1.5}, ValueError, "steps=1.5"),
    ({"delta": 0.0}, ValueError, r"`delta` must be a number in \(0, 1\). Received: delta=0.0"),
    ({"delta": 1.0}, ValueError, "delta=1.0"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = {"noise_multiplier": 1.0, "sampling_rate": 0.01, "steps": 10, "delta": 1e-5, **kwargs}
    with pytest.raises(error, match=match):
        privacy.epsilon(**args)


def test_exported():
    assert dm.privacy is privacy
